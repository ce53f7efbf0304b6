"""Orbax checkpoints of the TrainState in `workdir/checkpoints`: periodic async saves, keep-N, resume.

Each checkpoint holds two items: `default`, the TrainState (the name single-item checkpoints of earlier
versions used, so those stay readable), and `data`, the input pipeline's iterator state, one JSON file
per process written by grain's Orbax handler, so a resumed run continues the data exactly.

A restore first compares the checkpoint's array shapes with the model being built, so a checkpoint
from another model shape fails with a message naming the first differing parameter, and is not touched.
"""

from __future__ import annotations

import os
from typing import Any

import grain
import jax
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
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=use_async,
                                               create=not read_only, read_only=read_only, **best)
        # Naming the handler lets a fresh manager read an existing checkpoint's metadata (for the shape check).
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            STATE_ITEM: ocp.StandardCheckpointHandler(), DATA_ITEM: grain.checkpoint.CheckpointHandler()})

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
        """This process's data iterator state saved at `step`; None for a checkpoint written without one."""
        if not os.path.isdir(os.path.join(self.directory, str(step), DATA_ITEM)):
            return None
        args = ocp.args.Composite(**{DATA_ITEM: grain.checkpoint.CheckpointRestore(IteratorState())})
        return self.manager.restore(step, args=args)[DATA_ITEM].get_state()

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def save(self, step: int, state: PyTree, *, data_state: bytes | None = None, force: bool = False,
             metrics: dict[str, float] | None = None) -> bool:
        """Start an asynchronous save when `step` is a multiple of save_every_steps (or force); returns whether
        it saves. The state is copied to the host before this returns, so the caller may donate it next.
        `data_state`: the data iterator's state after the batch of `step` (see IteratorState)."""
        if not force and step % self.save_every_steps:
            return False
        if step == self.manager.latest_step():  # already saved by a forced save (a train.report_minutes mark)
            return False
        items = {STATE_ITEM: ocp.args.StandardSave(state)}
        if data_state is not None:
            items[DATA_ITEM] = grain.checkpoint.CheckpointSave(IteratorState(data_state))
        return self.manager.save(step, args=ocp.args.Composite(**items), force=True, metrics=metrics)

    def average(self, abstract_state: PyTree, steps: list[int]) -> PyTree:
        """The state of the last of `steps` with its params replaced by the mean of the params of all `steps`
        (the paper's checkpoint averaging). Every checkpoint's shapes are checked before any is read."""
        missing = sorted(set(steps) - set(self.all_steps()))
        if missing:
            raise FileNotFoundError(f"no checkpoint for step(s) {missing} in {self.directory}; found {self.all_steps()}")
        for step in steps:
            try:
                check_compatible(self.manager.item_metadata(step)[STATE_ITEM], abstract_state, self.directory)
            except CheckpointMismatchError as error:
                raise CheckpointMismatchError(f"cannot average step {step}: {error}") from error
        total, state = None, None
        for step in steps:
            state = self.restore(abstract_state, step)
            # Summed in float64 on the host: exact enough for any N, and independent of the order of steps.
            params = jax.tree.map(lambda x: np.asarray(x, np.float64), state.params)
            total = params if total is None else jax.tree.map(np.add, total, params)
        mean = jax.tree.map(lambda t, x: (t / len(steps)).astype(x.dtype), total, state.params)
        return state.replace(params=mean)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def abstract_like(tree: PyTree) -> PyTree:
    """ShapeDtypeStructs of a concrete or abstract tree (what StandardRestore restores into)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
