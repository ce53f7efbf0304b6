"""The kernels of the searches that are not the search itself: decode.weights' cast and graph, the argmax and
top-k in forms XLA's CPU backend runs faster than its own (same results), the loop whose batch shrinks as its
sentences finish, and sampling's truncations and keys."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model import build
from transformer.model.config import ModelConfig

PyTree = Any
WEIGHTS = ("float32", "bfloat16")  # decode.weights
# A large finite "minus infinity": sums and divisions of it stay finite, so no NaN can enter the top-k.
NEG_INF = -1.0e7


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


def shrinking_loop(not_done: Callable, step: Callable, start: dict, sentence_done: Callable, halvings: int,
                   results: tuple[str, ...]) -> dict:
    """jax.lax.while_loop(not_done, step, start) over a batch that halves, up to `halvings` times, as its sentences
    finish, so a batch's last long sentences no longer step every row (CTranslate2 drops finished rows too). start:
    the loop state, every leaf [batch, ...] but scalars (the position); sentence_done(state) -> [batch] bool. Each
    stage runs while more sentences are unfinished than the next stage's rows, then keeps the unfinished ones
    first; the `results` entries of every row leave the loop at their last stage, in their first-stage order.
    A finished sentence's results must stay as they are under `step` (the searches write only padding to them),
    so the outputs are the single loop's, up to the rounding of matmuls over fewer rows. Each stage is compiled
    as its own loop: `halvings` more loop bodies."""
    batch = sentence_done(start).shape[0]
    sizes = [batch >> k for k in range(1, halvings + 1) if batch >> k >= 1]
    if not sizes:  # one loop, and no scatter: the outputs keep the rows' sharding
        return jax.lax.while_loop(not_done, step, start)
    full, rows, state = {key: start[key] for key in results}, jnp.arange(batch), start
    for size in sizes:
        state = jax.lax.while_loop(
            lambda carry, size=size: not_done(carry) & (jnp.sum(~sentence_done(carry)) > size), step, state)
        full = {key: full[key].at[rows].set(state[key]) for key in results}
        keep = jnp.argsort(sentence_done(state), stable=True)[:size]  # every unfinished sentence, then finished
        rows = rows[keep]
        state = jax.tree.map(lambda x: x if x.ndim == 0 else x[keep], state)
    state = jax.lax.while_loop(not_done, step, state)
    return {**state, **{key: full[key].at[rows].set(state[key]) for key in results}}


def sampling_logits(logits: jax.Array, temperature: float, top_k: int = 0, top_p: float = 0.0,
                    epsilon: float = 0.0) -> jax.Array:
    """logits [rows, vocab] -> logits / temperature with every token of probability below epsilon (when > 0, at
    that temperature; the most likely token always stays: Hewitt et al. 2022, Freitag et al. 2023's MBR samples),
    then outside the top_k (when > 0) and then outside the nucleus (when 0 < top_p < 1: the fewest most likely
    tokens whose probability reaches top_p; Holtzman et al. 2020) set to NEG_INF. Tokens tied with the nucleus'
    least likely one stay in."""
    logits = logits / temperature
    if epsilon > 0.0:
        probs = jax.nn.softmax(logits, axis=-1)
        keep = (probs >= epsilon) | (logits >= jnp.max(logits, axis=-1, keepdims=True))
        logits = jnp.where(keep, logits, NEG_INF)
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits >= kth, logits, NEG_INF)
    if 0.0 < top_p < 1.0:
        ranked = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        # A token is in the nucleus while the tokens ranked above it hold less than top_p (the first always is).
        inside = jnp.cumsum(probs, axis=-1) - probs < top_p
        least = jnp.min(jnp.where(inside, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= least, logits, NEG_INF)
    return logits


def row_keys(seed: int, streams: jax.Array) -> jax.Array:
    """streams [rows, 2] of (call, sentence index) -> each row's key fold_in(fold_in(key(seed), call), index)."""
    base = jax.random.key(seed)
    return jax.vmap(lambda stream: jax.random.fold_in(jax.random.fold_in(base, stream[0]), stream[1]))(streams)


def candidate_keys(keys: jax.Array, candidates: int) -> jax.Array:
    """[rows] keys -> [rows * candidates]: candidate 0 of a row draws with the row's own key (so one candidate is
    plain sampling's sample), candidate j > 0 with fold_in(key, j)."""
    if candidates == 1:
        return keys
    folded = jax.vmap(lambda key: jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(candidates)))(keys)
    own = (jnp.arange(candidates) == 0)[None, :, None]
    chosen = jnp.where(own, jax.random.key_data(keys)[:, None], jax.random.key_data(folded))
    return jax.random.wrap_key_data(chosen.reshape(-1, chosen.shape[-1]), impl=jax.random.key_impl(keys))


def choose_tokens(logits: jax.Array, index: jax.Array, keys: jax.Array | None, temperature: float, top_k: int = 0,
                  top_p: float = 0.0, epsilon: float = 0.0) -> jax.Array:
    """Each row's token of logits [rows, vocab]: the argmax at temperature 0 (first_argmax), else a draw from
    sampling_logits' distribution with the row's key [rows] folded with the position `index`."""
    if temperature <= 0.0:
        return first_argmax(logits)
    logits = sampling_logits(logits, temperature, top_k, top_p, epsilon)
    return jax.vmap(lambda key, row: jax.random.categorical(jax.random.fold_in(key, index), row))(keys, logits)
