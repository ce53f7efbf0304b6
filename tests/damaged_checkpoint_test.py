"""Damaged checkpoints and failed saves, on real Orbax checkpoints: a resume and an average of the latest pass over
an unreadable checkpoint (moved aside, never deleted), a kill during an asynchronous save leaves only an
uncommitted directory that a resume ignores, and a save that fails on a full disk stops the run at the next save
or wait with the older checkpoints intact."""

import contextlib
import glob
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from transformer.checkpoint import (CheckpointMismatchError, CheckpointSaveError, CheckpointUnreadableError,
                                    Checkpointer, abstract_like, average_params, average_readable_params)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A failed TensorStore read can leave a callback for Orbax's event loop after that loop has closed ("Event loop is
# closed", printed and otherwise harmless); it is Orbax's, not a failure of the test it lands in.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def tree(seed: int, size: int = 64) -> dict:
    """A small train-state-like pytree whose values differ by seed (params are most of its bytes)."""
    rng = np.random.default_rng(seed)
    return {"params": {"w": rng.normal(size=(size, size)).astype(np.float32),
                       "b": rng.normal(size=(size,)).astype(np.float32)},
            "opt": {"mu": rng.normal(size=(4,)).astype(np.float32)}, "step": np.int32(seed)}


def data_state(step: int) -> bytes:
    return b'{"step": %d}' % step


def write(directory, steps, **kwargs) -> None:
    checkpointer = Checkpointer(str(directory), save_every_steps=1, keep=10, **kwargs)
    for step in steps:
        checkpointer.save(step, tree(step), data_state=data_state(step))
    checkpointer.close()


def contents(directory) -> dict[str, bytes]:
    """Every file under directory by its relative path (unlike tiny.tree_digest, unchanged by a rename)."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, directory)] = handle.read()
    return files


def array_files(step_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(step_dir, "default", "ocdbt.process_*", "d", "*")), key=os.path.getsize)


def truncate(path, keep: float = 0.5) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(int(os.path.getsize(path) * keep))


DAMAGE = {  # what a crash, a full disk or a careless copy leaves in a committed step directory
    "truncated array file": lambda step_dir: truncate(array_files(step_dir)[-1]),
    "deleted array file": lambda step_dir: os.remove(array_files(step_dir)[-1]),
    "missing state item": lambda step_dir: shutil.rmtree(os.path.join(step_dir, "default")),
    "torn state metadata": lambda step_dir: truncate(os.path.join(step_dir, "default", "_METADATA")),
    "missing data item": lambda step_dir: shutil.rmtree(os.path.join(step_dir, "data")),
    "torn data state": lambda step_dir: truncate(os.path.join(step_dir, "data", "process_0-of-1.json")),
}


def damage_arrays(step_dir) -> None:
    for path in array_files(step_dir):
        truncate(path)


def assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def on_device(abstract):
    """With a sharding, as the trainer restores: Orbax then wraps TensorStore's error in one that prints its spec."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)


def set_aside(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if ".damaged-" in name)


@pytest.fixture
def warnings(caplog):
    """The project's warnings (the "transformer" logger, which transformer.console keeps from the root logger)."""
    logger = logging.getLogger("transformer")
    own = not logger.propagate  # else caplog's handler on the root logger sees them already
    if own:
        logger.addHandler(caplog.handler)
    yield lambda: [r.getMessage() for r in caplog.records if r.name == "transformer" and r.levelno == logging.WARNING]
    if own:
        logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_resume_passes_over_an_unreadable_newest_checkpoint_and_saves_that_step_again(tmp_path, damage, warnings):
    directory = tmp_path / "checkpoints"
    write(directory, [1, 2])
    DAMAGE[damage](directory / "2")
    damaged = contents(directory / "2")
    checkpointer = Checkpointer(str(directory), save_every_steps=1, keep=3)
    step, state, restored_data = checkpointer.restore_latest(on_device(abstract_like(tree(1))))
    assert step == 1 and restored_data == data_state(1)  # the data state of the same step as the state
    assert_trees_equal(state, tree(1))
    skipped = [w for w in warnings() if "cannot be read" in w]
    assert len(skipped) == 1 and "\n" not in skipped[0]
    # The root cause by its own type (TensorStore's ValueError, a KeyError, ...), not Orbax's wrapping Exception.
    assert re.match(rf"the checkpoint of step 2 in {re.escape(str(directory))} cannot be read: (?!Exception:)\w+: \S",
                    skipped[0]), skipped[0]
    # Kept, byte for byte, under a name that is no step; the resumed run saves step 2 again beside it.
    (aside,) = set_aside(directory)
    assert aside.startswith("2.damaged-") and contents(directory / aside) == damaged
    assert any(aside in w and "not deleted" in w for w in warnings())
    assert checkpointer.all_steps() == [1] and checkpointer.last_saved == 1
    assert checkpointer.save(2, tree(22), data_state=data_state(22))
    checkpointer.wait()
    step, state, restored_data = checkpointer.restore_latest(abstract_like(tree(1)))
    assert (step, restored_data) == (2, data_state(22))
    assert_trees_equal(state, tree(22))
    checkpointer.close()
    assert set_aside(directory) == [aside]


