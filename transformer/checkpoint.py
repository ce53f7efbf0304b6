"""Orbax checkpoints of the TrainState in `workdir/checkpoints`: periodic async saves, keep-N, resume.

Each checkpoint holds two items: `default`, the TrainState (the name single-item checkpoints of earlier
versions used, so those stay readable), and `data`, the input pipeline's iterator state, one JSON file
per process written by grain's Orbax handler, so a resumed run continues the data exactly.

Evaluation and averaging read parameters only (`restore_params`, a partial restore), from full states or from
params snapshots (`workdir/params`: checkpoints whose state is `{"params": ...}`), which a run keeps for the
last `decode.average_last` checkpoints so that averaging N needs N parameter sets on disk, not N train states.

A restore first compares the checkpoint's array shapes with the model being built, so a checkpoint
from another model shape fails with a message naming the first differing parameter, and is not touched.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any


class CheckpointMismatchError(ValueError):
    """The checkpoint on disk does not fit the model being built."""


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
        self.directory = os.path.abspath(directory)
        self.save_every_steps = save_every_steps
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

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, abstract_state: PyTree, step: int | None = None) -> PyTree:
        """Restore `step` (default: latest) into the structure, shapes and dtypes of `abstract_state`."""
        step = self.latest_step() if step is None else step
        if step is None or step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; found {self.all_steps()}")
        check_compatible(self.manager.item_metadata(step)[STATE_ITEM], abstract_state, self.directory)
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state)})
        return self.manager.restore(step, args=args)[STATE_ITEM]

    def restore_data_state(self, step: int) -> bytes | None:
        """This process's data iterator state saved at `step`; None for a checkpoint written without one.

        Every process's state is the same (each computes the whole packing plan and takes its own block of rows),
        so a checkpoint written by another number of processes restores onto this one: its files
        (`process_<i>-of-<n>.json`, grain's names) are read and must agree."""
        directory = os.path.join(self.directory, str(step), DATA_ITEM)
        if not os.path.isdir(directory):
            return None
        own = os.path.join(directory, f"process_{jax.process_index()}-of-{jax.process_count()}.json")
        names = [own] if os.path.exists(own) else sorted(glob.glob(os.path.join(directory, "process_*-of-*.json")))
        states = {}
        for name in names:
            with open(name, "rb") as handle:
                states[name] = handle.read()
        if not states:
            raise CheckpointMismatchError(f"{directory} holds no data iterator state (process_<i>-of-<n>.json)")
        if len({json.dumps(json.loads(s), sort_keys=True) for s in states.values()}) > 1:
            raise CheckpointMismatchError(f"the data iterator states in {directory} differ between processes, so "
                                          f"they cannot be restored onto {jax.process_count()} process(es)")
        return next(iter(states.values()))

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def save(self, step: int, state: PyTree, *, data_state: bytes | None = None, force: bool = False,
             metrics: dict[str, float] | None = None) -> bool:
        """Start an asynchronous save when `step` is a multiple of save_every_steps (or force); returns whether
        it saves. The state is copied to the host before this returns, so the caller may donate it next.
        `data_state`: the data iterator's state after the batch of `step` (see IteratorState)."""
        if not force and step % self.save_every_steps:
            return False
        # Already saved (a forced save, e.g. a train.report_minutes mark, or the end): decided on what this object
        # saved, not on the disk, which processes may see at different moments while an async save commits.
        if step == self.last_saved:
            return False
        items = {STATE_ITEM: ocp.args.StandardSave(state)}
        if data_state is not None:
            items[DATA_ITEM] = grain.checkpoint.CheckpointSave(IteratorState(data_state))
        saved = self.manager.save(step, args=ocp.args.Composite(**items), force=True, metrics=metrics)
        self.last_saved = step if saved else self.last_saved
        return saved

    def check_params(self, abstract_params: PyTree, step: int) -> None:
        """Raise, naming the step or the first differing array, unless `step` holds parameters of these shapes."""
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; found {self.all_steps()}")
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
        return ocp.PyTreeCheckpointer().restore(path, args=args)["params"]

    def average_params(self, abstract_params: PyTree, steps: list[int]) -> PyTree:
        """The mean of the parameters of `steps` held here (see `average_params`)."""
        return average_params([(self, step) for step in steps], abstract_params)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def average_params(sources: list[tuple[Checkpointer, int]], abstract_params: PyTree) -> PyTree:
    """The mean of the parameters of each (checkpointer, step) (the paper's checkpoint averaging), summed on the
    devices in the shardings of `abstract_params`, so that no process holds more than its shards. Every
    checkpoint is found and its shapes checked before any is read."""
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


# Donating the running sum keeps one sum and one checkpoint's parameters on the devices, whatever N.
_add = jax.jit(lambda total, params: jax.tree.map(jnp.add, total, params), donate_argnums=0)
_scale = jax.jit(lambda total, factor: jax.tree.map(lambda x: (x * factor).astype(x.dtype), total), donate_argnums=0)


def abstract_like(tree: PyTree) -> PyTree:
    """ShapeDtypeStructs of a concrete or abstract tree (what StandardRestore restores into)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
