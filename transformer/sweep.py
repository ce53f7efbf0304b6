"""Sweep definitions: what a config file's `get_sweep()` builds its points with (`axis`, `product`, `zip`), a
list of dotted overrides, e.g.

    def get_sweep():
        return sweep.product(sweep.axis("optimizer.warmup_steps", [100, 400]), sweep.axis("model.dropout_rate", [0.0, 0.1]))

Nothing else lives here, so that a config imports no runner: transformer/sweep_runner.py validates and runs the
points, transformer/sweep_results.py collects them (scripts/sweep.py is the command).
"""

from __future__ import annotations

import builtins
import itertools
from typing import Any


class SweepError(ValueError):
    """A sweep that must not start: a bad definition or override. The message names every run and key."""


def axis(key: str, values) -> list[dict[str, Any]]:
    """One swept setting: `axis("model.dropout_rate", [0.1, 0.2])` -> [{key: 0.1}, {key: 0.2}]."""
    values = list(values)
    if not values:
        raise SweepError(f"axis {key!r} has no values")
    return [{key: value} for value in values]


def _merge(parts: tuple[dict, ...]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key in merged and merged[key] != value:
                raise SweepError(f"{key!r} is set twice in one point ({merged[key]!r} and {value!r})")
            merged[key] = value
    return merged


def product(*axes: list[dict]) -> list[dict[str, Any]]:
    """Every combination of the axes (the first varies slowest). `product([shared], grid)` adds the
    overrides `shared` to every point of `grid`."""
    return [_merge(parts) for parts in itertools.product(*axes)]


def zip(*axes: list[dict]) -> list[dict[str, Any]]:  # noqa: A001 -- read as `sweep.zip` in config files
    """Axes that move together, point i of each merged: zip(axis("model.emb_dim", [512, 1024]),
    axis("model.mlp_dim", [2048, 4096])) is 2 points, not 4."""
    lengths = {len(a) for a in axes}
    if len(lengths) > 1:
        raise SweepError(f"zip needs axes of one length; got lengths {[len(a) for a in axes]}")
    return [_merge(parts) for parts in builtins.zip(*axes)]
