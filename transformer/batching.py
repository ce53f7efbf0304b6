"""Decoding's batches: which sentences share a batch, how many rows it has, and where they go.

Length-sorted batches of at most a row count and, with a token budget, at most that many rows x padded length
(`budget_batches`), in whole rows per device (`device_rows`) over the batch axes of the params' mesh
(`batch_sharding_for`); sources longer than the input bound are cut to it, EOS kept, with one warning naming the
split or file and the lines (`cut_to_bound`, `warn_cut`, `encode_inputs`). decode.search_sentences drives them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer import data, sharding
from transformer.console import log
from transformer.tokenizer import EOS_ID, Tokenizer

PyTree = Any


def batch_sharding_for(params: PyTree = None) -> NamedSharding:
    """The default split of a decoding batch's rows: over the batch axes (data, fsdp, expert) of the mesh the params
    are sharded on (jit refuses arrays on two meshes that order the same devices differently), or over every
    device (jax.devices()) when they are on no mesh."""
    leaf = next((x for x in jax.tree.leaves(params) if isinstance(getattr(x, "sharding", None), NamedSharding)),
                None)
    if leaf is None:
        return NamedSharding(Mesh(np.asarray(jax.devices()), ("data",)), PartitionSpec("data"))
    mesh = leaf.sharding.mesh
    axes = tuple(axis for axis in sharding.BATCH_AXES if axis in mesh.axis_names) or tuple(mesh.axis_names)
    return NamedSharding(mesh, PartitionSpec(axes))


def row_ways(batch_sharding: NamedSharding) -> int:
    """How many ways batch_sharding splits a batch's rows (the product of its first dimension's mesh axes)."""
    spec = tuple(batch_sharding.spec)
    axes = spec[0] if spec else None
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(batch_sharding.mesh.shape[name] for name in names)


def device_rows(batch_size: int, batch_sharding: NamedSharding) -> int:
    """batch_size rounded up to a multiple of the ways batch_sharding splits rows: every device gets whole rows."""
    if batch_size <= 0:
        raise ValueError(f"decode batch size {batch_size} must be positive")
    ways = row_ways(batch_sharding)
    return -(-batch_size // ways) * ways


def budget_batches(inputs: list[np.ndarray], rows: int, ways: int = 1, max_tokens: int = 0
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(indices, padded inputs [batch rows, bucket length]) in length order (stable), every input once. A batch of
    bucket length L has rows_for(L) rows: `rows` (a multiple of `ways`), or with max_tokens > 0 the most multiples
    of `ways` whose rows x L fit in max_tokens (at least `ways`: one row per device). A bucket thus has one row
    count, and no more shapes compile than without a budget. Rows beyond the inputs hold index -1, all padding."""
    def rows_for(length: int) -> int:
        return min(rows, max(ways, max_tokens // length // ways * ways)) if max_tokens > 0 else rows

    lengths = [len(x) for x in inputs]
    order = np.argsort(lengths, kind="stable")
    start = 0
    while start < len(order):
        # The shortest first, so the batch's longest input sets its length; fewer rows may shorten it again.
        count = rows_for(data.bucket_length(lengths[order[start]]))
        while True:
            length = data.bucket_length(lengths[order[min(start + count, len(order)) - 1]])
            if rows_for(length) >= count:
                break
            count = rows_for(length)
        indices = order[start:start + count]
        batch = np.zeros((rows_for(length), length), np.int32)
        for row, index in enumerate(indices):
            batch[row, :lengths[index]] = inputs[index]
        yield np.pad(indices, (0, len(batch) - len(indices)), constant_values=-1), batch
        start += len(indices)


CUT_LINES_SHOWN = 5  # line numbers a warning about cut inputs lists before it counts the rest


def cut_to_bound(inputs: list[np.ndarray], max_input_length: int | None) -> tuple[list[np.ndarray], list[int]]:
    """inputs with each one longer than max_input_length tokens (None: no bound) cut to its first
    max_input_length - 1 and EOS -> (the inputs, the line numbers, from 1, of those cut)."""
    if max_input_length is None:
        return list(inputs), []
    if max_input_length < 1:
        raise ValueError(f"max_input_length={max_input_length} must be >= 1 (room for the EOS)")
    bounded, cut = list(inputs), []
    for line, ids in enumerate(inputs, 1):
        if len(ids) > max_input_length:
            bounded[line - 1] = np.append(ids[:max_input_length - 1], EOS_ID).astype(np.int32)
            cut.append(line)
    return bounded, cut


def warn_cut(name: str, cut_lines: list[int], total: int, max_input_length: int) -> None:
    """One warning for a whole split or file: how many of its `total` sentences were cut, and their first lines."""
    if not cut_lines:
        return
    rest = len(cut_lines) - CUT_LINES_SHOWN
    log.warning("%s: %d of %d source sentence(s) longer than %d tokens cut to their first %d and EOS (still "
                "decoded and scored): line(s) %s%s", name, len(cut_lines), total, max_input_length,
                max_input_length - 1, ", ".join(map(str, cut_lines[:CUT_LINES_SHOWN])),
                f" and {rest} more" if rest > 0 else "")


def encode_inputs(tokenizer: Tokenizer, sentences: list[str], max_input_length: int | None,
                  name: str | None = "input") -> tuple[list[np.ndarray], list[int]]:
    """(token ids of each sentence, EOS included, cut to max_input_length by cut_to_bound; the lines cut). With a
    name (a split or file), one warning naming it and the lines (warn_cut); None leaves the warning to the caller."""
    inputs, cut = cut_to_bound(tokenizer.encode(sentences), max_input_length)
    if name is not None and max_input_length is not None:
        warn_cut(name, cut, len(sentences), max_input_length)
    return inputs, cut


def to_host(x: Any) -> np.ndarray:
    """A device array (all of it, on every process) or anything array-like -> numpy."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)
