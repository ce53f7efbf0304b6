"""Incremental decoding with the model's key/value caches: greedy search, beam search, sampling.

Every search is a pure function of (params, inputs), compiled once per input shape with `lax.while_loop`:

  * the encoder runs once per batch, and the cross-attention keys/values of every decoder layer are computed
    once per source sentence (`Transformer.init_cache`) and reused at every step; beam search keeps them at the
    batch size, and a sentence's beams read them as that many queries (never repeated, never reordered);
  * beam search never moves the self-attention cache when beams reorder: each hypothesis reads its history
    through an ancestor table and the attention mask (`_beam_step`);
  * each step of greedy search and sampling feeds one token per sentence through `Transformer.decode_step`,
    which appends its key/value to the self-attention cache; beam search feeds a sentence's beams together
    (`_beam_step`);
  * the self-attention cache is held in `cache_blocks` blocks, and a step reads only the blocks written so far
    (`MultiHeadAttention.attend_cached`).

Lengths (the paper's "maximum output length input length + 50"): sentence i may produce up to
`limit_i = (its real input length, EOS included) + max_extra_length` tokens, its EOS included; at position
limit_i - 1 only EOS may be produced, so every hypothesis ends with EOS. The static buffer is the padded
input length + max_extra_length; rows of all padding produce nothing.

Beam search follows tensor2tensor / GNMT: scores are log-probabilities divided by the length penalty
((5 + length) / 6)^alpha (length counts the EOS), the 2K best extensions of the K live hypotheses are split
into new live ones (no EOS) and finished ones (EOS), and a sentence stops early once its K finished
hypotheses are all at least as good as the best any live one could still reach
(live log-probability / lp(limit_i), an upper bound for alpha >= 0). beam_size 1 is greedy search.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer import data
from transformer.metrics import log
from transformer.model import to_cache_layout
from transformer.tokenizer import EOS_ID, PAD_ID, Tokenizer

PyTree = Any
Search = Callable[[PyTree, jax.Array], jax.Array]
# A large finite "minus infinity": sums and divisions of it stay finite, so no NaN can enter the top-k.
NEG_INF = -1.0e7


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Built from `config.decode`; see configs/default.py for each field's meaning."""

    batch_size: int = 256
    max_extra_length: int = 50
    bleu_splits: str = "valid,test"
    beam_size: int = 4
    alpha: float = 0.6
    early_stopping: bool = True
    temperature: float = 0.0
    top_k: int = 0
    average_last: int = 0
    cache_blocks: int = 0

    def __post_init__(self):
        if self.batch_size <= 0:
            raise ValueError(f"decode.batch_size={self.batch_size} must be positive")
        if self.max_extra_length < 0:
            raise ValueError(f"decode.max_extra_length={self.max_extra_length} must be >= 0")
        if self.beam_size < 1:
            raise ValueError(f"decode.beam_size={self.beam_size} must be >= 1")
        if self.alpha < 0:  # early stopping's bound on what a live beam can reach needs alpha >= 0
            raise ValueError(f"decode.alpha={self.alpha} must be >= 0")
        if self.cache_blocks < 0:
            raise ValueError(f"decode.cache_blocks={self.cache_blocks} must be >= 0 (0: 4 for beam search, "
                             "1 otherwise)")
        if self.temperature < 0 or self.top_k < 0 or self.average_last < 0:
            raise ValueError(f"decode.temperature={self.temperature}, decode.top_k={self.top_k} and "
                             f"decode.average_last={self.average_last} must be >= 0")

    def search_fn(self, graphdef: nnx.GraphDef, seed: int) -> Search:
        return make_search(graphdef, max_extra_length=self.max_extra_length, beam_size=self.beam_size,
                                  alpha=self.alpha, early_stopping=self.early_stopping,
                                  temperature=self.temperature, top_k=self.top_k, seed=seed,
                                  cache_blocks=self.cache_blocks)

    @property
    def splits(self) -> list[str]:
        splits = [s.strip() for s in self.bleu_splits.split(",") if s.strip()]
        for split in splits:
            if split not in data.SPLITS:
                raise ValueError(f"decode.bleu_splits names {split!r}; expected some of {data.SPLITS}")
        return splits


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, eq. 14); a score is log P(Y) / lp(Y)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def output_limits(inputs: jax.Array, max_extra_length: int) -> jax.Array:
    """[batch] the most tokens (EOS included) each sentence may produce: its real length + max_extra_length;
    0 for a row of padding only."""
    lengths = jnp.sum(inputs != PAD_ID, axis=1).astype(jnp.int32)
    return jnp.where(lengths > 0, lengths + max_extra_length, 0)


