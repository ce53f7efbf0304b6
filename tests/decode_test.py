import functools
import itertools
import logging

import decode_setup
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.batching import budget_batches
from transformer.decode import (NEG_INF, DecodeConfig, beam_search, cache_blocks_for,
                                greedy_search, length_penalty, make_search, nbest_lines,
                                sampling_logits, search_sentences)
from transformer.model import ModelConfig, build as build_model
from transformer.model.attention import blocked_attention, dot_product_attention, to_cache_layout, write_cache_rows
from transformer.steps import shift_right
from transformer.tokenizer import EOS_ID, PAD_ID


jitted_beam_search = jax.jit(beam_search, static_argnames=(
    "graphdef", "beam_size", "alpha", "max_extra_length", "early_stopping", "cache_blocks", "penalty"))


def build(vocab_size, seed, **shapes):
    config = ModelConfig(**{**dict(vocab_size=vocab_size, emb_dim=32, num_heads=4, num_encoder_layers=1,
                                   num_decoder_layers=2, mlp_dim=64), **shapes})
    graphdef, params = nnx.split(build_model(config, rngs=nnx.Rngs(seed)))
    return graphdef, nnx.to_pure_dict(params)


@pytest.fixture(scope="module")
def model_and_search():
    graphdef, params = build(20, 3)
    search = jax.jit(functools.partial(greedy_search, graphdef=graphdef, max_extra_length=6))
    return graphdef, params, search


INPUTS = jnp.array([[4, 5, 6, 1, 0, 0, 0, 0], [7, 8, 9, 10, 11, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]])


@functools.partial(jax.jit, static_argnums=0)
def teacher_forced_log_probs(graphdef, params, inputs, outputs):
    """Sum of log P(token) of each row of outputs [rows, length] up to its first EOS (token 0 before it counts)."""
    model = nnx.merge(graphdef, params)
    log_probs = jax.nn.log_softmax(model(inputs, shift_right(outputs)))
    picked = jnp.take_along_axis(log_probs, outputs[..., None], axis=-1)[..., 0]
    before_eos = jnp.cumsum(outputs == EOS_ID, axis=-1) - (outputs == EOS_ID) == 0
    return jnp.sum(jnp.where(before_eos, picked, 0.0), axis=-1)


def length_of(tokens):
    return int(np.argmax(tokens == EOS_ID)) + 1 if EOS_ID in tokens else len(tokens)


def penalty_formula(length, alpha, penalty):
    """The papers' formulas, written out: GNMT ((5 + |Y|) / 6)^alpha, fairseq |Y|^alpha."""
    length = np.asarray(length, np.float64)
    return ((5.0 + length) / 6.0) ** alpha if penalty == "gnmt" else length ** alpha


@pytest.mark.parametrize("blocks", [1, 3])
def test_cached_incremental_logits_equal_the_teacher_forced_pass(model_and_search, blocks):
    graphdef, params, _ = model_and_search
    decoder_inputs = jnp.array([[0, 5, 9, 3, 12, 7], [0, 17, 2, 2, 8, 4], [0, 1, 1, 1, 1, 1]])

    @jax.jit
    def both(params):
        model = nnx.merge(graphdef, params)
        cache = model.init_cache(model.encode(INPUTS), INPUTS, decoder_inputs.shape[1], blocks=blocks)
        steps = []
        for index in range(decoder_inputs.shape[1]):  # each step reads only the blocks up to its own
            logits, cache = model.decode_step(decoder_inputs[:, index, None], jnp.int32(index), cache)
            steps.append(logits[:, 0])
        return jnp.stack(steps, axis=1), model(INPUTS, decoder_inputs)
    incremental, full = both(params)
    np.testing.assert_allclose(incremental[:2], full[:2], atol=1e-5, rtol=1e-5)


def test_greedy_output_is_the_argmax_of_the_teacher_forced_pass(model_and_search):
    graphdef, params, search = model_and_search
    outputs = np.asarray(search(params, INPUTS))
    assert outputs.shape == (3, 14)
    assert not outputs[2].any()  # an all-padding row is finished from the start
    model_logits = jax.jit(lambda params, inputs, decoder_inputs: nnx.merge(graphdef, params)(inputs, decoder_inputs))
    for row, limit in ((0, 4 + 6), (1, 6 + 6)):  # real input length + max_extra_length
        tokens = outputs[row]
        length = length_of(tokens)
        assert tokens[length - 1] == EOS_ID and length <= limit and not tokens[length:].any()
        decoder_inputs = jnp.asarray(np.concatenate([[0], tokens[:length - 1]]))[None]
        argmax = np.argmax(model_logits(params, INPUTS[row:row + 1], decoder_inputs)[0], axis=-1)
        forced = length == limit  # the last allowed position may only hold EOS
        np.testing.assert_array_equal(argmax[:length - forced], tokens[:length - forced])


