"""Orbax checkpoints of the TrainState in `workdir/checkpoints`: periodic async saves, keep-N, resume.

Each checkpoint holds two items: `default`, the TrainState, and `data`, the input pipeline's iterator state, one
JSON file per process written by grain's Orbax handler, so a resumed run continues the data exactly.

Evaluation and averaging read parameters only (`restore_params`, a partial restore), from full states or from
params snapshots (`workdir/params`: checkpoints whose state is `{"params": ...}`), which a run keeps for the
last `decode.average_last` checkpoints so that averaging N needs N parameter sets on disk, not N train states.

A restore first compares the checkpoint's array shapes with the model being built, so a checkpoint
from another model shape fails with a message naming the first differing parameter, and is not touched.

Damage and failed saves: a resume (`restore_latest`) and an evaluation of the latest checkpoints
(`average_readable_params`) pass over a checkpoint that cannot be read (a truncated or missing array file, a
missing item, torn metadata) with a warning, and use the one before it; a resume then moves the unreadable ones
aside (`<step>.damaged-<time>`, a name Orbax does not list, keep or delete), so that it saves those steps again
without overwriting anything. A save whose background write failed (a full disk) raises CheckpointSaveError at
the next `save` or `wait`; Orbax keeps the older checkpoints, and only a committed save replaces them.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import time
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from transformer.console import log
from transformer import errors
from transformer import files
from transformer.errors import CheckpointMismatchError
from transformer.workdir import BEST_CHECKPOINT_DIR, CHECKPOINTS_DIR, PARAMS_DIR

PyTree = Any
DAMAGED_MARK = ".damaged-"  # <step>.damaged-<time>: not a step name to Orbax (digits only), so never listed


class CheckpointUnreadableError(errors.ReportedError, RuntimeError):
    """A checkpoint that cannot be read (a truncated or missing file, a missing item, torn metadata): damage, not
    a different model."""


class CheckpointSaveError(errors.ReportedError, RuntimeError):
    """A save that failed (a full disk, an unwritable directory); the older checkpoints are kept."""


def _first_line(error: BaseException) -> str:
    """An Orbax or TensorStore error in one line: its root cause (Orbax wraps TensorStore's status in an
    Exception that prints the whole TensorStore spec), without the spec some of them append."""
    while error.__cause__ is not None:
        error = error.__cause__
    message = error.args[0] if isinstance(error, KeyError) and error.args else error  # KeyError quotes its str
    lines = str(message).strip().splitlines()
    text = lines[0].split(" [tensorstore_spec=")[0] if lines else ""
    return f"{type(error).__name__}: {text[:300]}"


def _os_error(error: BaseException) -> str:
    """The OS error under a failed write (TensorStore reports it as os_error_code), else its first line."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"{errno.errorcode.get(seen.errno, seen.errno)} ({seen.strerror})"
        match = re.search(r"os_error_code='?(\d+)", str(seen))
        if match:
            code = int(match.group(1))
            return f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"
        seen = seen.__cause__ or seen.__context__
    return _first_line(error)