def only_eos_at_limit(logits: jax.Array, index: jax.Array, limits: jax.Array) -> jax.Array:
    """At a row's last allowed position (index == limit - 1) every token but EOS is ruled out.
    logits (or log-probabilities) [rows, vocab], limits [rows]."""
    last = (index + 1 >= limits)[:, None]
    return jnp.where(last & (jnp.arange(logits.shape[-1]) != EOS_ID), NEG_INF, logits)


def cache_blocks_for(cache_blocks: int, beam_size: int) -> int:
    """The config's decode.cache_blocks with 0 ("auto") resolved: 4 blocks for beam search, 1 for greedy search and
    sampling. Blocks make the steps faster and the compilation longer (a lax.switch per layer): measured on 2 CPU
    cores, decoding 1,000 sentences (compilation included) with 4 blocks instead of 1 took 25 s instead of 29 s
    with beam 4 but 18 s instead of 11 s with greedy search (the quick start's small model; docs/benchmarks.md)."""
    if cache_blocks < 0:
        raise ValueError(f"cache_blocks={cache_blocks} must be >= 0 (0: 4 for beam search, 1 otherwise)")
    return cache_blocks or (4 if beam_size > 1 else 1)


def cache_length(max_decode_length: int, blocks: int) -> int:
    """Positions of a self-attention cache held in `blocks` (>= 1, from cache_blocks_for) equal blocks that holds
    max_decode_length positions: rounded up to a multiple of blocks (the last block may hold a few unused ones)."""
    return -(-max_decode_length // blocks) * blocks


# ----------------------------------------------------------------------------------------------------
# Greedy search and sampling: one hypothesis per sentence


def greedy_search(params: PyTree, inputs: jax.Array, *, graphdef: nnx.GraphDef, max_extra_length: int,
                  temperature: float = 0.0, top_k: int = 0, rng: jax.Array | None = None,
                  cache_blocks: int = 0) -> jax.Array:
    """inputs [batch, src_length] -> output ids [batch, src_length + max_extra_length], padded with 0 after EOS.

    temperature 0 takes the argmax (greedy search); temperature > 0 samples from softmax(logits / temperature),
    restricted to the top_k most likely tokens when top_k > 0, with key fold_in(rng, position).
    Stops once every row has produced EOS (rows of all-padding inputs count as finished).
    cache_blocks: the self-attention cache's blocks (Transformer.init_cache; 0: cache_blocks_for's choice, 1); the
    outputs are the same up to float rounding.
    """
    model = nnx.merge(graphdef, params)
    batch, max_decode_length = inputs.shape[0], inputs.shape[1] + max_extra_length
    cache_blocks = cache_blocks_for(cache_blocks, 1)
    limits = output_limits(inputs, max_extra_length)
    cache = model.init_cache(model.encode(inputs), cache_length(max_decode_length, cache_blocks), cache_blocks)

    def choose(logits, index):
        if temperature <= 0.0:
            return jnp.argmax(logits, axis=-1)
        logits = logits / temperature
        if top_k > 0:
            kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits >= kth, logits, NEG_INF)
        return jax.random.categorical(jax.random.fold_in(rng, index), logits, axis=-1)

    def not_done(carry):
        return (carry["index"] < max_decode_length) & ~jnp.all(carry["finished"])

    def step(carry):
        index, finished = carry["index"], carry["finished"]
        logits, cache = model.decode_step(carry["previous"], index, carry["cache"], inputs)
        logits = only_eos_at_limit(logits, index, limits)
        token = jnp.where(finished, PAD_ID, choose(logits, index).astype(jnp.int32))
        return dict(index=index + 1, previous=token, cache=cache, finished=finished | (token == EOS_ID),
                    outputs=carry["outputs"].at[:, index].set(token))

    start = dict(index=jnp.int32(0), previous=jnp.zeros((batch,), jnp.int32), cache=cache, finished=limits == 0,
                 outputs=jnp.zeros((batch, max_decode_length), jnp.int32))
    return jax.lax.while_loop(not_done, step, start)["outputs"]


# ----------------------------------------------------------------------------------------------------
# Beam search