def test_no_search_emits_the_pad_id_and_scores_stay_teacher_forcings(model_and_search):
    """A model whose pad row of the shared embedding is scaled up prefers the pad id at many steps (the setup,
    asserted); greedy search, beam search and sampling still never emit it before EOS (the tokenizer would drop
    it: a lost position), greedy takes the argmax of the other tokens, and beam scores stay log P under the whole
    vocabulary, as teacher forcing computes them."""
    graphdef, params, search = model_and_search
    params = jax.tree.map(lambda x: x, params)
    table = params["source_embedder"]["embedding"]["embedding"]
    params["source_embedder"]["embedding"]["embedding"] = table.at[0].multiply(8.0)
    model_logits = jax.jit(lambda params, inputs, decoder_inputs: nnx.merge(graphdef, params)(inputs, decoder_inputs))
    outputs = np.asarray(search(params, INPUTS))
    pad_preferred = 0
    for row in range(2):
        tokens = outputs[row]
        length = length_of(tokens)
        assert EOS_ID in tokens and not (tokens[:length] == PAD_ID).any()
        logits = np.asarray(model_logits(params, INPUTS[row:row + 1],
                                         jnp.asarray(np.concatenate([[0], tokens[:length - 1]]))[None])[0])
        pad_preferred += int(np.sum(np.argmax(logits[:length], axis=-1) == PAD_ID))
        limit = int(np.sum(np.asarray(INPUTS[row]) != 0)) + 6
        others = np.argmax(np.where(np.arange(logits.shape[-1]) == PAD_ID, -np.inf, logits), axis=-1)
        forced = length == limit
        np.testing.assert_array_equal(others[:length - forced], tokens[:length - forced])
    assert pad_preferred >= 2  # the setup: unmasked, greedy search would have emitted the pad id
    sequences, scores = jitted_beam_search(params, INPUTS, graphdef=graphdef, beam_size=4, alpha=0.0,
                                           max_extra_length=6)
    sampled = np.asarray(make_search(graphdef, max_extra_length=6, temperature=1.0, seed=0)(params, INPUTS))
    for row in range(2):
        for tokens in [*np.asarray(sequences[row]), sampled[row].reshape(-1, sampled.shape[-1])[0]]:
            assert not (tokens[:length_of(tokens)] == PAD_ID).any()
        log_probs = teacher_forced_log_probs(graphdef, params, jnp.repeat(INPUTS[row:row + 1], 4, axis=0),
                                             sequences[row])
        np.testing.assert_allclose(scores[row], log_probs, rtol=1e-5, atol=1e-5)


def test_greedy_search_does_not_depend_on_batch_neighbours(model_and_search):
    _, params, search = model_and_search
    together = np.asarray(search(params, INPUTS))
    alone = np.asarray(search(params, jnp.concatenate([INPUTS[1:2], jnp.zeros_like(INPUTS[:2])])))
    np.testing.assert_array_equal(alone[0], together[1])


def test_length_penalty_is_gnmt_formula_and_reorders_hypotheses():
    assert float(length_penalty(1, 0.6)) == pytest.approx(1.0)
    assert float(length_penalty(7, 0.6)) == pytest.approx(2.0 ** 0.6)
    assert float(length_penalty(25, 1.0)) == pytest.approx(5.0)
    assert float(length_penalty(8, 1.0 / 3, "fairseq")) == pytest.approx(2.0)
    assert float(length_penalty(5, 0.0, "fairseq")) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="length penalty 'wu' must be one of"):
        length_penalty(5, 1.0, "wu")
    # A short (-2.0, 2 tokens) and a long (-2.4, 8 tokens) hypothesis: the short wins without a penalty,
    # the long one from alpha = log(2.4/2) / log(13/7) = 0.294 on.
    short, long = (-2.0, 2), (-2.4, 8)
    def winner(alpha):
        return max((short, long), key=lambda h: h[0] / float(length_penalty(h[1], alpha)))
    assert winner(0.0) == short and winner(0.28) == short and winner(0.31) == long and winner(0.6) == long


# Exhaustive search: vocabulary {pad, EOS, 2, 3, 4}, pad never chosen; a sentence of n tokens may produce n + 1
# tokens, so the longest output has 4 tokens and 27 prefixes of 3 other tokens: 27 beams keep every prefix alive,
# and beam search must then return exactly the 27 best of all 40 complete outputs.
TINY_INPUTS = jnp.array([[2, 1, 0], [3, 2, 1], [0, 0, 0]])
TINY_BEAMS, TINY_EXTRA = 27, 1


def all_outputs(limit, vocab_size=5):
    """Every token sequence a search may emit that ends with its first EOS within `limit` tokens, padded to limit."""
    non_eos = [t for t in range(vocab_size) if t not in (EOS_ID, PAD_ID)]
    return np.array([list(prefix) + [EOS_ID] + [0] * (limit - 1 - len(prefix))
                     for n in range(limit) for prefix in itertools.product(non_eos, repeat=n)], np.int32)


@pytest.fixture(scope="module")
def tiny_model():
    return build(5, 0)


@pytest.mark.parametrize("alpha, penalty", [pytest.param(0.0, "gnmt", marks=pytest.mark.slow), (0.6, "gnmt"),
                                            pytest.param(3.0, "gnmt", marks=pytest.mark.slow), (1.5, "fairseq")])