def _on_every_process(ok: bool) -> bool:
    """Whether `ok` holds on every process: processes that chose different checkpoints would train apart."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils
    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def _path_str(path) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path)


def _shapes_by_path(tree: PyTree) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_str(path): tuple(leaf.shape) for path, leaf in leaves if hasattr(leaf, "shape")}


def check_compatible(saved: PyTree, expected: PyTree, directory: str) -> None:
    """Raise CheckpointMismatchError naming the first missing, unexpected or differently shaped array."""
    saved_shapes, expected_shapes = _shapes_by_path(saved), _shapes_by_path(expected)
    for name in sorted(expected_shapes, key=lambda n: (not n.startswith("params"), n)):  # params first
        if name not in saved_shapes:
            raise CheckpointMismatchError(
                f"checkpoint in {directory} has no array {name!r}: it was written by a different model or "
                "optimizer configuration. Use another --workdir, or the config the checkpoint was trained with "
                "(saved as config.json beside it).")
        if saved_shapes[name] != expected_shapes[name]:
            raise CheckpointMismatchError(
                f"checkpoint in {directory}: {name!r} has shape {saved_shapes[name]} but the model built from "
                f"this config expects {expected_shapes[name]}. Use another --workdir, or the config the "
                "checkpoint was trained with (saved as config.json beside it).")
    extra = sorted(set(saved_shapes) - set(expected_shapes))
    if extra:
        raise CheckpointMismatchError(
            f"checkpoint in {directory} holds {extra[0]!r}, which the model built from this config does not have.")


STATE_ITEM, DATA_ITEM = "default", "data"


def _data_state_files(directory: str) -> list[str]:
    """The data iterator state files of a checkpoint's data item to read: this process's, else every process's (a
    checkpoint written by another number of processes: the states must agree)."""
    own = os.path.join(directory, f"process_{jax.process_index()}-of-{jax.process_count()}.json")
    if files.exists(own):
        return [own]
    names = [os.path.join(directory, name) for name in files.list_dir(directory)
             if fnmatch.fnmatch(name, "process_*-of-*.json")]
    if not names:
        raise FileNotFoundError(f"{directory} holds no data iterator state (process_<i>-of-<n>.json)")
    return names


def _unused_path(directory: str, name: str) -> str:
    """directory/name, or with -1, -2 ... appended where that exists."""
    path, attempt = os.path.join(directory, name), 1
    while files.exists(path):
        path, attempt = os.path.join(directory, f"{name}-{attempt}"), attempt + 1
    return path


class IteratorState:
    """A data iterator's state (JSON bytes), captured when the step is saved, in the form grain's handler
    writes and reads. Handing grain the live iterator instead would let an asynchronous save record the
    state of a later step, and the trainer's device prefetch runs the iterator ahead of the saved step."""

    def __init__(self, state: bytes = b""):
        self.state = state

    def get_state(self) -> bytes:
        return self.state

    def set_state(self, state: bytes) -> None:
        self.state = state

    def start_prefetch(self) -> None:  # called by grain's handler after a restore
        pass


