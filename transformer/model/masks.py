"""Masks and positions: which keys a query may read, and where each token stands.

Token id 0 is padding. Several sentences may be packed into one row: a row's `segmentation` [batch, length] numbers
its sentences from 1 (0: padding) and attention never crosses a segment boundary; `positions` [batch, length]
number each sentence's tokens from 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


def segmentation_of(tokens: Array, segmentation: Array | None) -> Array:
    """Unpacked rows are one segment: every non-padding token is segment 1, padding is 0."""
    return (tokens != 0).astype(jnp.int32) if segmentation is None else segmentation


def positions_of(tokens: Array, positions: Array | None) -> Array:
    if positions is not None:
        return positions
    return jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)


def target_segments(decoder_inputs: Array, targets_segmentation: Array | None) -> tuple[Array, Array]:
    """The decoder's (segmentation, real tokens) [batch, tgt_length]. Unpacked (no segmentation), every position is
    a query of segment 1 and the real positions, which the experts route, are the start symbol 0 then the nonzero
    inputs."""
    if targets_segmentation is None:
        real = (decoder_inputs != 0) | (jnp.arange(decoder_inputs.shape[1]) == 0)
        return jnp.ones_like(decoder_inputs), real
    return targets_segmentation, targets_segmentation != 0


def attention_mask(query_segmentation: Array, key_segmentation: Array, causal: bool = False) -> Array:
    """[batch, 1, q_length, k_length] bool: same segment, key not padding, (causal) key not in the future.

    Segments are contiguous within a row, so "not in the future" is a comparison of row indices.
    """
    mask = (query_segmentation[:, :, None] == key_segmentation[:, None, :]) & (key_segmentation[:, None, :] != 0)
    if causal:
        q_length, k_length = query_segmentation.shape[-1], key_segmentation.shape[-1]
        mask &= jnp.arange(q_length)[:, None] >= jnp.arange(k_length)[None, :]
    return mask[:, None, :, :]


@struct.dataclass
class SelfMask:
    """A self-attention mask by its parts, segmentation [batch, length] (0: padding) and causality, rather than as
    the [batch, 1, length, length] matrix: a kind that never forms the whole matrix (local, performer) reads only
    the parts. `dense()` is the matrix for the others; `matrix`, when given, is that matrix formed once for a whole
    stack (Block.prepare), or a mask its parts do not describe (decoder_only's prefix LM, prefix_lm_mask)."""

    segmentation: Array
    causal: bool = struct.field(pytree_node=False, default=False)
    matrix: Array | None = None

    def dense(self) -> Array:
        if self.matrix is not None:
            return self.matrix
        return attention_mask(self.segmentation, self.segmentation, causal=self.causal)

    def formed(self) -> SelfMask:
        """This mask with its matrix formed (once, for every layer of a stack to read)."""
        return self if self.matrix is not None else self.replace(matrix=self.dense())


def join_pair(source: Array, source_segmentation: Array, source_position: Array, target: Array,
              target_segmentation: Array, target_position: Array) -> tuple[Array, Array, Array]:
    """A row's sources [batch, src_length] and targets [batch, tgt_length] as one stream [batch, src_length +
    tgt_length] of (tokens, segmentation, positions), for the families that read a pair as one sequence: the
    sources, then the targets, each segment's target numbered on from its source's length (as t5x's decoder-only
    inputs number them). The halves keep packing's order, so a segment's tokens are in order within each half."""
    source_length = jnp.sum((source_segmentation[:, None, :] == target_segmentation[:, :, None])
                            & (source_segmentation[:, None, :] != 0), axis=-1)  # per target token: its source's
    return (jnp.concatenate([source, target], axis=1),
            jnp.concatenate([source_segmentation, target_segmentation], axis=1),
            jnp.concatenate([source_position, target_position + source_length.astype(target_position.dtype)], axis=1))


def prefix_lm_mask(segmentation: Array, source_length: int, prefix_lm: bool) -> Array:
    """decoder_only's [batch, 1, length, length] mask over a join_pair stream whose first source_length columns
    are sources: within a segment, every query sees the keys at or before it in the row (causal: a target sees its
    whole source and its earlier targets, a source never a target), and with prefix_lm a source also sees its
    later sources (bidirectional over the prefix)."""
    mask = attention_mask(segmentation, segmentation, causal=True)
    if prefix_lm:
        source = jnp.arange(segmentation.shape[-1]) < source_length
        mask |= attention_mask(segmentation, segmentation) & (source[:, None] & source[None, :])
    return mask


def sinusoidal_positions(positions: Array, emb_dim: int) -> Array:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...): the paper's interleaved layout.

    Computed from the positions themselves rather than a table, so decoding has no length limit.
    """
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, emb_dim, 2, dtype=jnp.float32) / emb_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, length, emb_dim / 2]
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, emb_dim)