def test_beam_search_equals_exhaustive_search(tiny_model, alpha, penalty):
    """With early stopping on: stopping on a wrong bound of what live beams can reach would miss outputs."""
    graphdef, params = tiny_model
    sequences, scores = jitted_beam_search(params, TINY_INPUTS, graphdef=graphdef, beam_size=TINY_BEAMS, alpha=alpha,
                                           max_extra_length=TINY_EXTRA, penalty=penalty)
    assert sequences.shape == (3, TINY_BEAMS, 4) and not np.asarray(sequences[2]).any()
    for row in range(2):
        limit = int(np.sum(TINY_INPUTS[row] != 0)) + TINY_EXTRA
        candidates = all_outputs(limit)
        inputs = jnp.repeat(TINY_INPUTS[row:row + 1, :], len(candidates), axis=0)
        lengths = np.array([length_of(c) for c in candidates])
        exhaustive = np.asarray(teacher_forced_log_probs(graphdef, params, inputs, jnp.asarray(candidates)))
        exhaustive = exhaustive / penalty_formula(lengths, alpha, penalty)
        order = np.argsort(-exhaustive, kind="stable")[:TINY_BEAMS]
        count = len(order)  # the 3-token row has 13 possible outputs: the other slots stay empty
        np.testing.assert_allclose(scores[row, :count], exhaustive[order], rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(scores[row, count:]) <= NEG_INF / 2)
        found = np.asarray(sequences[row, :count, :limit])
        np.testing.assert_array_equal(found[0], candidates[order[0]])
        assert {tuple(s) for s in found} == {tuple(c) for c in candidates[order]}


def test_alpha_moves_the_exhaustive_winner_towards_longer_outputs(tiny_model):
    graphdef, params = tiny_model
    lengths = []
    for alpha in (0.0, 3.0):
        sequences, _ = jitted_beam_search(params, TINY_INPUTS, graphdef=graphdef, beam_size=TINY_BEAMS, alpha=alpha,
                                   max_extra_length=TINY_EXTRA)
        lengths.append([length_of(np.asarray(s)) for s in sequences[:2, 0]])
    assert all(b >= a for a, b in zip(*lengths)) and lengths[0] != lengths[1], lengths


def test_beam_scores_equal_teacher_forced_log_probs_through_the_ancestor_table(model_and_search):
    graphdef, params, _ = model_and_search
    sequences, scores = jitted_beam_search(params, INPUTS, graphdef=graphdef, beam_size=4, alpha=0.6, max_extra_length=6)
    assert np.all(np.asarray(scores[:2]) > NEG_INF / 2) and np.all(np.diff(np.asarray(scores[:2]), axis=1) <= 0)
    for row in range(2):
        outputs = sequences[row]
        lengths = np.array([length_of(np.asarray(s)) for s in outputs])
        log_probs = teacher_forced_log_probs(graphdef, params, jnp.repeat(INPUTS[row:row + 1], 4, axis=0), outputs)
        np.testing.assert_allclose(scores[row], log_probs / length_penalty(lengths, 0.6), rtol=1e-5, atol=1e-5)


def test_one_beam_without_length_penalty_is_greedy_search(model_and_search):
    graphdef, params, search = model_and_search
    sequences, _ = jitted_beam_search(params, INPUTS, graphdef=graphdef, beam_size=1, alpha=0.0, max_extra_length=6)
    np.testing.assert_array_equal(sequences[:, 0], search(params, INPUTS))
    beam_one = make_search(graphdef, max_extra_length=6, beam_size=1, alpha=0.6)
    np.testing.assert_array_equal(beam_one(params, INPUTS), search(params, INPUTS))


def test_beam_search_without_early_stopping_gives_the_same_best(model_and_search):
    graphdef, params, _ = model_and_search
    kw = dict(graphdef=graphdef, beam_size=3, alpha=0.6, max_extra_length=6)
    early, early_scores = jitted_beam_search(params, INPUTS, **kw)
    full, full_scores = jitted_beam_search(params, INPUTS, early_stopping=False, **kw)
    np.testing.assert_array_equal(early, full)
    np.testing.assert_allclose(early_scores, full_scores, rtol=1e-6)


def test_early_stopping_under_fairseqs_penalty_loses_nothing():
    """fairseq's length^alpha grows with the length too, so a live log P (<= 0) over limit^alpha bounds what any
    extension can reach: stopping on it gives what running to the end does. These inputs tell: bounding by the
    live hypotheses' current length instead stops a row too early and loses a better hypothesis."""
    graphdef, params = build(20, 1)
    inputs = jnp.array([[4, 5, 6, 1, 0, 0, 0, 0], [7, 8, 9, 10, 11, 1, 0, 0], [5, 1, 0, 0, 0, 0, 0, 0],
                        [9, 9, 1, 0, 0, 0, 0, 0]])
    kw = dict(graphdef=graphdef, beam_size=2, alpha=1.0, max_extra_length=6, penalty="fairseq")
    early, early_scores = jitted_beam_search(params, inputs, **kw)
    full, full_scores = jitted_beam_search(params, inputs, early_stopping=False, **kw)
    np.testing.assert_array_equal(early, full)
    np.testing.assert_allclose(early_scores, full_scores, rtol=1e-6)