def test_orbax_neither_lists_nor_collects_a_checkpoint_set_aside(tmp_path):
    directory = tmp_path / "checkpoints"
    write(directory, [1, 2])
    damage_arrays(directory / "2")
    checkpointer = Checkpointer(str(directory), save_every_steps=1, keep=2)
    assert checkpointer.restore_latest(abstract_like(tree(1)))[0] == 1
    (aside,) = set_aside(directory)
    damaged = contents(directory / aside)
    for step in (2, 3, 4, 5):  # keep=2: orbax's garbage collection deletes steps 1 to 3 on the way
        checkpointer.save(step, tree(step))
    checkpointer.close()
    assert sorted(os.listdir(directory)) == sorted(["4", "5", aside])
    assert contents(directory / aside) == damaged
    assert Checkpointer(str(directory), save_every_steps=1, keep=2, read_only=True).all_steps() == [4, 5]


def test_a_checkpoint_of_another_model_is_refused_not_passed_over(tmp_path):
    directory = tmp_path / "checkpoints"
    write(directory, [1])
    checkpointer = Checkpointer(str(directory), save_every_steps=1, keep=3)
    checkpointer.save(2, tree(2, size=32))
    checkpointer.wait()
    before = contents(directory)
    with pytest.raises(CheckpointMismatchError, match=r"'params/b' has shape \(32,\) .*expects \(64,\)"):
        checkpointer.restore_latest(abstract_like(tree(1)))
    checkpointer.close()
    assert contents(directory) == before


def test_when_no_checkpoint_can_be_read_the_resume_fails_and_moves_nothing(tmp_path, warnings):
    directory = tmp_path / "checkpoints"
    write(directory, [1, 2])
    damage_arrays(directory / "1")
    DAMAGE["torn data state"](directory / "2")
    before = contents(directory)
    checkpointer = Checkpointer(str(directory), save_every_steps=1, keep=3)
    with pytest.raises(CheckpointUnreadableError, match=rf"no checkpoint in {re.escape(str(directory))} can be read "
                                                        r"\(steps \[1, 2\]"):
        checkpointer.restore_latest(abstract_like(tree(1)))
    assert [w.split(" cannot")[0] for w in warnings()] == [f"the checkpoint of step {s} in {directory}" for s in (2, 1)]
    checkpointer.close()
    assert contents(directory) == before
    empty = Checkpointer(str(tmp_path / "empty"), save_every_steps=1, keep=3)
    assert empty.restore_latest(abstract_like(tree(1))) is None
    empty.close()


def test_a_read_only_reader_passes_over_damage_and_moves_nothing(tmp_path):
    directory = tmp_path / "checkpoints"
    write(directory, [1, 2])
    damage_arrays(directory / "2")
    before = contents(directory)
    reader = Checkpointer(str(directory), save_every_steps=1, keep=3, use_async=False, read_only=True)
    step, state, _ = reader.restore_latest(abstract_like(tree(1)))
    assert step == 1 and reader.all_steps() == [1, 2]
    assert_trees_equal(state, tree(1))
    reader.close()
    assert contents(directory) == before


