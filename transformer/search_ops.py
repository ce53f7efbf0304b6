"""The kernels of the searches that are not the search itself: decode.weights' cast and graph, and the argmax and
top-k in forms XLA's CPU backend runs faster than its own (same results)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model import build
from transformer.model.config import ModelConfig

PyTree = Any
WEIGHTS = ("float32", "bfloat16")  # decode.weights


def weights_graphdef(model_config: ModelConfig, weights: str) -> nnx.GraphDef:
    """The model's graph with its matmuls in `weights`' dtype (ModelConfig.dtype), for a search whose parameters
    are cast to it (make_search's weights)."""
    config = dataclasses.replace(model_config, dtype=weights)
    return nnx.split(nnx.eval_shape(lambda: build(config, rngs=nnx.Rngs(0))))[0]


def cast_weights(params: PyTree, weights: str) -> PyTree:
    """Floating parameters in `weights`' dtype: cast once per search call, before its loop of steps (bfloat16
    matmuls run ~2x float32's on CPUs with AVX512_BF16, and halve the bytes every step reads)."""
    if weights == "float32":
        return params
    dtype = jnp.dtype(weights)
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def first_argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the largest value) as a max and a min: two plain
    reductions, which XLA's CPU backend vectorises, where argmax's (value, index) reduction runs ~3x slower
    (1.4 -> 0.5 ms for [64, 8000] here; docs/benchmarks.md)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.min(jnp.where(logits == top, jnp.arange(logits.shape[-1]), logits.shape[-1]), axis=-1)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k over the last axis, through blocks of 125 when the vocabulary splits into them: the k best
    entries lie in the k blocks with the largest maxima, so a top-k over the block maxima and one over those
    k blocks replace one over the whole row, which XLA's CPU top-k runs ~1.5x (vocab 8k) to ~2x (32k) slower. (Among
    exactly equal values the pick may differ from lax.top_k's lowest-index-first.)"""
    *lead, vocab = x.shape
    block = 125
    if vocab % block or vocab < 16 * block or k > vocab // block:
        return jax.lax.top_k(x, k)
    blocks = x.reshape(*lead, vocab // block, block)
    _, best = jax.lax.top_k(jnp.max(blocks, axis=-1), k)  # [..., k] the blocks holding the k best
    candidates = jnp.take_along_axis(blocks, best[..., None], axis=-2).reshape(*lead, k * block)
    values, within = jax.lax.top_k(candidates, k)
    return values, jnp.take_along_axis(best, within // block, axis=-1) * block + within % block