def test_cache_blocks_change_no_output(model_and_search):
    """A cache in blocks (each step reading the blocks written so far) decodes as one block: 14 positions in 3
    blocks of 5 (one position never used), all run (no early stop), beam and greedy."""
    graphdef, params, search = model_and_search
    kw = dict(graphdef=graphdef, beam_size=4, alpha=0.6, max_extra_length=6, early_stopping=False)
    one, one_scores = jitted_beam_search(params, INPUTS, cache_blocks=1, **kw)
    three, three_scores = jitted_beam_search(params, INPUTS, cache_blocks=3, **kw)
    assert max(length_of(np.asarray(s)) for s in one[1]) > 10  # hypotheses that reach the last block
    np.testing.assert_array_equal(three, one)
    np.testing.assert_allclose(three_scores, one_scores, rtol=1e-5)
    greedy = jax.jit(functools.partial(greedy_search, graphdef=graphdef, max_extra_length=6, cache_blocks=3))
    np.testing.assert_array_equal(greedy(params, INPUTS), search(params, INPUTS))
    with pytest.raises(ValueError, match="cache_blocks=-1 must be >= 0"):
        jitted_beam_search(params, INPUTS, cache_blocks=-1, **kw)
    assert (cache_blocks_for(0, 4), cache_blocks_for(0, 1), cache_blocks_for(2, 1)) == (4, 1, 2)


def test_cache_rows_written_in_blocks_equal_one_array():
    blocks = tuple(jnp.zeros((2, 3, 4)) for _ in range(3))
    whole = jnp.zeros((2, 3, 12))
    write = jax.jit(write_cache_rows, static_argnums=2)
    for index in range(0, 12, 2):
        rows = jnp.full((2, 3, 2), index + 1.0)
        blocks = write(blocks, rows, 2, jnp.int32(index))
        whole = jax.lax.dynamic_update_slice_in_dim(whole, rows, index, 2)
        np.testing.assert_array_equal(jnp.concatenate(blocks, axis=2), whole)


def test_attention_over_blocks_equals_attention_over_the_whole_cache():
    """blocked_attention reads only the blocks up to the last row written and joins them into one softmax: the
    same as one softmax over every row the mask shows (rows past last_row are never shown)."""
    rng = np.random.default_rng(0)
    keys, values, query = (rng.normal(size=shape).astype(np.float32) for shape in [(2, 9, 4, 8), (2, 9, 4, 8),
                                                                                    (2, 3, 4, 8)])
    mask = rng.random((2, 1, 3, 9)) < 0.6
    mask[:, :, :, 0] = True  # every query sees a row
    mask[0, 0, 1, 1:6] = False  # one that sees a single row of the first block and the rest of the last

    @jax.jit  # one compilation instead of one per op
    def both(query, keys, values, mask, last_row):
        mask = mask & (jnp.arange(9) <= last_row)
        key_blocks, value_blocks = to_cache_layout(keys, values)
        expected = dot_product_attention(query, keys, values, mask)
        got = blocked_attention(jnp.transpose(query, (0, 2, 1, 3)), tuple(jnp.split(key_blocks, 3, axis=3)),
                                tuple(jnp.split(value_blocks, 3, axis=2)), mask, last_row)
        return jnp.transpose(got, (0, 2, 1, 3)), expected
    for last_row in (8, 5, 2, 0):
        np.testing.assert_allclose(*both(query, keys, values, mask, jnp.int32(last_row)), atol=1e-6)


def test_sampling_is_seeded_and_top_k_one_is_greedy(model_and_search):
    graphdef, params, search = model_and_search
    def sampler(seed, **kw):
        return make_search(graphdef, max_extra_length=6, temperature=1.0, seed=seed, **kw)
    np.testing.assert_array_equal(sampler(0, top_k=1)(params, INPUTS), search(params, INPUTS))
    seed_0, seed_1 = sampler(0), sampler(1)
    first = np.asarray(seed_0(params, INPUTS))
    np.testing.assert_array_equal(seed_0(params, INPUTS), first)
    assert (np.asarray(seed_0(params, INPUTS, call=1)) != first).any()
    assert (np.asarray(seed_1(params, INPUTS)) != first).any() and not first[2].any()


def test_blockwise_top_k_equals_lax_top_k():
    from transformer.decode import _top_k
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4000))
    values, indices = jax.jit(_top_k, static_argnums=1)(x, 8)
    expected_values, expected_indices = jax.lax.top_k(x, 8)
    np.testing.assert_array_equal(values, expected_values)
    np.testing.assert_array_equal(indices, expected_indices)


def test_top_p_keeps_the_fewest_most_likely_tokens_that_reach_p():
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3]]))

    def kept(temperature=1.0, **kw):
        return set(np.flatnonzero(np.asarray(sampling_logits(logits, temperature, **kw))[0] > NEG_INF / 2).tolist())
    assert kept(top_p=0.4) == {1} and kept(top_p=0.6) == {1, 3} and kept(top_p=0.9) == {1, 3, 2}
    assert kept(top_p=0.99) == kept(top_p=0.0) == kept(top_p=1.0) == {0, 1, 2, 3}  # 0 and 1: off
    assert kept(top_k=2, top_p=0.99) == {1, 3}  # top-k first, then the nucleus of what is left
    assert kept(temperature=100.0, top_p=0.6) == {1, 3, 2}  # a high temperature flattens: more tokens to reach p
    # epsilon: every token below it out, at the temperature's probabilities; the most likely one always stays.
    assert kept(epsilon=0.1) == {1, 2, 3} and kept(epsilon=0.2) == {1, 3} and kept(epsilon=0.9) == {1}
    assert kept(temperature=100.0, epsilon=0.2) == {0, 1, 2, 3}
    assert kept(epsilon=0.1, top_p=0.6) == {1, 3}


