"""One JAX compilation cache for the whole test session, shared by the in-process runs and every subprocess
(train.py, eval.py, the sweep's runs, the 8-device test): most tests build the same tiny model, and compiling
its init, train, eval and search steps again in each run was most of the suite's time. The cache is fresh for
each session (a temporary directory, removed at the end), so every step is still compiled once per session;
a directory already named by JAX_COMPILATION_CACHE_DIR is used as it is. pytest-xdist's workers inherit the
variable from the controller, which loads this file first, so they share its cache."""

import os
import shutil
import tempfile

_CACHE_DIR = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _CACHE_DIR = tempfile.mkdtemp(prefix="jax_cache_")
    # Set before JAX is imported: subprocesses inherit the environment, and this process reads it at import.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
# The tiny steps compile in well under the default 1 s threshold, so without this little would be cached.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_unconfigure(config):
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