def test_averaging_the_latest_passes_over_unreadable_params_and_a_named_step_fails_clearly(tmp_path, warnings):
    states_dir, snapshots_dir = tmp_path / "checkpoints", tmp_path / "params"
    write(states_dir, [1, 2, 3])
    snapshots = Checkpointer(str(snapshots_dir), save_every_steps=1, keep=5)
    for step in (2, 3):
        snapshots.save(step, {"params": tree(step)["params"]})
    snapshots.wait()
    damage_arrays(states_dir / "2"), damage_arrays(snapshots_dir / "2")  # step 2: unreadable from both
    damage_arrays(states_dir / "3")  # step 3: its snapshot still reads
    states = Checkpointer(str(states_dir), save_every_steps=1, keep=5, read_only=True)
    abstract = abstract_like(tree(1)["params"])
    sources = [(c, s) for s in (1, 2, 3) for c in (states, snapshots) if s in c.all_steps()]  # full states first
    averaged, steps = average_readable_params(sources, abstract, count=2)
    assert steps == [1, 3]
    expected = jax.tree.map(lambda a, b: (a + b) / 2, tree(1)["params"], tree(3)["params"])
    for a, b in zip(jax.tree.leaves(averaged), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert sorted(re.match(r"the checkpoint of step (\d) in (\S+) ", w).groups() for w in warnings()) == [
        ("2", str(states_dir)), ("2", str(snapshots_dir)), ("3", str(states_dir))]
    assert average_readable_params(sources, abstract, count=5)[1] == [1, 3]  # fewer than asked: the caller decides
    # A step asked for by number is read or refused, never replaced by another.
    with pytest.raises(CheckpointUnreadableError, match=rf"step 2 in {re.escape(str(states_dir))} cannot be read"):
        average_params([(states, 1), (states, 2)], abstract)
    with pytest.raises(CheckpointUnreadableError, match=rf"no checkpoint in {re.escape(str(states_dir))} or "
                                                        rf"{re.escape(str(snapshots_dir))} can be read \(steps \[2\]"):
        average_readable_params([(states, 2), (snapshots, 2)], abstract, count=1)
    states.close(), snapshots.close()


KILLED_DURING_SAVE = """
import os, signal, sys
import numpy as np
sys.path.insert(0, "tests")
from damaged_checkpoint_test import data_state, tree
from transformer.checkpoint import Checkpointer
checkpointer = Checkpointer(sys.argv[1], save_every_steps=1, keep=3)
checkpointer.save(1, tree(1), data_state=data_state(1))
checkpointer.wait()
large = {"w": np.random.default_rng(0).normal(size=(8 << 20,)).astype(np.float32)}  # 32 MB: tenths of a second
checkpointer.save(2, large, data_state=data_state(2))  # returns once the temporary directory exists
os.kill(os.getpid(), signal.SIGKILL)  # while the background write runs
"""


def test_a_kill_during_an_asynchronous_save_leaves_an_uncommitted_directory_that_a_resume_ignores(tmp_path):
    directory = tmp_path / "checkpoints"
    killed = subprocess.run([sys.executable, "-c", KILLED_DURING_SAVE, str(directory)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(os.listdir(directory)) == ["1", "2.orbax-checkpoint-tmp"]
    checkpointer = Checkpointer(str(directory), save_every_steps=1, keep=3)
    assert checkpointer.all_steps() == [1]
    step, state, restored_data = checkpointer.restore_latest(abstract_like(tree(1)))
    assert (step, restored_data) == (1, data_state(1))
    assert_trees_equal(state, tree(1))
    # Saving step 2 again replaces the uncommitted directory (orbax reuses its name), which held no checkpoint.
    assert checkpointer.save(2, tree(2), data_state=data_state(2))
    checkpointer.close()
    assert sorted(os.listdir(directory)) == ["1", "2"]
    reader = Checkpointer(str(directory), save_every_steps=1, keep=3, read_only=True)
    assert_trees_equal(reader.restore(abstract_like(tree(1))), tree(2))
    reader.close()


def large(step: int) -> dict:
    """1 MiB of incompressible float32: over the file size limit below, where tree() is well under it."""
    return {"w": np.random.default_rng(step).normal(size=(1 << 18,)).astype(np.float32)}


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes in a file fail with EFBIG, as a full disk's fail with ENOSPC (SIGXFSZ ignored,
    so the write returns the error instead of killing the process); both limits are restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("use_async, surfaces", [(True, "next save"), (True, "wait"), (True, "step between saves"),
                                                 (False, "the save itself")])
def test_a_failed_save_raises_at_the_next_save_or_wait_and_keeps_the_older_checkpoints(tmp_path, use_async, surfaces):
    # The kernel refuses the write (RLIMIT_FSIZE, EFBIG), through the same TensorStore write path a full disk
    # fails on; this needs no privileges (the ENOSPC test below needs a mount of its own).
    directory = tmp_path / "checkpoints"
    checkpointer = Checkpointer(str(directory), save_every_steps=2, keep=2, use_async=use_async)
    for step in (2, 4):
        checkpointer.save(step, large(step), data_state=data_state(step))
    checkpointer.wait()
    before = contents(directory)
    with file_size_limit(256 << 10), pytest.raises(CheckpointSaveError) as raised:
        checkpointer.save(6, large(6), data_state=data_state(6))  # keep=2: step 2 would go once step 6 commits
        if surfaces == "wait":
            checkpointer.wait()
        elif surfaces == "step between saves":
            while checkpointer.manager.is_saving_in_progress():
                time.sleep(0.01)
            checkpointer.save(7, large(7))  # no checkpoint step: only the check of the save before it runs
        else:
            checkpointer.save(8, large(8), data_state=data_state(8))
    assert str(raised.value) == (f"the checkpoint of step 6 could not be saved in {directory}: EFBIG (File too "
                                 "large); the older checkpoints there (steps [2, 4]) are kept")
    checkpointer.wait()  # reported once
    checkpointer.close()
    assert {k: v for k, v in contents(directory).items() if k.split("/")[0] in ("2", "4")} == before
    reader = Checkpointer(str(directory), save_every_steps=2, keep=2, read_only=True)
    assert reader.all_steps() == [2, 4]
    assert_trees_equal(reader.restore(abstract_like(large(4))), large(4))
    assert reader.restore_data_state(2) == data_state(2)
    reader.close()


NO_MOUNT = 77  # the child's exit status when it may not mount a tmpfs
FULL_DISK = """
import json, sys
sys.path.insert(0, "tests")
from damaged_checkpoint_test import assert_trees_equal, data_state, large, tree
from transformer.checkpoint import Checkpointer, CheckpointSaveError, abstract_like
from transformer.restore import restore
directory = sys.argv[1]
checkpointer = Checkpointer(directory, save_every_steps=2, keep=2)
for step in (2, 4):
    checkpointer.save(step, tree(step), data_state=data_state(step))
checkpointer.wait()
checkpointer.save(6, large(6), data_state=data_state(6))  # 1 MiB into a 768 KiB disk
try:
    checkpointer.save(8, tree(8))
    message = None
except CheckpointSaveError as error:
    message = str(error)
reader = Checkpointer(directory, save_every_steps=2, keep=2, read_only=True)
for step in reader.all_steps():
    assert_trees_equal(reader.restore(abstract_like(tree(step)), step), tree(step))
print(json.dumps({"message": message, "steps": reader.all_steps()}))
"""


def test_a_save_onto_a_full_disk_raises_at_the_next_save_and_keeps_the_older_checkpoints(tmp_path):
    # A real full disk (ENOSPC): a 768 KiB tmpfs in a mount namespace of the subprocess's own, gone when it exits.
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    mount = tmp_path / "disk"
    mount.mkdir()
    script = (f'mount -t tmpfs -o size=768k tmpfs "{mount}" || exit {NO_MOUNT}\n'
              f'exec "{sys.executable}" -c "$0" "{mount}/checkpoints"')
    child = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, FULL_DISK],
                           cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if child.returncode == NO_MOUNT or child.stderr.startswith("unshare:"):
        pytest.skip(f"no tmpfs of its own here (needs CAP_SYS_ADMIN): {child.stderr.strip()[:200]}")
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result == {"steps": [2, 4], "message": (
        f"the checkpoint of step 6 could not be saved in {mount}/checkpoints: ENOSPC (No space left on device); "
        "the older checkpoints there (steps [2, 4]) are kept")}


# ----------------------------------------------------------------------------------------------------
# The trainer and eval on damaged and unwritable workdirs


def test_a_run_resumes_and_eval_restores_past_a_damaged_newest_checkpoint(tmp_path):
    from tiny import make_tiny_config
    from transformer import trainer
    from transformer.restore import restore

    workdir = tmp_path / "run"
    trainer.Run(make_tiny_config(**{"decode.bleu_splits": ""}), str(workdir)).train()  # checkpoints 3 and 6
    damage_arrays(workdir / "checkpoints" / "6")
    damage_arrays(workdir / "params" / "6")  # the params snapshot of step 6 too, so nothing of it reads
    restored = restore(str(workdir))
    assert restored.step == 3  # the warning naming step 6 is tested on the Checkpointer above
    with pytest.raises(CheckpointUnreadableError, match="step 6"):
        restore(str(workdir), 6)  # a step asked for by name is not replaced by another
    run = trainer.Run(make_tiny_config(**{"decode.bleu_splits": "", "train.num_train_steps": 9}), str(workdir))
    assert int(run.state.step) == 3 and set_aside(workdir / "checkpoints")  # kept, under a name Orbax ignores
    run.train()
    assert run.checkpoints.states.all_steps() == [3, 6, 9]  # step 6 saved again, nothing overwritten


def test_a_run_whose_save_fails_stops_with_the_step_and_keeps_the_older_checkpoints(tmp_path):
    from tiny import make_tiny_config
    from transformer import trainer

    workdir = tmp_path / "run"
    config = make_tiny_config(**{"decode.bleu_splits": "", "train.num_train_steps": 12, "train.eval_every_steps": 0})
    run = trainer.Run(config, str(workdir))
    run.checkpoints.states.save(3, run.state, data_state=b"{}", force=True)  # a committed checkpoint to keep
    run.checkpoints.states.wait()
    before = contents(workdir / "checkpoints" / "3")
    with file_size_limit(64 * 1024), pytest.raises(CheckpointSaveError,
                                                   match=r"step (6|9) could not be saved.*steps \[3\]"):
        run.train()
    assert contents(workdir / "checkpoints" / "3") == before