def test_top_p_sampling_draws_only_from_the_nucleus(model_and_search):
    """32 samples of one sentence's first token, all inside the model's 0.5-nucleus (which holds under 0.6 of the
    probability: were top_p ignored, ~40% of them would fall outside)."""
    graphdef, params, _ = model_and_search
    rows = jnp.tile(INPUTS[1:2], (32, 1))
    first_logits = jax.jit(lambda params: nnx.merge(graphdef, params)(INPUTS[1:2], jnp.zeros((1, 1), jnp.int32)))(
        params)[0, 0]
    probs = np.asarray(jax.nn.softmax(first_logits))
    order = np.argsort(-probs)
    nucleus = set(order[:int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1].tolist())
    assert 1 < len(nucleus) < len(probs) - 1 and probs[list(nucleus)].sum() < 0.6
    search = make_search(graphdef, max_extra_length=6, temperature=1.0, top_p=0.5)
    draws = set(np.asarray(search(params, rows))[:, 0].tolist())
    assert draws <= nucleus and len(draws) > 1


@pytest.fixture(scope="module")
def translation(tmp_path_factory):
    tokenizer = decode_setup.vocabulary(tmp_path_factory.mktemp("vocab"))
    graphdef, params = decode_setup.tiny_model()
    return tokenizer, graphdef, params, decode_setup.sentences(tokenizer, 9)


def test_sampling_draws_fresh_noise_each_call_and_reproduces_from_seed_and_call_index(translation):
    tokenizer, graphdef, params, sentences = translation
    def sampler():
        return make_search(graphdef, max_extra_length=decode_setup.MAX_EXTRA_LENGTH, temperature=1.0, seed=7)
    search = sampler()
    first, second = (search_sentences(search, params, tokenizer, sentences, 8).best_ids() for _ in range(2))
    assert search.calls == 2 and len(first[3]) == 0
    assert any(not np.array_equal(a, b) for a, b in zip(first, second))
    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert same(search_sentences(sampler(), params, tokenizer, sentences, 8).best_ids(), first)  # counts from 0
    # A pinned call index, in batches of another size: each sentence's noise is its own.
    again = search_sentences(search, params, tokenizer, sentences, 4, call=1).best_ids()
    assert same(again, second) and search.calls == 2


@pytest.mark.parametrize("beam_size, penalty", [(4, "fairseq"), (1, "gnmt")])  # beam search, scored greedy
def test_nbest_lists_distinct_hypotheses_best_first_scored_by_the_penalty(translation, beam_size, penalty):
    tokenizer, graphdef, params, sentences = translation
    count, alpha = min(3, beam_size), 1.0
    search = make_search(graphdef, max_extra_length=decode_setup.MAX_EXTRA_LENGTH, beam_size=beam_size, alpha=alpha,
                         penalty=penalty, scores=True)
    nbest = search_sentences(search, params, tokenizer, sentences, 8).nbest(count)
    assert nbest[3] == [] and all(len(hypotheses) == count for i, hypotheses in enumerate(nbest) if i != 3)
    found = [(i, h) for i, hypotheses in enumerate(nbest) for h in hypotheses]
    for hypotheses in nbest:
        assert len({tuple(h.ids) for h in hypotheses}) == len(hypotheses)
        assert all(a.score >= b.score for a, b in zip(hypotheses, hypotheses[1:]))
    # Every score is the teacher-forced log P of its hypothesis over the penalty formula.
    inputs = tokenizer.encode([sentences[i] for i, _ in found])
    width, length = max(map(len, inputs)), max(len(h.ids) for _, h in found)
    sources = np.stack([np.pad(x, (0, width - len(x))) for x in inputs])
    outputs = np.stack([np.pad(h.ids, (0, length - len(h.ids))) for _, h in found])
    log_probs = np.asarray(teacher_forced_log_probs(graphdef, params, jnp.asarray(sources), jnp.asarray(outputs)))
    np.testing.assert_allclose([h.log_prob for _, h in found], log_probs, rtol=1e-4, atol=1e-4)
    lengths = [len(h.ids) for _, h in found]
    np.testing.assert_allclose([h.score for _, h in found], log_probs / penalty_formula(lengths, alpha, penalty),
                               rtol=1e-4, atol=1e-4)
    best = search_sentences(search, params, tokenizer, sentences, 8).best_ids()
    assert all(np.array_equal(b, h[0].ids) for b, h in zip(best, nbest) if h)
    lines = nbest_lines(nbest, tokenizer, first_index=10)
    index, text, log_prob, score = lines[0].split(" ||| ")
    assert (index, text) == ("10", tokenizer.decode(nbest[0][0].ids)) and float(score) == pytest.approx(
        nbest[0][0].score, abs=1e-5) and log_prob.startswith("LogProb= ")
    assert f"13 |||  ||| LogProb= 0.000000 ||| 0.000000" in lines  # the empty sentence keeps its index
    assert len(lines) == count * (len(sentences) - 1) + 1


