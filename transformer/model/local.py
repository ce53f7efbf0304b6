"""Local self-attention (the paper's section 4, "restricted" self-attention): each query reads the keys of its own
segment within model.local_window positions, computed in blocks, so that time and memory grow as length x window;
decoding keeps a ring of window + 1 positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model import blocks
from transformer.model.attention import DenseSelfAttention, attention
from transformer.model.blocks import CacheSetup, Inputs
from transformer.model.masks import SelfMask

Array = jax.Array


def local_attention(query: Array, key: Array, value: Array, mask: SelfMask, window: int,
                    dropout: nnx.Dropout | None = None, *, deterministic: bool = True,
                    rngs: nnx.Rngs | None = None) -> Array:
    """Self-attention restricted to a neighbourhood: each query sees the keys of its own segment at distance
    <= window (causal: itself and the window positions before it). The sequence is cut into blocks of `window`
    queries, each attending to its own block and its neighbours' (the one before; causal: and not the one after),
    so time and memory grow as length * window, never length^2. Same shapes as
    attention.dot_product_attention, with the mask by its parts; softmax in float32."""
    batch, length, _, head_dim = query.shape
    size = min(window, length)  # queries per block; a window past the length reaches every key from one block
    count, pad = -(-length // size), -length % size
    reach = (1, 0) if mask.causal else (1, 1)  # neighbouring blocks read before and after

    def blocks(x):  # [batch, length, ...] -> [batch, count, size, ...]; the padding is segment 0, never seen
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(batch, count, size, *x.shape[2:])

    def around(x):  # [batch, count, size, ...] -> [batch, count, (1 + sum(reach)) * size, ...]
        x = jnp.pad(x, [(0, 0), reach] + [(0, 0)] * (x.ndim - 2))
        return jnp.concatenate([x[:, i:i + count] for i in range(1 + sum(reach))], axis=2)

    distance = jnp.arange(size)[:, None] - jnp.arange(-size, (1 + reach[1]) * size)[None, :]  # query - key
    band = (distance <= window) & (distance >= (0 if mask.causal else -window))
    query_segment, key_segment = blocks(mask.segmentation)[..., :, None], around(blocks(mask.segmentation))
    allowed = band & (query_segment == key_segment[..., None, :]) & (key_segment[..., None, :] != 0)
    query = blocks(query) / jnp.sqrt(head_dim).astype(query.dtype)
    logits = jnp.einsum("bcqhd,bckhd->bchqk", query, around(blocks(key)).astype(query.dtype),
                        preferred_element_type=jnp.float32)
    logits = jnp.where(allowed[:, :, None], logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    if dropout is not None:
        weights = dropout(weights, deterministic=deterministic, rngs=rngs)
    attended = jnp.einsum("bchqk,bckhd->bcqhd", weights, around(blocks(value)))
    return attended.reshape(batch, count * size, *attended.shape[3:])[:, :length]


def windowed_attention(implementation: str, query: Array, key: Array, value: Array, mask: SelfMask, window: int,
                       dropout: nnx.Dropout | None, *, deterministic: bool, rngs: nnx.Rngs | None) -> Array:
    """local_attention by `implementation` (ModelConfig.attention): ours in blocks, or jax's kernels with their
    local_window_size, which has our window's meaning (keys at distance <= window on each side the mask allows)."""
    if implementation == "reference":
        return local_attention(query, key, value, mask, window, dropout, deterministic=deterministic, rngs=rngs)
    return attention(implementation, query, key, value, mask, dropout, deterministic=deterministic, rngs=rngs,
                     window_size=(window, 0 if mask.causal else window))


@blocks.register("self_attention", "local")
class LocalAttention(DenseSelfAttention):
    """Dense self-attention's projections and cache, read within the window."""

    # The window has no form for decoder_only's bidirectional prefix: that family refuses the kind.
    prefill = blocks.Block.prefill

    @classmethod
    def checks(cls, config, field):
        return [(config.local_window >= 1, f"local_window={config.local_window} must be >= 1")]

    @staticmethod
    def prepare(inputs: Inputs) -> Inputs:
        return inputs  # the mask by its parts: no [length, length] matrix

    @property
    def window(self) -> int:
        return self.config.local_window

    def attend(self, x: Array, keys: Array, values: Array, mask: SelfMask, *, deterministic: bool,
               rngs: nnx.Rngs | None) -> Array:
        attended = windowed_attention(self.config.attention, self.split_heads(self.query(x)), keys, values, mask,
                                      self.window, self.dropout, deterministic=deterministic, rngs=rngs)
        return self.merge_heads(attended, x)

    def cache_positions(self, setup: CacheSetup) -> tuple[int, int]:
        """A ring of the window's window + 1 positions (one block), overwritten in turn: its memory does not grow
        with the output's length."""
        if self.window + 1 < setup.max_length:
            return self.window + 1, 1
        return setup.max_length, setup.blocks
