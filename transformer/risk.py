"""Minimum risk training's parts (train.objective="risk"): candidates drawn on the device, their sentence BLEU
against the reference on token ids, and the expected risk over them.

Minimum risk training (Shen et al. 2016; Edunov et al. 2018's "sequence risk") minimises, for each source x with
reference r, R(x) = sum_j Q(y_j | x) (1 - BLEU(y_j, r)) over a set of candidates y_1..y_k, Q being the model's
probabilities renormalised over the set (softmax of the sequence log-probabilities). Why MRT rather than a policy
gradient with a group baseline (GRPO): given the candidates, R is a differentiable function of the parameters,
whose gradient sum_j Q_j (cost_j - R) grad log P(y_j) already carries a baseline (the expected cost over the
group, weighted by the model), and Edunov et al. measured it on translation (+0.5 to +1 BLEU over likelihood on
IWSLT'14 with the likelihood mixed in). The candidates are k samples of the current model at temperature 1 (one
greedy_search loop, `decode.greedy_search(candidates=k)`), drawn under stop_gradient inside the jitted step:
no host work, no callback. Repeated samples count once (a set, as the method defines it).

The reward is BLEU on token ids (sentencepiece pieces, EOS and padding left out), computed on the device: clipped
n-gram matches by pairwise comparison of the candidate's and the reference's n-gram windows (O(L^2) per candidate
and order, small beside the step), with Lin and Och's add-one smoothing of the 2- to 4-gram precisions and BLEU's
brevity penalty: sacreBLEU's sentence BLEU with smooth_method="add-k", smooth_value=1 and tokenize="none" over the
ids as words (tests/risk_test.py checks it against sacreBLEU itself).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from transformer import decode
from transformer.tokenizer import EOS_ID, PAD_ID

MAX_ORDER = 4
SUMS = ("risk", "reward", "sentences")  # the metric sums a risk step adds (steps.SUM_KEYS)
SAMPLE_SALT = 0x72697363  # folded into the step's key: the candidates' own stream, apart from dropout's


@dataclasses.dataclass(frozen=True)
class Objective:
    """train.objective="risk"'s settings, as the train step takes them."""

    weight: float  # train.risk_weight: objective = (1 - weight) x token loss + weight x sequence risk
    candidates: int  # train.risk_candidates: k samples per source


def draw_candidates(params, inputs: jax.Array, key: jax.Array, *, graphdef: nnx.GraphDef, candidates: int,
                    length: int) -> jax.Array:
    """inputs [rows, src_length] -> [rows, candidates, length] samples of the model (temperature 1, no truncation),
    each ending with EOS within the row's `length` tokens and padded with 0 after it; no gradient flows into them.
    Row r's candidates draw from split(fold_in(key, SAMPLE_SALT), rows)[r] (candidate_keys folds in j > 0)."""
    rows = inputs.shape[0]
    keys = jax.random.split(jax.random.fold_in(key, SAMPLE_SALT), rows)
    if not jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):  # the train state's raw threefry key
        keys = jax.random.wrap_key_data(keys)
    # max_extra_length=length makes the buffer at least `length` tokens and max_length cuts it to exactly that.
    samples = decode.greedy_search(jax.lax.stop_gradient(params), inputs, graphdef=graphdef, max_extra_length=length,
                                   temperature=1.0, candidates=candidates, keys=keys, max_length=length)
    return jax.lax.stop_gradient(samples.reshape(rows, candidates, length))


def _ngram_windows(tokens: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """tokens [..., L] (words then EOS/padding) -> (windows [..., L, n]: the n tokens from each position, valid
    [..., L]: the window lies within the words)."""
    words = (tokens != PAD_ID) & (tokens != EOS_ID)
    padded = jnp.pad(tokens, [(0, 0)] * (tokens.ndim - 1) + [(0, n - 1)])
    inside = jnp.pad(words, [(0, 0)] * (tokens.ndim - 1) + [(0, n - 1)])
    length = tokens.shape[-1]
    windows = jnp.stack([padded[..., m:m + length] for m in range(n)], axis=-1)
    valid = jnp.all(jnp.stack([inside[..., m:m + length] for m in range(n)], axis=-1), axis=-1)
    return windows, valid


def sentence_bleu(candidates: jax.Array, references: jax.Array) -> jax.Array:
    """BLEU in [0, 1] of each candidate [..., L] against its reference [..., L'] (same leading shape), on token ids:
    see the module's docstring for the definition."""
    log_precision = 0.0
    hypothesis_words = jnp.sum((candidates != PAD_ID) & (candidates != EOS_ID), axis=-1).astype(jnp.float32)
    reference_words = jnp.sum((references != PAD_ID) & (references != EOS_ID), axis=-1).astype(jnp.float32)
    for n in range(1, MAX_ORDER + 1):
        mine, mine_valid = _ngram_windows(candidates, n)
        theirs, theirs_valid = _ngram_windows(references, n)
        same = jnp.all(mine[..., :, None, :] == mine[..., None, :, :], axis=-1) & mine_valid[..., None, :]
        matched = jnp.all(mine[..., :, None, :] == theirs[..., None, :, :], axis=-1) & theirs_valid[..., None, :]
        in_mine, in_theirs = jnp.sum(same, axis=-1), jnp.sum(matched, axis=-1)
        # Each occurrence of an n-gram g takes min(count_mine(g), count_theirs(g)) / count_mine(g) of a match,
        # so that g's occurrences together make its clipped count.
        clipped = jnp.where(mine_valid, jnp.minimum(in_mine, in_theirs) / jnp.maximum(in_mine, 1), 0.0)
        matches, total = jnp.sum(clipped, axis=-1), jnp.maximum(hypothesis_words - n + 1, 0.0)
        if n == 1:
            unigram_matches = matches
        else:  # add-one smoothing (Lin and Och 2004): a short sentence without a 4-gram match is not 0
            matches, total = matches + 1.0, total + 1.0
        log_precision = log_precision + jnp.log(jnp.maximum(matches, 1e-30) / jnp.maximum(total, 1.0)) / MAX_ORDER
    brevity = jnp.minimum(1.0 - reference_words / jnp.maximum(hypothesis_words, 1.0), 0.0)
    return jnp.where(unigram_matches > 0, jnp.exp(log_precision + brevity), 0.0)  # no match at all: 0


def distinct(candidates: jax.Array) -> jax.Array:
    """[rows, k, L] -> [rows, k] bool: the candidate differs from every one before it (a set's members)."""
    equal = jnp.all(candidates[:, :, None, :] == candidates[:, None, :, :], axis=-1)  # [rows, k, k]
    earlier = jnp.tril(jnp.ones(equal.shape[-2:], bool), k=-1)
    return ~jnp.any(equal & earlier, axis=-1)


def expected_risk(log_probs: jax.Array, costs: jax.Array, members: jax.Array) -> jax.Array:
    """[rows, k] sequence log-probabilities, costs and set membership -> [rows] sum_j Q_j cost_j, Q the softmax
    of the members' log-probabilities (the others weigh 0)."""
    weights = jax.nn.softmax(jnp.where(members, log_probs, -jnp.inf), axis=-1)
    return jnp.sum(weights * costs, axis=-1)