def test_nbest_needs_a_scored_search_keeping_that_many(translation):
    tokenizer, graphdef, params, sentences = translation
    beam = make_search(graphdef, max_extra_length=4, beam_size=2)
    with pytest.raises(ValueError, match="nbest=3 must be between 1 and the 2 hypotheses"):
        search_sentences(beam, params, tokenizer, sentences, 8).nbest(3)
    with pytest.raises(ValueError, match="need a scored Search"):
        search_sentences(make_search(graphdef, max_extra_length=4), params, tokenizer, sentences, 8).nbest(1)


def test_decode_settings_fail_clearly_naming_the_key():
    with pytest.raises(ValueError, match=r"decode.top_p=1.5 must be in \[0, 1\]"):
        DecodeConfig(top_p=1.5)
    with pytest.raises(ValueError, match="decode.length_penalty='wu' must be one of"):
        DecodeConfig(length_penalty="wu")


# ----------------------------------------------------------------------------------------------------
# Bounded decoding: inputs cut to a bound, batches within a token budget


@pytest.mark.parametrize("family", ["encoder_decoder", pytest.param("decoder_only", marks=pytest.mark.slow)])
def test_outputs_end_within_a_learned_position_table(family):
    """With a learned table of 12 positions a 7-token source may not produce 7 + 6 tokens: the decoder has no
    trained row past the table (the embedding clamps to the last). Every search ends each output at the table
    (the encoder-decoder: 12 target positions; decoder_only numbers the target on from its source: 12 - 7),
    with EOS. The model's EOS column is zeroed, so it never ends sooner by itself (the setup, asserted by the
    sinusoidal twin running to input + 6)."""
    shapes = dict(family=family, num_encoder_layers=0) if family == "decoder_only" else {}
    inputs = jnp.array([[4, 5, 6, 7, 8, 9, 1, 0]])
    room = {"encoder_decoder": 12, "decoder_only": 12 - 7}[family]
    for encoding, limit in (("learned", room), ("sinusoidal", 7 + 6)):
        graphdef, params = build(20, 1, positional_encoding=encoding, max_length=12, tie_output_embedding=False,
                                 share_embeddings=True, **shapes)
        params["output_projection"]["kernel"] = params["output_projection"]["kernel"].at[:, EOS_ID].set(0.0)
        greedy = np.asarray(make_search(graphdef, max_extra_length=6)(params, inputs))[0]
        sequences, _ = jitted_beam_search(params, inputs, graphdef=graphdef, beam_size=3, alpha=0.6,
                                          max_extra_length=6)
        sampled = np.asarray(make_search(graphdef, max_extra_length=6, temperature=1.0)(params, inputs))[0]
        for tokens in (greedy, *np.asarray(sequences[0]), sampled):
            assert length_of(tokens) == limit and tokens[limit - 1] == EOS_ID, (encoding, tokens)


def test_the_input_bound_is_the_training_length_capped_by_a_learned_position_table():
    assert DecodeConfig().input_bound(64, None) == 64  # sinusoids: the training data.max_length
    assert DecodeConfig().input_bound(64, 32) == 32  # a learned table of 32 positions holds no more
    assert DecodeConfig(max_input_length=100).input_bound(64, None) == 100
    assert DecodeConfig(max_input_length=100).input_bound(64, 80) == 80
    with pytest.raises(ValueError, match="decode.max_input_length=-1 and decode.max_tokens_per_batch=0 must be >= 0"):
        DecodeConfig(max_input_length=-1, max_tokens_per_batch=0)
    assert DecodeConfig(beam_size=1).search_tag == "greedy-extra50"
    assert DecodeConfig(beam_size=4, alpha=0.6, length_penalty="fairseq", max_extra_length=2).search_tag == \
        "beam4-fairseq0.6-extra2"
    assert DecodeConfig(temperature=1.0, top_p=0.9).search_tag == "sample-t1-k0-p0.9-extra50"


def test_decode_batches_without_a_budget_are_padded_complete_and_length_sorted():
    inputs = [np.arange(1, n + 1, dtype=np.int32) for n in (5, 17, 3, 9, 2)]
    seen = []
    for indices, batch in budget_batches(inputs, rows=2):
        assert batch.shape[0] == 2 and batch.shape[1] in (8, 16, 32)
        for row, index in zip(batch, indices):
            if index >= 0:
                np.testing.assert_array_equal(row[:len(inputs[index])], inputs[index])
                seen.append(index)
            else:
                assert not row.any()
    assert sorted(seen) == list(range(5))
    assert [len(inputs[i]) for i in seen] == sorted(len(x) for x in inputs)  # shortest first


