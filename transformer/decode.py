"""Incremental decoding with the model's key/value caches: greedy search, beam search, sampling.

Every search is a pure function of (params, inputs), compiled once per input shape with `lax.while_loop`:

  * every search uses only the model's `encode`, `init_cache` and `decode_step`: the encoder runs once per
    batch, and the cross-attention keys/values of every decoder layer are computed once per source sentence
    and reused at every step, at the batch size: a sentence's beams read them as that many queries;
  * each step feeds every hypothesis's previous token through `Transformer.decode_step` (greedy search and
    sampling: one per sentence; beam search: its beams), which writes its keys/values into the cache;
  * beam search never moves the self-attention cache when beams reorder: it passes decode_step an ancestor
    table saying whose cache rows hold each hypothesis's history;
  * the self-attention cache is held in `cache_blocks` blocks, and a step reads only the blocks written so far
    (`cache_blocks_for`).

Lengths (the paper's "maximum output length input length + 50"): sentence i may produce up to
`limit_i = (its real input length, EOS included) + max_extra_length` tokens, its EOS included, and with learned
positions no more than the decoder's table holds (as fairseq caps at max_decoder_positions; a decoder-only model
numbers the target on from its source, so the room is the table less the source); at position limit_i - 1 only
EOS may be produced, so every hypothesis ends with EOS. The static buffer is the padded
input length + max_extra_length; rows of all padding produce nothing.

Beam search follows tensor2tensor / GNMT: scores are log-probabilities divided by a length penalty lp (GNMT's
((5 + length) / 6)^alpha, or fairseq's length^alpha; length counts the EOS), the 2K best extensions of the K
live hypotheses are split into new live ones (no EOS) and finished ones (EOS), and a sentence stops early once
its K finished hypotheses are all at least as good as the best any live one could still reach (live
log-probability / lp(limit_i): for alpha >= 0 both penalties are positive and grow with the length while the
log-probability, <= 0, only falls, so no extension can score above it). beam_size 1 is greedy search.

Sampling (temperature > 0, then top_k, then top_p) is reproducible and fresh at once: sentence i of the c-th
call of `search_sentences` on one `Search` (c counts from 0; `call=` pins it) draws position t with
the key fold_in(fold_in(fold_in(key(seed), c), i), t), i being the sentence's index in that call's list. The
samples then depend on neither the batch size, nor the number of devices or processes, nor the other sentences.
Minimum Bayes risk (DecodeConfig.search="mbr") draws N such candidates per sentence (candidate j > 0 with the
sentence's key folded with j) or takes a beam's N finished hypotheses, and `search_sentences` returns the one of
highest expected utility against the others (mbr.py).

Decoding of sentences (`search_sentences`) always finishes: a source longer than the bound
(`DecodeConfig.input_bound`: the training data.max_length, capped by a learned position table) is cut to it, its
EOS kept, with one warning naming the split or file and the lines, and the count returned (`Decoded.cut`); and
batches hold at most decode.max_tokens_per_batch rows x padded length, so long sentences come fewer to a batch
(`budget_batches`). Each batch's rows are split over the batch axes of a mesh (`batch_sharding`); with several
processes every process passes the same sentences, places its own rows, and gets every output back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from transformer import batching, config_files, data, mbr, sharding
from transformer.model.config import ModelConfig
from transformer.search_ops import (NEG_INF, WEIGHTS, _top_k, candidate_keys, cast_weights,  # noqa: F401
                                    choose_tokens, first_argmax, row_keys, sampling_logits, shrinking_loop,
                                    weights_graphdef)
from transformer.tokenizer import EOS_ID, PAD_ID, Tokenizer

PyTree = Any
PENALTIES = ("gnmt", "fairseq")
SEARCHES = ("auto", "mbr")  # auto: greedy, beam or sampling by beam_size and temperature; mbr: mbr.py's choice
MBR_SOURCES = ("samples", "beam")


@config_files.section("decode")
class DecodeConfig:
    """Built from `config.decode`; configs/default.py holds each field's default and meaning."""

    batch_size: int
    max_extra_length: int
    bleu_splits: str
    beam_size: int
    alpha: float
    length_penalty: str
    early_stopping: bool
    temperature: float
    top_k: int
    top_p: float
    average_last: int
    cache_blocks: int
    weights: str  # one of WEIGHTS
    shrink: int
    max_input_length: int
    max_tokens_per_batch: int
    epsilon: float
    search: str
    mbr_candidates: int
    mbr_from: str
    mbr_utility: str

    def __post_init__(self):
        if self.batch_size <= 0:
            raise ValueError(f"decode.batch_size={self.batch_size} must be positive")
        if self.max_extra_length < 0:
            raise ValueError(f"decode.max_extra_length={self.max_extra_length} must be >= 0")
        if self.beam_size < 1:
            raise ValueError(f"decode.beam_size={self.beam_size} must be >= 1")
        if self.alpha < 0:  # early stopping's bound on what a live beam can reach needs alpha >= 0
            raise ValueError(f"decode.alpha={self.alpha} must be >= 0")
        if self.length_penalty not in PENALTIES:
            raise ValueError(f"decode.length_penalty={self.length_penalty!r} must be one of {PENALTIES}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"decode.weights={self.weights!r} must be one of {WEIGHTS}")
        if self.shrink < 0:
            raise ValueError(f"decode.shrink={self.shrink} must be >= 0 (the most halvings of a batch; 0: none)")
        if self.cache_blocks < 0:
            raise ValueError(f"decode.cache_blocks={self.cache_blocks} must be >= 0 (0: 4 for beam search, "
                             "1 otherwise)")
        if self.temperature < 0 or self.top_k < 0 or self.average_last < 0:
            raise ValueError(f"decode.temperature={self.temperature}, decode.top_k={self.top_k} and "
                             f"decode.average_last={self.average_last} must be >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"decode.top_p={self.top_p} must be in [0, 1] (0 or 1: off)")
        if not 0.0 <= self.epsilon < 1.0:
            raise ValueError(f"decode.epsilon={self.epsilon} must be in [0, 1) (0: off)")
        if self.search == "mbr":
            self._check_mbr()
        elif self.search != "auto":
            raise ValueError(f"decode.search={self.search!r} must be one of {SEARCHES}")
        elif self.temperature > 0 and self.beam_size > 1:  # sampling used to win silently over the beam
            raise ValueError(f"decode.temperature={self.temperature} samples one hypothesis per sentence; "
                             f"decode.beam_size={self.beam_size} asks for beam search: set one of them to "
                             "its default (temperature 0 or beam_size 1)")
        if self.max_input_length < 0 or self.max_tokens_per_batch < 0:
            raise ValueError(f"decode.max_input_length={self.max_input_length} and decode.max_tokens_per_batch="
                             f"{self.max_tokens_per_batch} must be >= 0 (0: data.max_length, and no budget)")

    def _check_mbr(self) -> None:
        if self.mbr_candidates < 1:
            raise ValueError(f"decode.mbr_candidates={self.mbr_candidates} must be >= 1")
        if self.mbr_from not in MBR_SOURCES:
            raise ValueError(f"decode.mbr_from={self.mbr_from!r} must be one of {MBR_SOURCES}")
        mbr.metric(self.mbr_utility)  # names the field and the choices when it is none of them
        if self.mbr_from == "beam" and (self.temperature > 0 or self.epsilon > 0 or self.top_k or self.top_p):
            raise ValueError("decode.mbr_from='beam' ranks beam search's n-best list, which samples nothing: "
                             "leave decode.temperature, epsilon, top_k and top_p at 0, or set mbr_from='samples'")

    @property
    def mbr_temperature(self) -> float:
        """MBR's sampling temperature: decode.temperature, its default 0 read as 1 (unbiased samples of the model)."""
        return self.temperature or 1.0

    def input_bound(self, data_max_length: int, position_limit: int | None) -> int:
        """The most source tokens (EOS included) a sentence is decoded from: decode.max_input_length, else the
        training data.max_length (longer pairs were never trained on), and never past a learned position table."""
        bound = self.max_input_length or data_max_length
        return bound if position_limit is None else min(bound, position_limit)

    @property
    def search_tag(self) -> str:
        """The settings that change what the search finds, as a file-name part: greedy, beam4-gnmt0.6,
        sample-t1-k0-p0.9 (-e0.02 with epsilon) or mbr16-chrf- and its source (samples-t1-k0-p0-e0.02, beam-gnmt0.6),
        then -extra<max_extra_length> (e.g. beam4-gnmt0.6-extra50), then -bfloat16 with decode.weights=bfloat16."""
        sampled = f"t{self.mbr_temperature:g}-k{self.top_k}-p{self.top_p:g}"
        sampled += f"-e{self.epsilon:g}" if self.epsilon else ""
        if self.search == "mbr":
            source = f"samples-{sampled}" if self.mbr_from == "samples" else f"beam-{self.length_penalty}{self.alpha:g}"
            search = f"mbr{self.mbr_candidates}-{self.mbr_utility}-{source}"
        elif self.temperature > 0:
            search = f"sample-{sampled}"
        elif self.beam_size == 1:
            search = "greedy"
        else:
            search = f"beam{self.beam_size}-{self.length_penalty}{self.alpha:g}"
        weights = "" if self.weights == "float32" else f"-{self.weights}"
        return f"{search}-extra{self.max_extra_length}{weights}"

    def search_fn(self, graphdef: nnx.GraphDef, seed: int, *, scores: bool = False,
                  model_config: ModelConfig | None = None) -> Search:
        """The configured search; `scores` makes greedy search and sampling score their hypothesis too (beam
        search always does), as n-best lists need. With search=mbr: mbr_candidates samples or n-best entries per
        sentence, ranked on the host by mbr_utility (search_sentences). decode.weights=bfloat16 needs the
        model_config, whose model it builds again with bfloat16 matmuls."""
        if self.weights != "float32":
            if model_config is None:
                raise ValueError(f"decode.weights={self.weights!r} needs the model config to build the search")
            graphdef = weights_graphdef(model_config, self.weights)
        common = dict(max_extra_length=self.max_extra_length, alpha=self.alpha, penalty=self.length_penalty,
                      early_stopping=self.early_stopping, top_k=self.top_k, top_p=self.top_p, epsilon=self.epsilon,
                      seed=seed, cache_blocks=self.cache_blocks, weights=self.weights, shrink=self.shrink)
        if self.search != "mbr":
            return make_search(graphdef, beam_size=self.beam_size, temperature=self.temperature, scores=scores,
                               **common)
        samples = self.mbr_from == "samples"
        return make_search(graphdef, beam_size=1 if samples else self.mbr_candidates, scores=True,
                           temperature=self.mbr_temperature if samples else 0.0,
                           candidates=self.mbr_candidates if samples else 1, utility=self.mbr_utility, **common)

    @property
    def splits(self) -> list[str]:
        splits = [s.strip() for s in self.bleu_splits.split(",") if s.strip()]
        for split in splits:
            if split not in data.SPLITS:
                raise ValueError(f"decode.bleu_splits names {split!r}; expected some of {data.SPLITS}")
        return splits

    def check_nbest(self, nbest: int) -> None:
        """--nbest=N lists the N best finished hypotheses of beam search (one for greedy search), or MBR's N
        distinct candidates of highest expected utility."""
        if self.search == "mbr":
            if not 0 <= nbest <= self.mbr_candidates:
                raise ValueError(f"--nbest={nbest} must be between 0 (off) and decode.mbr_candidates="
                                 f"{self.mbr_candidates}")
            return
        if nbest < 0 or nbest > self.beam_size:
            raise ValueError(f"--nbest={nbest} must be between 0 (off) and decode.beam_size={self.beam_size}: "
                             "beam search keeps that many finished hypotheses")
        if nbest and self.temperature > 0:
            raise ValueError(f"--nbest={nbest} ranks the hypotheses of a search; decode.temperature="
                             f"{self.temperature} samples one per sentence")


def length_penalty(length: jax.Array, alpha: float, kind: str = "gnmt") -> jax.Array:
    """A score is log P(Y) / lp(Y): GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, eq. 14), or fairseq's
    |Y|^alpha (kind="fairseq"); |Y| counts the EOS."""
    if kind not in PENALTIES:
        raise ValueError(f"length penalty {kind!r} must be one of {PENALTIES}")
    length = jnp.asarray(length, jnp.float32)
    return (length if kind == "fairseq" else (5.0 + length) / 6.0) ** alpha


def output_limits(inputs: jax.Array, max_extra_length: int, config: ModelConfig | None = None) -> jax.Array:
    """[batch] the most tokens (EOS included) each sentence may produce: its real length + max_extra_length,
    within a learned position table when the model config has one (a position past it has no trained row: the
    embedding would repeat the last); 0 for a row of padding only."""
    lengths = jnp.sum(inputs != PAD_ID, axis=1).astype(jnp.int32)
    limits = lengths + max_extra_length
    if config is not None and config.positional_encoding == "learned":
        limits = jnp.minimum(limits, config.max_length - (lengths if config.joins_pair else 0))
    return jnp.where(lengths > 0, limits, 0)


def allowed_logits(logits: jax.Array, index: jax.Array, limits: jax.Array) -> jax.Array:
    """The tokens a search may choose: never the pad id, which the tokenizer drops, so an output holding it would
    lose a position silently (tensor2tensor and fairseq rule it out too), and at a row's last allowed position
    (index == limit - 1) only EOS. logits [rows, vocab], limits [rows]. Only the choice is restricted: scores
    stay log P under the whole vocabulary, as teacher forcing computes them."""
    vocab = jnp.arange(logits.shape[-1])
    last = (index + 1 >= limits)[:, None]
    return jnp.where((vocab == PAD_ID) | (last & (vocab != EOS_ID)), NEG_INF, logits)


def cache_blocks_for(cache_blocks: int, beam_size: int) -> int:
    """The config's decode.cache_blocks with 0 ("auto") resolved: 4 blocks for beam search, 1 for greedy search and
    sampling. Blocks make beam search's steps faster on CPU (they read only the rows written so far); greedy search's
    steps are cheap, and the blocks' longer compilation of each batch shape costs it more (docs/benchmarks.md)."""
    if cache_blocks < 0:
        raise ValueError(f"cache_blocks={cache_blocks} must be >= 0 (0: 4 for beam search, 1 otherwise)")
    return cache_blocks or (4 if beam_size > 1 else 1)


# ----------------------------------------------------------------------------------------------------
# Greedy search and sampling: one hypothesis per sentence, or several candidates of one


def default_streams(batch: int, call: int = 0) -> jax.Array:
    """Rows 0..batch-1 as sentences 0..batch-1 of call `call` (a batch passed to a search directly)."""
    return jnp.stack([jnp.full((batch,), call, jnp.int32), jnp.arange(batch, dtype=jnp.int32)], axis=1)


def greedy_search(params: PyTree, inputs: jax.Array, streams: jax.Array | None = None, *, graphdef: nnx.GraphDef,
                  max_extra_length: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0,
                  epsilon: float = 0.0, seed: int = 0, cache_blocks: int = 0, alpha: float = 0.0,
                  penalty: str = "gnmt", return_scores: bool = False, candidates: int = 1,
                  keys: jax.Array | None = None, max_length: int | None = None, cache_dtype: Any = None,
                  shrink: int = 0) -> jax.Array | tuple[jax.Array, jax.Array]:
    """inputs [batch, src_length] -> output ids [batch * candidates, src_length + max_extra_length], padded with 0
    after EOS; row s * candidates + j is candidate j of sentence s (one per sentence by default).

    temperature 0 takes the argmax (greedy search); temperature > 0 samples from `sampling_logits` (epsilon, top_k,
    top_p), candidate j of row r at position t with key fold_in(candidate_keys(row_keys(seed, streams))[r, j], t);
    streams [batch, 2] (call, sentence index), default_streams when None. A sentence's candidates are decode_step's
    hypotheses: its encoder output and cross-attention keys/values are computed once. Stops once every row has
    produced EOS (rows of all-padding inputs count as finished). cache_blocks: the self-attention cache's blocks
    (Transformer.init_cache; 0: cache_blocks_for's choice); the outputs are the same up to float rounding.
    return_scores: also [batch * candidates] log P(output) / length_penalty(length, alpha, penalty), log P under the
    model itself (temperature 1). keys [batch]: the rows' sampling keys instead of row_keys(seed, streams)'s (the
    train step's own). max_length: outputs of at most this many tokens, EOS included. shrink: shrinking_loop's.
    """
    model = nnx.merge(graphdef, params)
    batch, max_decode_length = inputs.shape[0], inputs.shape[1] + max_extra_length
    shape = (batch, candidates)  # the loop's state: shrinking_loop drops a sentence with all its candidates
    limits = jnp.repeat(output_limits(inputs, max_extra_length, model.config), candidates).reshape(shape)
    if max_length is not None:
        max_decode_length, limits = min(max_decode_length, max_length), jnp.minimum(limits, max_length)
    cache = model.init_cache(model.encode(inputs), inputs, max_decode_length, hypotheses=candidates,
                             blocks=cache_blocks_for(cache_blocks, candidates), dtype=cache_dtype)
    if temperature > 0:
        keys = candidate_keys(row_keys(seed, default_streams(batch) if streams is None else streams)
                              if keys is None else keys, candidates)

    def not_done(carry):
        return (carry["index"] < max_decode_length) & ~jnp.all(carry["finished"])

    def step(carry):
        index, finished = carry["index"], carry["finished"].reshape(-1)
        raw, cache = model.decode_step(carry["previous"], index, carry["cache"])  # [batch, candidates, vocab]
        raw = raw.reshape(finished.shape[0], -1)
        logits = allowed_logits(raw, index, carry["limits"].reshape(-1))
        chosen = choose_tokens(logits, index, carry["keys"].reshape(-1) if temperature > 0 else None, temperature,
                               top_k, top_p, epsilon)
        token = jnp.where(finished, PAD_ID, chosen.astype(jnp.int32))
        if return_scores:  # normalised over the whole vocabulary, as beam search scores EOS at the limit
            picked = jnp.take_along_axis(raw, token[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(raw, axis=-1)
            picked = jnp.where(finished, 0.0, picked).reshape(carry["log_prob"].shape)
            carry = dict(carry, log_prob=carry["log_prob"] + picked)
        token = token.reshape(carry["previous"].shape)
        return dict(carry, index=index + 1, previous=token, cache=cache, finished=carry["finished"] | (token == EOS_ID),
                    outputs=carry["outputs"].at[:, :, index].set(token))

    start = dict(index=jnp.int32(0), previous=jnp.zeros(shape, jnp.int32), cache=cache, finished=limits == 0,
                 limits=limits, outputs=jnp.zeros((*shape, max_decode_length), jnp.int32),
                 log_prob=jnp.zeros(shape, jnp.float32), **({"keys": keys.reshape(shape)} if temperature > 0 else {}))
    final = shrinking_loop(not_done, step, start, lambda carry: jnp.all(carry["finished"], axis=1), shrink,
                           ("outputs", "log_prob"))
    outputs = final["outputs"].reshape(batch * candidates, max_decode_length)
    if not return_scores:
        return outputs
    lengths = jnp.argmax(outputs == EOS_ID, axis=1) + 1  # every real row ends with its EOS
    return outputs, final["log_prob"].reshape(-1) / length_penalty(lengths, alpha, penalty)


# ----------------------------------------------------------------------------------------------------
# Beam search


def _gather_beams(tree: PyTree, beam_indices: jax.Array) -> PyTree:
    """Select beams: every leaf [batch, beams, ...] indexed by beam_indices [batch, n] -> [batch, n, ...]."""
    return jax.tree.map(lambda x: jnp.take_along_axis(
        x, beam_indices.reshape(beam_indices.shape + (1,) * (x.ndim - 2)), axis=1), tree)


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
    log_norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    # The pad id is never chosen (allowed_logits), but stays in the normaliser: scores are teacher forcing's.
    top_logits, tokens = _top_k(logits.at[..., PAD_ID].set(NEG_INF), per_beam)  # [batch, beams, per_beam]
    scores = top_logits - log_norm
    # At the limit: EOS at its real probability (as fairseq does), every other extension ruled out.
    eos_score = logits[..., EOS_ID:EOS_ID + 1] - log_norm
    first = jnp.arange(per_beam) == 0
    limited = at_limit[:, None, None]
    scores = jnp.where(limited, jnp.where(first, eos_score, NEG_INF), scores) + live_scores[:, :, None]
    tokens = jnp.where(limited, jnp.where(first, EOS_ID, PAD_ID), tokens)
    scores, flat = jax.lax.top_k(scores.reshape(batch, beams * per_beam), count)
    return scores, flat // per_beam, jnp.take_along_axis(tokens.reshape(batch, beams * per_beam), flat, axis=1)


def _beam_start(cache: PyTree, limits: jax.Array, beams: int, max_decode_length: int) -> dict[str, Any]:
    """beam_search's loop state before the first step: no hypothesis, no history, nothing finished."""
    batch = limits.shape[0]
    # Only beam 0 is live at the start, so the first step's K best come from K different tokens.
    live_scores = jnp.tile(jnp.array([0.0] + [NEG_INF] * (beams - 1), jnp.float32), (batch, 1))
    return dict(index=jnp.int32(0), cache=cache, tokens=jnp.zeros((batch, beams), jnp.int32),
                ancestors=jnp.zeros((batch, beams, max_decode_length), jnp.int32),
                live_scores=live_scores, live_sequences=jnp.zeros((batch, beams, max_decode_length), jnp.int32),
                finished_scores=jnp.full((batch, beams), NEG_INF, jnp.float32),
                finished_sequences=jnp.zeros((batch, beams, max_decode_length), jnp.int32),
                finished_flags=jnp.zeros((batch, beams), bool), done=limits == 0, limits=limits)


def beam_search(params: PyTree, inputs: jax.Array, *, graphdef: nnx.GraphDef, beam_size: int, alpha: float,
                max_extra_length: int, early_stopping: bool = True, cache_blocks: int = 0,
                penalty: str = "gnmt", cache_dtype: Any = None, shrink: int = 0) -> tuple[jax.Array, jax.Array]:
    """inputs [batch, src_length] -> (sequences [batch, beam_size, src_length + max_extra_length], each ending in
    EOS then padding, best first; scores [batch, beam_size], log P / length_penalty(length, alpha, penalty),
    NEG_INF-ish for empty slots).

    early_stopping=False runs every row to the full buffer length (for benchmarks). cache_blocks: the
    self-attention cache's blocks (Transformer.init_cache; 0: cache_blocks_for's choice, 4); the results are the
    same up to float rounding. The beams are decode_step's hypotheses; reordering them moves the ancestor table
    [batch, beams, positions] (which beam slot's cache rows hold each position of each hypothesis), never the
    cache, which every layer would have to copy. shrink: the batch halves up to this many times as its sentences
    finish (search_ops.shrinking_loop; the same outputs).
    """
    model = nnx.merge(graphdef, params)
    beams, max_decode_length = beam_size, inputs.shape[1] + max_extra_length
    limits = output_limits(inputs, max_extra_length, model.config)
    cache = model.init_cache(model.encode(inputs), inputs, max_decode_length, hypotheses=beams,
                             blocks=cache_blocks_for(cache_blocks, beams), dtype=cache_dtype)

    def not_done(carry):
        return (carry["index"] < max_decode_length) & ~jnp.all(carry["done"])

    def step(carry):
        index, limits = carry["index"], carry["limits"]
        # Each slot's hypothesis sees its own slot at the position it writes now.
        ancestors = carry["ancestors"].at[:, :, index].set(jnp.arange(beams))
        logits, cache = model.decode_step(carry["tokens"], index, carry["cache"], history=ancestors)
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
        new_finished = jnp.where(ended, scores / length_penalty(index + 1, alpha, penalty), NEG_INF)
        finished_scores, best = jax.lax.top_k(jnp.concatenate([carry["finished_scores"], new_finished], 1), beams)
        finished_sequences = _gather_beams(jnp.concatenate([carry["finished_sequences"], sequences], 1), best)
        finished_flags = _gather_beams(jnp.concatenate([carry["finished_flags"], ended], 1), best)
        # No live hypothesis can still beat the K finished ones (valid for alpha >= 0: log P <= 0 only falls, and
        # either penalty grows with the length, so dividing by lp(limit) is the most any extension can reach).
        best_possible = live_scores[:, 0] / length_penalty(limits, alpha, penalty)
        settled = jnp.all(finished_flags, axis=1) & (finished_scores[:, -1] >= best_possible)
        done = carry["done"] | (index + 1 >= limits) | (early_stopping & settled)
        return dict(carry, index=index + 1, cache=cache, ancestors=ancestors, tokens=live["tokens"],
                    live_scores=live_scores, live_sequences=live["sequences"], finished_scores=finished_scores,
                    finished_sequences=finished_sequences, finished_flags=finished_flags, done=done)

    final = shrinking_loop(not_done, step, _beam_start(cache, limits, beams, max_decode_length),
                           lambda carry: carry["done"], shrink,
                           ("finished_scores", "finished_sequences", "finished_flags"))
    sequences = jnp.where(final["finished_flags"][:, :, None], final["finished_sequences"], 0)
    return sequences, final["finished_scores"]


# ----------------------------------------------------------------------------------------------------
# One entry point for every caller


class Hypothesis(NamedTuple):
    """One finished output of a sentence."""

    ids: np.ndarray  # token ids up to and including EOS
    score: float  # log_prob / length_penalty(len(ids), alpha, penalty): what the search ranks by
    log_prob: float  # log P(ids | source) under the model


@dataclasses.dataclass(eq=False)
class Search:
    """A jitted search bound to one model and its settings (make_search).

    `run(params, inputs, streams)` -> (sequences [batch, hypotheses, src_length + max_extra_length], scores
    [batch, hypotheses]), best first, each sequence ending with EOS (all zeros in an empty slot); streams [batch,
    2] (call, sentence index) seed sampling (module docstring). `search(params, inputs)` -> the best sequences.
    scored: the scores are real (beam search, or make_search(scores=True)); else zeros. calls: the index of
    the next search_sentences call, which advances it. utility: MBR's (mbr.UTILITIES), which search_sentences ranks
    the hypotheses by (the device's order is then not the final one); None: the device's order is.
    """

    run: Callable[[PyTree, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
    hypotheses: int
    scored: bool
    alpha: float = 0.0
    penalty: str = "gnmt"
    calls: int = 0
    utility: str | None = None

    def __call__(self, params: PyTree, inputs: jax.Array, call: int = 0) -> jax.Array:
        return self.run(params, inputs, default_streams(inputs.shape[0], call))[0][:, 0]


def make_search(graphdef: nnx.GraphDef, *, max_extra_length: int, beam_size: int = 1, alpha: float = 0.0,
                penalty: str = "gnmt", early_stopping: bool = True, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 0.0, epsilon: float = 0.0, seed: int = 0, cache_blocks: int = 0, scores: bool = False,
                candidates: int = 1, utility: str | None = None, weights: str = "float32", shrink: int = 0) -> Search:
    """The `Search` of the settings: sampling when temperature > 0 (beam_size 1 only; `candidates` samples per
    sentence), else greedy search for beam_size 1, else beam search (all beam_size finished hypotheses); the
    self-attention cache in `cache_blocks` blocks (Transformer.init_cache; 0: cache_blocks_for's choice). scores:
    greedy search and sampling also score their hypotheses (a logsumexp per step; beam search scores anyway).
    utility: rank each sentence's hypotheses by minimum Bayes risk under it (mbr.py) in search_sentences. weights:
    the floating parameters are cast to it inside each call (cast_weights; graphdef: weights_graphdef's). shrink: the
    batch halves up to this many times as its sentences finish (search_ops.shrinking_loop)."""
    if candidates < 1 or (candidates > 1 and temperature <= 0.0):
        raise ValueError(f"candidates={candidates} must be 1, or more with temperature > 0 (distinct samples)")
    if utility is not None:
        mbr.metric(utility)
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    if penalty not in PENALTIES:
        raise ValueError(f"length penalty {penalty!r} must be one of {PENALTIES}")
    if temperature > 0.0 and beam_size > 1:
        raise ValueError(f"temperature={temperature} samples one hypothesis; beam_size={beam_size} asks for beam "
                         "search: choose one")
    sampling = temperature > 0.0 or beam_size == 1
    # Weights alone in bfloat16: the caches, and attention over them, stay float32 (XLA's CPU backend converted a
    # bfloat16 cache to float32 at every step: beam 4 at the small shape ran 37 sentences/s against 44 so).
    cache_dtype = None if weights == "float32" else jnp.float32
    cache_blocks = cache_blocks_for(cache_blocks, candidates if sampling else beam_size)
    if sampling:
        greedy = functools.partial(greedy_search, graphdef=graphdef, max_extra_length=max_extra_length,
                                   temperature=temperature, top_k=top_k, top_p=top_p, epsilon=epsilon, seed=seed,
                                   cache_blocks=cache_blocks, alpha=alpha, penalty=penalty, return_scores=scores,
                                   candidates=candidates, cache_dtype=cache_dtype, shrink=shrink)

        def samples(params, inputs, streams):
            outputs = greedy(cast_weights(params, weights), inputs, streams)
            rows = inputs.shape[0] * candidates
            sequences, row_scores = outputs if scores else (outputs, jnp.zeros((rows,), jnp.float32))
            return (sequences.reshape(inputs.shape[0], candidates, -1),
                    row_scores.reshape(inputs.shape[0], candidates))
        return Search(jax.jit(samples), candidates, scores, alpha, penalty, utility=utility)

    def beams(params, inputs, streams):
        del streams  # beam search draws no random numbers
        return beam_search(cast_weights(params, weights), inputs, graphdef=graphdef, beam_size=beam_size, alpha=alpha,
                           max_extra_length=max_extra_length, early_stopping=early_stopping,
                           cache_blocks=cache_blocks, penalty=penalty, cache_dtype=cache_dtype, shrink=shrink)
    return Search(jax.jit(beams), beam_size, True, alpha, penalty, utility=utility)


# ----------------------------------------------------------------------------------------------------
# Sentences in, sentences out, over every device and process


def _runner(search: Search | Callable, call: int | None) -> tuple[Callable, int]:
    """(run, call index) of a Search, advancing its call count unless `call` pins one; any other callable
    `(params, inputs) -> ids` (a stand-in) gives one unscored hypothesis per row."""
    if isinstance(search, Search):
        if call is None:
            call, search.calls = search.calls, search.calls + 1
        return search.run, call

    def run(params, inputs, streams):
        outputs = search(params, inputs)
        return outputs[:, None], np.zeros((outputs.shape[0], 1), np.float32)
    return run, call or 0


def _hypotheses(sequences: np.ndarray, scores: np.ndarray, log_probs: np.ndarray) -> list[Hypothesis]:
    """One row's finished hypotheses (sequences [n, length]; empty slots, without EOS, are dropped)."""
    found = []
    for ids, score, log_prob in zip(sequences, scores, log_probs):
        if EOS_ID in ids:
            found.append(Hypothesis(ids[:int(np.argmax(ids == EOS_ID)) + 1].astype(np.int32), float(score),
                                    float(log_prob)))
    return found


def mbr_ranked(hypotheses: list[Hypothesis], tokenizer: Tokenizer, utility: str) -> list[Hypothesis]:
    """A sentence's candidates by minimum Bayes risk (mbr.ranking: expected utility against all of them as
    references, highest first), each distinct text once, its score the expected utility; log_prob stays the model's."""
    texts = [tokenizer.decode(hypothesis.ids) for hypothesis in hypotheses]
    order, expected = mbr.ranking(texts, utility)
    ranked, seen = [], set()
    for index, value in zip(order, expected):
        if texts[index] not in seen:
            seen.add(texts[index])
            ranked.append(hypotheses[index]._replace(score=float(value)))
    return ranked


@dataclasses.dataclass(frozen=True)
class Decoded:
    """What search_sentences found: each sentence's finished hypotheses, best first (beam search's up to beam_size,
    else one; none for an empty sentence), in input order, and the line numbers (from 1) of the inputs cut to the
    bound (their translations count). `scored`, `kept`: whether the search scored its hypotheses, and how many it
    keeps per sentence (what an n-best list may ask for)."""

    hypotheses: list[list[Hypothesis]]
    cut_lines: list[int]
    scored: bool = False
    kept: int = 1

    @property
    def cut(self) -> int:
        return len(self.cut_lines)

    def best_ids(self) -> list[np.ndarray]:
        """The ids of each sentence's best hypothesis (EOS included); empty for an empty sentence."""
        return [found[0].ids if found else np.zeros((0,), np.int32) for found in self.hypotheses]

    def translations(self, tokenizer: Tokenizer) -> list[str]:
        """Each sentence's best hypothesis as text; empty for an empty sentence."""
        return [tokenizer.decode(ids) for ids in self.best_ids()]

    def nbest(self, n: int) -> list[list[Hypothesis]]:
        """The `n` best finished hypotheses of each sentence (fewer where the search finished fewer), best first;
        n-best lists need a scored search that keeps at least n."""
        if not self.scored:
            raise ValueError("n-best lists need a scored Search (beam search, or make_search(..., scores=True))")
        if not 1 <= n <= self.kept:
            raise ValueError(f"nbest={n} must be between 1 and the {self.kept} hypotheses the search keeps "
                             "(decode.beam_size)")
        return [found[:n] for found in self.hypotheses]


def candidate_batches(batch_size: int, max_tokens_per_batch: int, candidates: int) -> tuple[int, int]:
    """(sentences per batch, token budget) when decode.batch_size and max_tokens_per_batch count candidates, as MBR's
    do: 1/candidates of each, at least 1 (a budget of 0 stays 0: none)."""
    return (max(1, batch_size // candidates),
            max_tokens_per_batch and max(1, max_tokens_per_batch // candidates))


def search_sentences(search: Search | Callable, params: PyTree, tokenizer: Tokenizer, sentences: list[str],
                     batch_size: int, max_input_length: int | None = None, *, name: str | None = "input",
                     max_tokens_per_batch: int = 0, batch_sharding: NamedSharding | None = None,
                     call: int | None = None) -> Decoded:
    """Decode every sentence; each one always finishes. Inputs longer than max_input_length (None: no bound; callers
    pass DecodeConfig.input_bound) are cut to it, keeping EOS, with one warning naming `name` (a split or file;
    None: no warning) and the lines. Length-sorted batches of at most batch_size rows and, with
    max_tokens_per_batch > 0, at most that many rows x padded length (budget_batches), rows in whole multiples of
    the devices, are split over batch_sharding (default: batching.batch_sharding_for(params)); with several processes
    each places its own rows, and every process gets every hypothesis. call: sampling's call index (default: the
    next). An MBR search (Search.utility) counts batch_size and max_tokens_per_batch in candidates, so a batch
    holds 1/hypotheses as many sentences, and ranks each batch's candidates on the host while the device decodes
    the batches after it."""
    scored, kept = (search.scored, search.hypotheses) if isinstance(search, Search) else (False, 1)
    utility = search.utility if isinstance(search, Search) else None
    if not sentences:
        return Decoded([], [], scored, kept)
    inputs, cut = batching.encode_inputs(tokenizer, sentences, max_input_length, name)
    batch_sharding = batching.batch_sharding_for(params) if batch_sharding is None else batch_sharding
    run, call = _runner(search, call)
    pending = []
    sentences_per_batch, max_tokens = candidate_batches(batch_size, max_tokens_per_batch, kept if utility else 1)
    rows, ways = batching.device_rows(sentences_per_batch, batch_sharding), batching.row_ways(batch_sharding)
    for indices, batch in batching.budget_batches(inputs, rows, ways, max_tokens):
        streams = np.stack([np.full(len(indices), call), indices], axis=1).astype(np.int32)
        placed = sharding.place_batch({"inputs": batch, "streams": streams}, batch_sharding)
        pending.append((indices, run(params, placed["inputs"], placed["streams"])))  # dispatched, not awaited
    alpha, penalty = (search.alpha, search.penalty) if isinstance(search, Search) else (0.0, "gnmt")
    results: list[list[Hypothesis]] = [[] for _ in sentences]
    for indices, (sequences, scores) in pending:
        sequences, scores = batching.to_host(sequences), batching.to_host(scores)
        lengths = np.argmax(sequences == EOS_ID, axis=-1) + 1
        log_probs = scores * np.asarray(length_penalty(lengths, alpha, penalty))
        for index, *row in zip(indices, sequences, scores, log_probs):
            if index >= 0 and sentences[index].strip():
                found = _hypotheses(*row)
                results[index] = mbr_ranked(found, tokenizer, utility) if utility and found else found
    return Decoded(results, cut, scored, kept)


def nbest_lines(nbest: list[list[Hypothesis]], tokenizer: Tokenizer, first_index: int = 0) -> list[str]:
    """Moses' n-best format, one line per hypothesis, best first: `index ||| translation ||| LogProb= log P |||
    score` (index counts sentences from first_index, 0-based; score = log P / length penalty, or MBR's expected
    utility). An empty sentence
    gets one line with an empty translation and 0 scores, so every index appears."""
    lines = []
    for index, hypotheses in enumerate(nbest, first_index):
        for hypothesis in hypotheses or [Hypothesis(np.zeros((0,), np.int32), 0.0, 0.0)]:
            lines.append(f"{index} ||| {tokenizer.decode(hypothesis.ids)} ||| LogProb= {hypothesis.log_prob:.6f} "
                         f"||| {hypothesis.score:.6f}")
    return lines