def _gather_beams(tree: PyTree, beam_indices: jax.Array) -> PyTree:
    """Select beams: every leaf [batch, beams, ...] indexed by beam_indices [batch, n] -> [batch, n, ...]."""
    return jax.tree.map(lambda x: jnp.take_along_axis(
        x, beam_indices.reshape(beam_indices.shape + (1,) * (x.ndim - 2)), axis=1), tree)


def _beam_step(model, tokens: jax.Array, index: jax.Array, cache: PyTree, ancestors: jax.Array,
               cross_mask: jax.Array) -> tuple[jax.Array, PyTree]:
    """One decoding position for every hypothesis without moving the self-attention cache when beams reorder.

    tokens [batch, beams]; the beams are the decoder's "length" axis, so one sentence's beams share its
    cross-attention keys/values (never repeated). The self-attention cache has length * beams rows (its length
    axis, see model.to_cache_layout; length: the decode length padded to whole cache blocks), position-major: the
    hypothesis in beam slot j writes position t to row t * beams + j, where it stays. ancestors [batch, beams,
    length] says which slot holds each position of each hypothesis, and the self-attention mask lets it see
    exactly those rows (softmax over the same keys as a reordered cache, plus masked ones). Reordering then moves
    this small int table instead of every layer's keys and values, which cost ~22% of a beam-4 step on CPU.
    -> (logits [batch, beams, vocab] float32, cache).
    """
    batch, beams = tokens.shape
    length = ancestors.shape[-1]
    visible = (ancestors[..., None] == jnp.arange(beams)) & (jnp.arange(length) <= index)[:, None]
    self_mask = visible.reshape(batch, 1, beams, length * beams)
    x = model.target_embedder(tokens, jnp.full(tokens.shape, index, jnp.int32), deterministic=True, rngs=None)
    new_cache = []
    for layer, layer_cache in zip(model.decoder_layers, cache):
        # cache_index addresses rows: position `index` of all beams is rows index * beams ... index * beams + beams - 1.
        x, layer_cache = layer(x, None, self_mask, cross_mask, deterministic=True, rngs=None, cache=layer_cache,
                               cache_index=index * beams)
        new_cache.append(layer_cache)
    return model.logits(x), new_cache


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