@pytest.mark.parametrize("ways", [1, 2, 4])
def test_token_budget_batches_hold_fewer_long_sentences_in_whole_rows_per_device(ways):
    lengths = np.random.default_rng(ways).permutation(np.arange(1, 71))  # buckets of 8, 16, 32, 64 and 128
    inputs = [np.full(n, 5, np.int32) for n in lengths]
    batches = list(budget_batches(inputs, rows=8, ways=ways, max_tokens=128))
    seen = np.concatenate([indices[indices >= 0] for indices, _ in batches])
    assert sorted(seen.tolist()) == list(range(70))  # every sentence once
    assert np.all(np.diff(lengths[seen]) >= 0)  # in length order, so the shortest share the small shapes
    rows_of = {}
    for indices, batch in batches:
        rows, length = batch.shape
        assert rows % ways == 0 and ways <= rows <= 8 and (rows * length <= 128 or rows == ways)
        assert rows_of.setdefault(length, rows) == rows  # one row count per bucket length: one shape to compile
        for index, row in zip(indices, batch):
            expected = np.zeros(length, np.int32)
            if index >= 0:
                expected[:lengths[index]] = 5
            np.testing.assert_array_equal(row, expected)
    # 8 rows of the short ones; 128 tokens of 32 per row: 4; of 64: 2 (but one per device); of 128: one per device.
    assert rows_of == {8: 8, 16: 8, 32: 4, 64: max(2, ways), 128: ways}
    assert all(batch.shape[0] == 8 for _, batch in budget_batches(inputs, rows=8, ways=ways))  # no budget


class ProjectLog:
    """The warnings of the project's console logger (which does not propagate to pytest's caplog)."""

    def __init__(self, caplog):
        self.caplog, self.logger = caplog, logging.getLogger("transformer")

    def __enter__(self):
        self.logger.addHandler(self.caplog.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.caplog.handler)

    @property
    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.caplog.records if r.levelno == logging.WARNING]


def recording_search(seen: list):
    """A stand-in for a jitted search: records each batch it gets, answers EOS at once."""
    def search(params, batch):
        seen.append(np.asarray(batch))
        return np.full((len(batch), 2), EOS_ID, np.int32)
    return search


def test_long_inputs_are_cut_to_the_bound_with_one_warning_naming_the_split_and_lines(translation, caplog):
    tokenizer, _, _, sentences = translation
    long = " ".join(sentences[:3])  # longer than the bound below
    lines = [sentences[0], long, sentences[1], long, long, long, long, long, long, sentences[2]]
    bound = max(len(ids) for ids in tokenizer.encode(sentences[:3])) + 1
    assert all(len(ids) > bound for ids in tokenizer.encode([long]))
    seen = []
    with ProjectLog(caplog) as log:
        decoded = search_sentences(recording_search(seen), None, tokenizer, lines, 4, bound, name="valid")
    assert decoded.cut == 7 and decoded.cut_lines == [2, 4, 5, 6, 7, 8, 9]
    assert log.warnings == [f"valid: 7 of 10 source sentence(s) longer than {bound} tokens cut to their first "
                            f"{bound - 1} and EOS (still decoded and scored): line(s) 2, 4, 5, 6, 7 and 2 more"]
    rows = [row[row != 0] for batch in seen for row in batch if row.any()]
    cut = np.append(tokenizer.encode([long])[0][:bound - 1], EOS_ID)
    assert sum(np.array_equal(row, cut) for row in rows) == 7 and all(len(row) <= bound for row in rows)
    assert len(decoded.hypotheses) == 10 and all(decoded.hypotheses)  # every cut sentence is still translated
    caplog.clear()
    with ProjectLog(caplog) as log:  # no bound (None): nothing is cut; no name: the caller warns
        assert search_sentences(recording_search([]), None, tokenizer, lines, 4).cut == 0
        assert search_sentences(recording_search([]), None, tokenizer, lines, 4, bound, name=None).cut == 7
    assert log.warnings == []


def test_a_token_budget_changes_no_output_and_keeps_the_input_order(translation):
    tokenizer, graphdef, params, sentences = translation
    search = make_search(graphdef, max_extra_length=decode_setup.MAX_EXTRA_LENGTH, beam_size=2, alpha=0.6)
    budget = 2 * 16  # the 16-token bucket holds 2 rows, the 8-token one 4: several batch shapes
    whole = search_sentences(search, params, tokenizer, sentences, 8).best_ids()
    budgeted = search_sentences(search, params, tokenizer, sentences, 8, max_tokens_per_batch=budget).best_ids()
    assert all(np.array_equal(a, b) for a, b in zip(budgeted, whole, strict=True)) and len(whole[3]) == 0
    seen = []
    search_sentences(recording_search(seen), params, tokenizer, sentences, 8, max_tokens_per_batch=budget)
    assert {batch.shape for batch in seen} <= {(4, 8), (2, 16)} and (2, 16) in {batch.shape for batch in seen}


def test_first_argmax_is_argmax_ties_and_masked_entries_included():
    from transformer.decode import first_argmax
    logits = jax.random.normal(jax.random.key(0), (6, 1000))
    logits = logits.at[1, [3, 700]].set(9.0).at[2, :].set(NEG_INF).at[3, [0, 999]].set(9.0)  # ties, all masked
    logits = logits.at[4].set(jnp.round(logits[4]))  # many exact ties
    np.testing.assert_array_equal(first_argmax(logits), jnp.argmax(logits, axis=-1))
    assert first_argmax(logits)[1] == 3 and first_argmax(logits)[3] == 0