class Checkpointer:
    """A thin owner of one ocp.CheckpointManager. With `best_metric`, it keeps the `keep` checkpoints with the
    highest value of that metric (passed to `save`) instead of the last ones."""

    def __init__(self, directory: str, *, save_every_steps: int, keep: int, use_async: bool = True,
                 read_only: bool = False, best_metric: str | None = None):
        self.directory = files.absolute(directory)
        self.save_every_steps = save_every_steps
        self.read_only = read_only
        best = {} if best_metric is None else dict(
            best_fn=lambda metrics: metrics[best_metric], best_mode="max", keep_checkpoints_without_metrics=False)
        # The interval is ours to apply (orbax's policy would also save the very first step of a run).
        # Orbax names its cross-process barriers by step: managers saving the same step at once (train states and
        # params snapshots) would share a barrier across processes unless each has its own prefix.
        barriers = ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=os.path.basename(self.directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=use_async,
                                               create=not read_only, read_only=read_only,
                                               multiprocessing_options=barriers, **best)
        # Naming the handler lets a fresh manager read an existing checkpoint's metadata (for the shape check).
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(), DATA_ITEM: grain.checkpoint.CheckpointHandler()})
        self.last_saved = self.manager.latest_step()  # the newest committed step when this run started
        self.pending: int | None = None  # the step of an asynchronous save not yet known to have committed

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Inside, an error reading `step` is a CheckpointUnreadableError naming it; a mismatch stays one."""
        try:
            yield
        except (CheckpointMismatchError, MemoryError):
            raise
        # Damage surfaces as TensorStore's ValueError (a truncated or missing array file), KeyError (a missing
        # item), JSONDecodeError (torn metadata) or OSError, so anything else raised while reading is damage.
        except Exception as error:
            raise CheckpointUnreadableError(f"the checkpoint of step {step} in {self.directory} cannot be read: "
                                            f"{_first_line(error)}") from error

    def restore(self, abstract_state: PyTree, step: int | None = None) -> PyTree:
        """Restore `step` (default: latest) into the structure, shapes and dtypes of `abstract_state`.
        Raises CheckpointMismatchError (another model) or CheckpointUnreadableError (damage)."""
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; found {self.all_steps()}")
        with self._reading(step):
            check_compatible(self.manager.item_metadata(step)[STATE_ITEM], abstract_state, self.directory)
            args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state)})
            return self.manager.restore(step, args=args)[STATE_ITEM]

    def restore_data_state(self, step: int) -> bytes | None:
        """This process's data iterator state saved at `step`; None for a checkpoint saved without one.

        Every process's state is the same (each computes the whole packing plan and takes its own block of rows),
        so a checkpoint written by another number of processes restores onto this one: its files
        (`process_<i>-of-<n>.json`, grain's names) are read and must agree. A missing or torn state of a
        checkpoint that saved one raises CheckpointUnreadableError."""
        directory = os.path.join(self.directory, str(step), DATA_ITEM)
        with self._reading(step):
            if not files.is_dir(directory):
                # The step's metadata lists the items it saved: one saved before any batch (0 steps) has no data item.
                if DATA_ITEM in (self.manager.metadata(step).item_handlers or {}):
                    raise FileNotFoundError(f"its data iterator state ({directory}) is missing")
                return None
            states = [files.read_bytes(name) for name in _data_state_files(directory)]
            parsed = {json.dumps(json.loads(s), sort_keys=True) for s in states}  # a torn file fails here
        if len(parsed) > 1:
            raise CheckpointMismatchError(f"the data iterator states in {directory} differ between processes, so "
                                          f"they cannot be restored onto {jax.process_count()} process(es)")
        return states[0]

    def restore_latest(self, abstract_state: PyTree) -> tuple[int, PyTree, bytes | None] | None:
        """(step, state, data iterator state) of the newest checkpoint that can be read, both from that step; None
        when there is none. An unreadable one is passed over with a warning and, unless read-only, moved aside by
        process 0 (`<step>.damaged-<time>`, kept but no longer a step), so that this run saves that step again.
        A CheckpointMismatchError (another model) is raised, not passed over; CheckpointUnreadableError when no
        checkpoint can be read (then nothing is moved)."""
        steps, unreadable = self.all_steps(), []
        for step in reversed(steps):
            try:
                state, data_state = self.restore(abstract_state, step), self.restore_data_state(step)
                error = None
            except CheckpointUnreadableError as raised:
                error = raised
            if _on_every_process(error is None):
                self._set_aside(unreadable)
                return step, state, data_state
            log.warning("%s; passed over", error or f"the checkpoint of step {step} in {self.directory} cannot be "
                        "read on another process")
            unreadable.append(step)
        if not steps:
            return None
        raise CheckpointUnreadableError(f"no checkpoint in {self.directory} can be read (steps {steps}, each "
                                        "warned above); move them aside or use another --workdir")

    def _set_aside(self, steps: list[int]) -> None:
        """Rename the unreadable `steps` to names Orbax ignores, so that saving them again overwrites nothing."""
        if not steps or self.read_only:
            return
        if jax.process_index() == 0:
            for step in steps:
                target = _unused_path(self.directory, f"{step}{DAMAGED_MARK}{time.strftime('%Y%m%dT%H%M%S')}")
                epath.Path(self.directory, str(step)).rename(target)
                log.warning("moved the unreadable checkpoint of step %d aside to %s (kept, not deleted), so this run "
                            "can save step %d again", step, target, step)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"checkpoints set aside in {self.directory}")
        self.manager.reload()
        self.last_saved = self.manager.latest_step()

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def save(self, step: int, state: PyTree, *, data_state: bytes | None = None, force: bool = False,
             metrics: dict[str, float] | None = None) -> bool:
        """Start an asynchronous save when `step` is a multiple of save_every_steps (or force); returns whether
        it saves. The state is copied to the host before this returns, so the caller may donate it next.
        `data_state`: the data iterator's state after the batch of `step` (see IteratorState).

        Raises CheckpointSaveError for this save, or for an earlier one whose background write failed: checked
        at every call (without waiting while a save is still writing), so the loop stops within a step of it."""
        if self.pending is not None and not self.manager.is_saving_in_progress():
            self._finish_pending()
        if not force and step % self.save_every_steps:
            return False
        # Already saved (a forced save, e.g. a train.report_minutes mark, or the end): decided on what this object
        # saved, not on the disk, which processes may see at different moments while an async save commits.
        if step == self.last_saved:
            return False
        self._finish_pending()  # orbax would wait for it anyway; waiting here lets its error name its own step
        if step in self.all_steps():  # written by an earlier run: a checkpoint is never overwritten
            log.warning("a checkpoint of step %d is already in %s; it is kept and this run's step %d is not saved",
                        step, self.directory, step)
            return False
        items = {STATE_ITEM: ocp.args.StandardSave(state)}
        if data_state is not None:
            items[DATA_ITEM] = grain.checkpoint.CheckpointSave(IteratorState(data_state))
        try:
            saved = self.manager.save(step, args=ocp.args.Composite(**items), force=True, metrics=metrics)
        except Exception as error:  # a synchronous save's write, or an asynchronous one's directory creation
            raise self._save_error(step, error) from error
        if saved:
            self.last_saved = step
            self.pending = step
        return saved

    def _finish_pending(self) -> None:
        """Wait for the asynchronous save in flight; CheckpointSaveError if it failed."""
        step, self.pending = self.pending, None
        try:
            self.manager.wait_until_finished()  # raises a failed background write's error, once
        except Exception as error:
            raise self._save_error(step, error) from error

    def _save_error(self, step: int | None, error: BaseException) -> CheckpointSaveError:
        self.manager.reload()  # a failed save already dropped the steps it was to replace from orbax's list
        kept = self.all_steps()
        return CheckpointSaveError(
            f"the checkpoint of step {step} could not be saved in {self.directory}: {_os_error(error)}; " + (
                f"the older checkpoints there (steps {kept}) are kept" if kept else "there is no older checkpoint"))

    def check_params(self, abstract_params: PyTree, step: int) -> None:
        """Raise, naming the step or the first differing array, unless `step` holds parameters of these shapes."""
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; found {self.all_steps()}")
        with self._reading(step):
            saved = self.manager.item_metadata(step)[STATE_ITEM]
            check_compatible({"params": saved["params"]}, {"params": abstract_params}, self.directory)

    def restore_params(self, abstract_params: PyTree, step: int, *, checked: bool = False) -> PyTree:
        """Only the parameters of `step`, into the shapes and shardings of `abstract_params`: a partial restore
        that reads neither Adam's moments nor the rest (a third of the state's bytes), from a full state or a
        params snapshot alike (both hold a `params` subtree). `checked`: check_params has already passed."""
        if not checked:
            self.check_params(abstract_params, step)
        target = {"params": abstract_params}
        args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                      partial_restore=True)
        path = os.path.join(self.directory, str(step), STATE_ITEM)
        with self._reading(step):
            return ocp.PyTreeCheckpointer().restore(path, args=args)["params"]

    def wait(self) -> None:
        """Wait until every save has committed; CheckpointSaveError if one failed."""
        self._finish_pending()

    def close(self) -> None:
        """Wait, then close the manager (also after a failed save, whose CheckpointSaveError this raises)."""
        try:
            self.wait()
        finally:
            self.manager.close()


def average_params(sources: list[tuple[Checkpointer, int]], abstract_params: PyTree) -> PyTree:
    """The mean of the parameters of each (checkpointer, step) (the paper's checkpoint averaging), summed on the
    devices in the shardings of `abstract_params`, so that no process holds more than its shards. Every
    checkpoint is found and its shapes checked before any is read; one that cannot be read raises
    CheckpointUnreadableError (these are the steps asked for)."""
    for checkpointer, step in sources:
        try:
            checkpointer.check_params(abstract_params, step)
        except CheckpointMismatchError as error:
            raise CheckpointMismatchError(f"cannot average step {step}: {error}") from error
    total = None
    for checkpointer, step in sources:
        params = checkpointer.restore_params(abstract_params, step, checked=True)
        total = params if total is None else _add(total, params)
    return _scale(total, 1.0 / len(sources))


def average_readable_params(sources: list[tuple[Checkpointer, int]], abstract_params: PyTree,
                            count: int) -> tuple[PyTree, list[int]]:
    """The mean of the parameters of the newest `count` steps of `sources` that can be read, and those steps
    (ascending; fewer than `count` when fewer can be read): for the latest checkpoints, where no step was named.
    A step listed by several checkpointers is read from the first listed that can read it. An unreadable one is
    passed over with a warning; a CheckpointMismatchError is raised; CheckpointUnreadableError when none can be
    read."""
    holders: dict[int, list[Checkpointer]] = {}
    for checkpointer, step in sources:
        holders.setdefault(step, []).append(checkpointer)
    total, used = None, []
    for step in sorted(holders, reverse=True):
        if len(used) == count:
            break
        for checkpointer in holders[step]:
            params = None
            try:
                params = checkpointer.restore_params(abstract_params, step)
            except CheckpointMismatchError as error:
                raise CheckpointMismatchError(f"cannot average step {step}: {error}") from error
            except CheckpointUnreadableError as error:
                log.warning("%s; passed over", error)
            # Each process reads its own shards: a step is used only where every process could read it.
            if not _on_every_process(params is not None):
                continue
            total, used = (params if total is None else _add(total, params)), used + [step]
            break
    if not used:
        where = " or ".join(dict.fromkeys(checkpointer.directory for checkpointer, _ in sources))
        raise CheckpointUnreadableError(f"no checkpoint in {where} can be read (steps {sorted(holders)}, each "
                                        "warned above)")
    return _scale(total, 1.0 / len(used)), sorted(used)


# Donating the running sum keeps one sum and one checkpoint's parameters on the devices, whatever N.
_add = jax.jit(lambda total, params: jax.tree.map(jnp.add, total, params), donate_argnums=0)
_scale = jax.jit(lambda total, factor: jax.tree.map(lambda x: (x * factor).astype(x.dtype), total), donate_argnums=0)


def abstract_like(tree: PyTree) -> PyTree:
    """ShapeDtypeStructs of a concrete or abstract tree (what StandardRestore restores into)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


class RunCheckpoints:
    """A training run's checkpoints in its workdir: the train states (checkpoints/: every `every` steps and where
    the run forces a save, the last `keep` kept); with average_last > 1 a params snapshot of each of the last
    average_last saves (params/), which the end's averaging reads, so that averaging N needs N parameter sets on
    disk rather than N train states; and with keep_best the params of the best dev BLEU (best_checkpoint/,
    `open_best`). `before_save` runs before each save (the workdir lock's check)."""

    def __init__(self, workdir: str, *, every: int, keep: int, use_async: bool, average_last: int,
                 before_save=lambda: None):
        self.workdir, self.use_async, self.average_last = workdir, use_async, average_last
        self.before_save = before_save
        self.states = Checkpointer(os.path.join(workdir, CHECKPOINTS_DIR), save_every_steps=every, keep=keep,
                                   use_async=use_async)
        self.snapshots = Checkpointer(os.path.join(workdir, PARAMS_DIR), save_every_steps=1, keep=average_last,
                                      use_async=use_async) if average_last > 1 else None
        self.best: Checkpointer | None = None
        self.closed = False

    def open_best(self) -> None:
        self.best = Checkpointer(os.path.join(self.workdir, BEST_CHECKPOINT_DIR), save_every_steps=1, keep=1,
                                 use_async=self.use_async, best_metric="valid_bleu")

    def last_checkpoint(self) -> str:
        """The last train state saved, for messages."""
        step = self.states.last_saved
        return "none" if step is None else f"step {step} in {self.states.directory}"

    def save(self, step: int, state: PyTree, data_state: bytes | None, force: bool = False) -> bool:
        """The train state (and data state) at checkpoint steps, or now with `force`, and a params snapshot with
        it where averaging needs one; returns whether it saved."""
        if force or step % self.states.save_every_steps == 0:
            self.before_save()  # a run whose workdir another job took over must not write into it
        if not self.states.save(step, state, data_state=data_state, force=force):
            return False
        if self.snapshots:
            self.snapshots.save(step, {"params": state.params}, force=True)
        return True

    def save_best(self, step: int, params: PyTree, bleu: float) -> None:
        """The params of `step`, kept if its dev BLEU is the best so far."""
        if self.best is not None and step != self.best.last_saved:
            self.best.save(step, {"params": params}, force=True, metrics={"valid_bleu": bleu})

    def final_params(self, params: PyTree, shardings: PyTree) -> tuple[PyTree, list[int]]:
        """The parameters the end of a run scores: with average_last > 1, the mean of the last params snapshots (the
        paper's averaging) summed on the devices in `shardings` (the training ones), and their steps; else
        `params`, the final ones, and []."""
        if self.snapshots is None:
            return params, []
        self.snapshots.wait()
        steps = self.snapshots.all_steps()[-self.average_last:]
        if len(steps) < 2:
            return params, []
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), params, shardings)
        log.info("averaging the parameters of the checkpoints of steps %s", steps)
        averaged, steps = average_readable_params([(self.snapshots, s) for s in steps], abstract, len(steps))
        return (averaged, steps) if len(steps) > 1 else (params, [])  # unreadable ones were named

    def close(self) -> None:
        """Wait until every save is committed, then close the managers (once; all_steps() still answers)."""
        if self.closed:
            return
        self.closed = True
        failed = []
        for checkpointer in (self.states, self.snapshots, self.best):
            if checkpointer is not None:
                try:
                    checkpointer.close()  # waits for the last save first: a failed one raises CheckpointSaveError
                except CheckpointSaveError as error:
                    failed.append(error)
        if failed:
            raise failed[0]