def _top_extensions(logits: jax.Array, live_scores: jax.Array, at_limit: jax.Array, count: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The `count` best (beam, token) extensions of the live hypotheses -> scores (live score + log P(token)),
    beams, tokens [batch, count]. logits [batch, beams, vocab], live_scores [batch, beams], at_limit [batch]:
    the rows at their last position, where only EOS may follow.

    Two stages (each beam's best `count`, then the best `count` of those) give the same pairs as one top-k over
    beams * vocab, which XLA's CPU top-k runs several times slower at vocab 32k. The top-k reads the logits,
    and only the chosen ones are normalised (log P = logit - logsumexp): no vocab-sized log-softmax is written.
    """
    batch, beams, vocab = logits.shape
    per_beam = min(count, vocab)
    top_logits, tokens = _top_k(logits, per_beam)  # [batch, beams, per_beam]
    log_norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    scores = top_logits - log_norm
    # At the limit: EOS at its real probability (as fairseq does), every other extension ruled out.
    eos_score = logits[..., EOS_ID:EOS_ID + 1] - log_norm
    first = jnp.arange(per_beam) == 0
    limited = at_limit[:, None, None]
    scores = jnp.where(limited, jnp.where(first, eos_score, NEG_INF), scores) + live_scores[:, :, None]
    tokens = jnp.where(limited, jnp.where(first, EOS_ID, PAD_ID), tokens)
    scores, flat = jax.lax.top_k(scores.reshape(batch, beams * per_beam), count)
    return scores, flat // per_beam, jnp.take_along_axis(tokens.reshape(batch, beams * per_beam), flat, axis=1)


def beam_search(params: PyTree, inputs: jax.Array, *, graphdef: nnx.GraphDef, beam_size: int, alpha: float,
                max_extra_length: int, early_stopping: bool = True, cache_blocks: int = 0,
                recompute_cross_attention: bool = False) -> tuple[jax.Array, jax.Array]:
    """inputs [batch, src_length] -> (sequences [batch, beam_size, src_length + max_extra_length], each ending in
    EOS then padding, best first; scores [batch, beam_size], log P / lp, NEG_INF-ish for empty slots).

    early_stopping=False runs every row to the full buffer length (for benchmarks). cache_blocks: the
    self-attention cache's blocks (Transformer.init_cache; 0: cache_blocks_for's choice, 4); the results are the
    same up to float rounding. recompute_cross_attention recomputes the cross-attention keys/values at every
    step, as flax's examples/wmt does: only there to measure what caching them saves.
    """
    model = nnx.merge(graphdef, params)
    batch, src_length = inputs.shape
    beams, max_decode_length = beam_size, src_length + max_extra_length
    cache_blocks = cache_blocks_for(cache_blocks, beams)
    length = cache_length(max_decode_length, cache_blocks)
    limits = output_limits(inputs, max_extra_length)
    encoded = model.encode(inputs)
    # Self-attention rows: positions x beams (see _beam_step), in blocks; cross-attention at the batch size.
    cache = model.init_cache(encoded, length * beams, cache_blocks)
    cross_mask = (inputs != PAD_ID)[:, None, None, :]

    def cross_from_scratch(cache, index):
        # As flax's examples/wmt: every hypothesis recomputes its source's keys/values at every step (all beams'
        # copies are computed; the step reads the first). The loop index through an optimization barrier keeps
        # XLA from hoisting this out of the loop.
        source = jax.lax.optimization_barrier((jnp.repeat(encoded, beams, axis=0), index))[0]
        def first_beam(x):
            return x.reshape(batch, beams, *x.shape[1:])[:, 0]
        return [{**layer_cache, **{name: first_beam(x) for name, x in zip(
                    ("cross_key", "cross_value"), to_cache_layout(*layer.cross_attention.keys_values(source)))}}
                for layer, layer_cache in zip(model.decoder_layers, cache)]

    def not_done(carry):
        return (carry["index"] < max_decode_length) & ~jnp.all(carry["done"])

    def step(carry):
        index, cache = carry["index"], carry["cache"]
        if recompute_cross_attention:
            cache = cross_from_scratch(cache, index)
        # Each slot's hypothesis sees its own slot at the position it writes now.
        ancestors = carry["ancestors"].at[:, :, index].set(jnp.arange(beams))
        logits, cache = _beam_step(model, carry["tokens"], index, cache, ancestors, cross_mask)
        scores, from_beam, tokens = _top_extensions(logits, carry["live_scores"], index + 1 >= limits, 2 * beams)
        sequences = _gather_beams(carry["live_sequences"], from_beam)
        sequences = jax.lax.dynamic_update_slice(sequences, tokens[:, :, None], (0, 0, index))
        is_eos = tokens == EOS_ID
        # Live: the best K extensions without EOS; their histories follow them through the ancestor table.
        live_scores, keep = jax.lax.top_k(jnp.where(is_eos, NEG_INF, scores), beams)
        live = _gather_beams({"sequences": sequences, "tokens": tokens, "beam": from_beam}, keep)
        ancestors = _gather_beams(ancestors, live["beam"])  # the new live hypotheses' histories
        # Finished: extensions ending in EOS join the K best finished so far (none once a row is done).
        # (An extension of an empty beam slot scores about NEG_INF: it is no hypothesis.)
        ended = is_eos & (scores > NEG_INF / 2) & ~carry["done"][:, None]
        new_finished = jnp.where(ended, scores / length_penalty(index + 1, alpha), NEG_INF)
        finished_scores, best = jax.lax.top_k(jnp.concatenate([carry["finished_scores"], new_finished], 1), beams)
        finished_sequences = _gather_beams(jnp.concatenate([carry["finished_sequences"], sequences], 1), best)
        finished_flags = _gather_beams(jnp.concatenate([carry["finished_flags"], ended], 1), best)
        # No live hypothesis can still beat the K finished ones (valid for alpha >= 0: log P only falls, lp grows).
        best_possible = live_scores[:, 0] / length_penalty(limits, alpha)
        settled = jnp.all(finished_flags, axis=1) & (finished_scores[:, -1] >= best_possible)
        done = carry["done"] | (index + 1 >= limits) | (early_stopping & settled)
        return dict(index=index + 1, cache=cache, ancestors=ancestors, tokens=live["tokens"],
                    live_scores=live_scores, live_sequences=live["sequences"], finished_scores=finished_scores,
                    finished_sequences=finished_sequences, finished_flags=finished_flags, done=done)

    # Only beam 0 is live at the start, so the first step's K best come from K different tokens.
    live_scores = jnp.tile(jnp.array([0.0] + [NEG_INF] * (beams - 1), jnp.float32), (batch, 1))
    start = dict(index=jnp.int32(0), cache=cache, tokens=jnp.zeros((batch, beams), jnp.int32),
                 ancestors=jnp.zeros((batch, beams, length), jnp.int32),
                 live_scores=live_scores, live_sequences=jnp.zeros((batch, beams, max_decode_length), jnp.int32),
                 finished_scores=jnp.full((batch, beams), NEG_INF, jnp.float32),
                 finished_sequences=jnp.zeros((batch, beams, max_decode_length), jnp.int32),
                 finished_flags=jnp.zeros((batch, beams), bool), done=limits == 0)
    final = jax.lax.while_loop(not_done, step, start)
    sequences = jnp.where(final["finished_flags"][:, :, None], final["finished_sequences"], 0)
    return sequences, final["finished_scores"]


# ----------------------------------------------------------------------------------------------------
# One entry point for every caller


def make_search(graphdef: nnx.GraphDef, *, max_extra_length: int, beam_size: int = 1, alpha: float = 0.0,
                early_stopping: bool = True, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
                cache_blocks: int = 0) -> Search:
    """A jitted `search(params, inputs) -> output ids [batch, src_length + max_extra_length]`: sampling when
    temperature > 0, else greedy search for beam_size 1, else beam search (its best hypothesis); the
    self-attention cache in `cache_blocks` blocks (Transformer.init_cache; 0: cache_blocks_for's choice)."""
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    sampling = temperature > 0.0 or beam_size == 1
    cache_blocks = cache_blocks_for(cache_blocks, 1 if sampling else beam_size)
    if sampling:
        rng = jax.random.PRNGKey(seed)
        return jax.jit(functools.partial(greedy_search, graphdef=graphdef, max_extra_length=max_extra_length,
                                         temperature=temperature, top_k=top_k, rng=rng, cache_blocks=cache_blocks))

    def best(params, inputs):
        sequences, _ = beam_search(params, inputs, graphdef=graphdef, beam_size=beam_size, alpha=alpha,
                                   max_extra_length=max_extra_length, early_stopping=early_stopping,
                                   cache_blocks=cache_blocks)
        return sequences[:, 0]
    return jax.jit(best)


def make_greedy_search(graphdef: nnx.GraphDef, max_extra_length: int) -> Search:
    """`greedy_search` bound to one model and jitted: `search(params, inputs) -> output ids`."""
    return make_search(graphdef, max_extra_length=max_extra_length)


def translate(search: Search, params: PyTree, tokenizer: Tokenizer, sentences: list[str], batch_size: int,
              max_input_length: int | None = None) -> list[str]:
    """Translate sentences in length-sorted batches with a jitted `search(params, inputs)`; keeps input order.

    An empty sentence gets an empty translation. With `max_input_length` (a model with learned positions),
    longer inputs are truncated to it, keeping their EOS, with a warning.
    """
    return [tokenizer.decode(ids) for ids in search_ids(search, params, tokenizer, sentences, batch_size,
                                                         max_input_length)]


def search_ids(search: Search, params: PyTree, tokenizer: Tokenizer, sentences: list[str], batch_size: int,
               max_input_length: int | None = None) -> list[np.ndarray]:
    """The output ids of each sentence (up to and including EOS), in input order; empty for an empty sentence."""
    if not sentences:
        return []
    inputs = tokenizer.encode(sentences)
    if max_input_length is not None:
        too_long = [i for i, ids in enumerate(inputs) if len(ids) > max_input_length]
        if too_long:
            log.warning("truncating %d input(s) longer than the model's %d positions (first: line %d)",
                        len(too_long), max_input_length, too_long[0] + 1)
            for i in too_long:
                inputs[i] = np.append(inputs[i][:max_input_length - 1], EOS_ID).astype(np.int32)
    outputs: list[np.ndarray] = [np.zeros((0,), np.int32)] * len(sentences)
    for indices, batch in data.decode_batches(inputs, batch_size):
        for index, ids in zip(indices, np.asarray(search(params, batch))):
            if index >= 0 and sentences[index].strip():
                ids = ids.tolist()
                outputs[index] = np.asarray(ids[:ids.index(EOS_ID) + 1] if EOS_ID in ids else ids, np.int32)
    return outputs