def test_bfloat16_weights_decode_in_bfloat16_with_float32_caches_close_to_float32(model_and_search):
    """decode.weights=bfloat16: the search's model computes with bfloat16 weights (its logits differ from float32's
    by rounding, not more), its caches stay float32, and greedy search runs on it to valid outputs."""
    from transformer.decode import cast_weights, make_search, weights_graphdef
    graphdef, params, _ = model_and_search
    config = nnx.merge(graphdef, params).config
    cast = cast_weights(params, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
    models = {"float32": nnx.merge(graphdef, params), "bfloat16": nnx.merge(weights_graphdef(config, "bfloat16"), cast)}
    logits = {}
    for name, model in models.items():
        cache = model.init_cache(model.encode(INPUTS), INPUTS, 8, dtype=jnp.float32)
        assert {x.dtype for x in jax.tree.leaves(cache["layers"])} == {jnp.dtype(jnp.float32)}
        logits[name], _ = model.decode_step(jnp.zeros((3, 1), jnp.int32), jnp.int32(0), cache)
    difference = float(jnp.abs(logits["bfloat16"] - logits["float32"]).max())
    assert logits["bfloat16"].dtype == jnp.float32 and 0 < difference < 0.05 * float(jnp.abs(logits["float32"]).max())
    search = make_search(weights_graphdef(config, "bfloat16"), max_extra_length=6, weights="bfloat16")
    outputs = np.asarray(search(params, INPUTS))[:2]
    assert all(EOS_ID in row for row in outputs) and not np.any(outputs[:, 0] == PAD_ID)


def while_loop_batches(function, *args) -> list[int]:
    """The row count (the smallest leading size of its state) of each while loop of `function`'s program, outermost
    first, in program order; loops inside loops are not counted."""
    def loops(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "while":
                yield min(v.aval.shape[0] for v in eqn.invars if v.aval.ndim >= 1)
            else:
                for param in eqn.params.values():
                    if hasattr(param, "jaxpr"):  # a closed jaxpr (jit, custom_jvp)
                        yield from loops(param.jaxpr)
    return list(loops(jax.make_jaxpr(function)(*args).jaxpr))


SHRINK_INPUTS = np.zeros((8, 8), np.int32)  # sources of 7, 2, 5, 0 (padding), 3, 6, 1 and 4 tokens, then EOS
for _row, _length in enumerate([7, 2, 5, 0, 3, 6, 1, 4]):
    SHRINK_INPUTS[_row, :_length] = np.random.default_rng(_row).integers(3, 20, _length)
    SHRINK_INPUTS[_row, _length] = EOS_ID if _length else 0


def assert_shrinking_decodes_the_whole_batch(params, graphdef, shrink, batches, apart, **kw):
    streams = jnp.stack([jnp.zeros(8, jnp.int32), jnp.arange(8, dtype=jnp.int32)], axis=1)
    whole, shrunk = (make_search(graphdef, max_extra_length=6, shrink=n, **kw) for n in (0, shrink))
    (sequences, scores), (shrunk_sequences, shrunk_scores) = (search.run(params, SHRINK_INPUTS, streams)
                                                              for search in (whole, shrunk))
    real = [length_of(np.asarray(row)) for row, source in zip(sequences[:, 0], SHRINK_INPUTS) if source.any()]
    assert len(set(real)) >= apart, real  # the sentences end at different steps
    np.testing.assert_array_equal(shrunk_sequences, sequences)
    np.testing.assert_allclose(shrunk_scores, scores, rtol=1e-5)
    assert while_loop_batches(shrunk.run, params, SHRINK_INPUTS, streams) == batches


def test_a_shrinking_batch_decodes_what_the_whole_batch_does(model_and_search):
    """decode.shrink: the batch halves (8 -> 4 -> 2 -> 1 rows) as its sentences finish at different steps, and
    greedy search's outputs and scores are the whole batch's, each in its own row; so are beam search's (2 beams,
    8 -> 4 rows)."""
    graphdef, params, _ = model_and_search
    assert_shrinking_decodes_the_whole_batch(params, graphdef, 3, [8, 4, 2, 1], 4, scores=True)
    beam_graphdef, beam_params = build(20, 0)  # whose beams end at 7 different steps (seed 3's mostly at the first)
    assert_shrinking_decodes_the_whole_batch(beam_params, beam_graphdef, 1, [8, 4], 4, beam_size=2, alpha=0.6)
    with pytest.raises(ValueError, match="decode.shrink=-1 must be >= 0"):
        DecodeConfig(shrink=-1)


@pytest.mark.slow
def test_a_shrinking_batch_keeps_every_candidate_and_beam_of_a_sentence(model_and_search):
    """Sampling's 3 candidates per sentence leave the batch together, when all three end; beam search's beams and
    finished hypotheses over 8 -> 4 -> 2 -> 1 rows: the whole batch's outputs and scores."""
    graphdef, params, _ = model_and_search
    assert_shrinking_decodes_the_whole_batch(params, graphdef, 3, [8, 4, 2, 1], 4, temperature=1.0, candidates=3,
                                             scores=True)
    beam_graphdef, beam_params = build(20, 0)
    assert_shrinking_decodes_the_whole_batch(beam_params, beam_graphdef, 3, [8, 4, 2, 1], 4, beam_size=3, alpha=0.6)
