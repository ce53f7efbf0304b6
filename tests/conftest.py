"""One temporary directory for the whole test session, shared by the in-process runs, pytest-xdist's workers and
every subprocess (train.py, eval.py, the sweep's runs, the 8-device test), which all inherit the environment set
here by the first pytest process (the controller loads this file before it starts the workers):
- JAX's compilation cache: most tests build the same tiny model, and compiling its init, train, eval and search
  steps again in each run was most of the suite's time. Every step is still compiled once per session. A
  directory already named by JAX_COMPILATION_CACHE_DIR is used as it is.
- TRANSFORMER_CACHE_DIR, where transformer.throughput caches the CPU's measured matmul peak: measured while the
  other worker runs, a peak would be too low, and it must not reach the cache of the user's own runs.
The directory is removed at the end of the session."""

import logging
import os
import shutil
import tempfile

import pytest

_SESSION_DIR = None
if "TRANSFORMER_TESTS_DIR" not in os.environ:  # the first pytest process of the session (not a worker)
    _SESSION_DIR = tempfile.mkdtemp(prefix="transformer_tests_")
    os.environ["TRANSFORMER_TESTS_DIR"] = _SESSION_DIR
    # Set before JAX is imported: subprocesses inherit the environment, and this process reads it at import.
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_SESSION_DIR, "jax_cache")
    os.environ["TRANSFORMER_CACHE_DIR"] = os.path.join(_SESSION_DIR, "cache")
# The tiny steps compile in well under the default 1 s threshold, so without this little would be cached.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# LLVM's optimisation of the CPU code is much of a tiny step's compile time, and the tests run each step a few
# times: unoptimised codegen takes ~20% off the CPU time of tests/decode_test.py. XLA's own HLO passes still run,
# so the HLO tested is what users run, only compiled to less optimised machine code. Subprocesses that set
# XLA_FLAGS themselves compile as usual.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def pytest_unconfigure(config):
    if _SESSION_DIR is not None:
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)


@pytest.fixture
def warnings(caplog):
    """The warnings of the project's console logger (which does not propagate to pytest's root handler)."""
    logger = logging.getLogger("transformer")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def drawn(monkeypatch):
    """split -> how many pairs the built-in generator has yielded of it (the real generator, counted): a test
    of what a start reads."""
    from transformer import corpus
    counts = {}
    generate = corpus.iter_builtin_split

    def counted(split, **kwargs):
        for pair in generate(split, **kwargs):
            counts[split] = counts.get(split, 0) + 1
            yield pair
    monkeypatch.setattr(corpus, "iter_builtin_split", counted)
    return counts


# The files that take longest (mostly subprocesses: 8 fake devices, whole train.py runs) go first: pytest-xdist hands
# out whole files in collection order, and one of them started last keeps a worker busy after the other is done.
LONGEST_FIRST = ("sharding_test.py", "sweep_test.py", "startup_test.py", "families_test.py", "decode_cli_test.py",
                 "preemption_test.py", "decode_devices_test.py", "train_test.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))  # stable: files keep their order
