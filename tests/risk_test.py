"""Minimum risk training's parts (transformer/risk.py): the device's sentence BLEU is sacreBLEU's, a repeated
candidate counts once, and the risk objective's gradient is its finite difference. The runs (a risk fine-tune's
reward rising, its resume) are in tests/finetune_test.py; its sharded step in tests/multidevice_test.py."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu

from transformer import risk, steps
from transformer.model import ModelConfig
from transformer.plan import init_params, model_graphdef
from transformer.tokenizer import EOS_ID
from flax import nnx


def ids(words, length):
    """Token ids of `words` then EOS, padded with 0 to `length`."""
    row = np.zeros(length, np.int32)
    row[:len(words)], row[len(words)] = words, EOS_ID
    return row


def sacrebleu_scores(candidates, references):
    """sacreBLEU's sentence BLEU / 100 with add-one smoothing, the ids as words (tokenize='none')."""
    logging.getLogger("sacrebleu").setLevel(logging.ERROR)  # it advises effective_order for sentence BLEU
    metric = sacrebleu.BLEU(tokenize="none", smooth_method="add-k", smooth_value=1, effective_order=False)
    def words(row):
        return " ".join(str(token) for token in row if token > EOS_ID)
    return np.array([metric.sentence_score(words(c), [words(r)]).score / 100 for c, r in zip(candidates, references)])


def test_sentence_bleu_on_token_ids_is_sacrebleus_add_one_sentence_bleu():
    rng = np.random.default_rng(0)
    length = 24
    # Few distinct ids, so n-grams repeat and clipping matters; plus the edges: empty, equal, repeated, longer.
    candidates = [ids(rng.integers(3, 8, rng.integers(0, 20)), length) for _ in range(300)]
    references = [ids(rng.integers(3, 8, rng.integers(1, 20)), length) for _ in range(300)]
    edges = [([], [5, 6]), ([5, 6, 7, 8, 9], [5, 6, 7, 8, 9]), ([5, 5, 5, 5, 5, 5], [5, 5, 6]),
             ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7]), ([9, 9], [5, 6, 7, 8])]
    candidates += [ids(c, length) for c, _ in edges]
    references += [ids(r, length) for _, r in edges]
    got = np.asarray(risk.sentence_bleu(jnp.array(candidates), jnp.array(references)))
    np.testing.assert_allclose(got, sacrebleu_scores(candidates, references), atol=1e-6)
    assert got[-4] == pytest.approx(1.0) and got[-5] == 0.0 and got[-1] == 0.0  # equal, empty, no match
    assert len(set(np.round(got, 4))) > 100  # the random pairs are scored apart, not all 0


def test_a_repeated_candidate_counts_once_and_the_weights_are_the_models_renormalised():
    a, b, c = ids([5, 6], 6), ids([7], 6), ids([5, 6, 7], 6)
    candidates = jnp.array([[a, a, b, c]])
    members = risk.distinct(candidates)
    assert members.tolist() == [[True, False, True, True]]
    log_probs, costs = jnp.array([[-1.0, -1.0, -2.0, -3.0]]), jnp.array([[0.2, 0.2, 0.5, 0.9]])
    weights = np.exp([-1.0, -2.0, -3.0]) / np.exp([-1.0, -2.0, -3.0]).sum()
    expected = float(np.dot(weights, [0.2, 0.5, 0.9]))
    assert float(risk.expected_risk(log_probs, costs, members)[0]) == pytest.approx(expected, rel=1e-6)


def test_the_risk_objectives_gradient_is_its_finite_difference():
    """The objective (weight 1: the sequence risk alone, per reference token) of fixed candidates, as the train step
    differentiates it: through each candidate's teacher-forced log-probability and the renormalised weights. Along
    directions in the parameters after the decoder's last ReLU (its feed-forward's output, the last LayerNorm, the
    output projection), where the objective is smooth: upstream, a step of a finite difference flips ReLUs, whose
    kinks float32's rounding does not let a smaller step avoid."""
    config = ModelConfig(vocab_size=40, emb_dim=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                         mlp_dim=32, tie_output_embedding=False)
    params = init_params(config, jax.random.key(0))
    graphdef = model_graphdef(config)
    rng = np.random.default_rng(1)
    length, count = 8, 4
    batch = {"inputs": jnp.array([ids(rng.integers(3, 40, n), length) for n in (3, 5, 6)]),
             "targets": jnp.array([ids(rng.integers(3, 10, n), length) for n in (4, 2, 6)]),
             "candidates": []}
    for reference in batch["targets"]:  # the reference, a part of it and two others: costs that differ
        words = [int(t) for t in reference if t > EOS_ID]
        batch["candidates"].append([ids(words, length), ids(words[:max(len(words) // 2, 1)], length),
                                    ids(rng.integers(3, 10, 3), length), ids(rng.integers(3, 10, 5), length)])
    batch["candidates"] = jnp.array(batch["candidates"])
    objective = risk.Objective(weight=1.0, candidates=count)

    def f(params):
        return steps.step_metrics(nnx.merge(graphdef, params), batch, 0.1, deterministic=True, rngs=None,
                                  objective=objective)[0]
    gradient = jax.jit(jax.grad(f))(params)
    f = jax.jit(f)
    paths, tree = jax.tree_util.tree_flatten_with_path(params)
    smooth = ("['feed_forward']['output']", "['feed_forward_residual']", "['output_projection']")
    for seed in range(3):
        keys = jax.random.split(jax.random.key(seed), len(paths))
        direction = jax.tree.unflatten(tree, [
            jax.random.normal(k, x.shape) * any(name in jax.tree_util.keystr(path) for name in smooth)
            if "decoder" in jax.tree_util.keystr(path) or "output_projection" in jax.tree_util.keystr(path)
            else jnp.zeros(x.shape) for k, (path, x) in zip(keys, paths)])
        epsilon = 1e-3  # the curvature's error falls below 1e-3 of the slope here, float32's rounding stays below
        shifted = [jax.tree.map(lambda p, d, s=s: p + s * epsilon * d, params, direction) for s in (1, -1)]
        numeric = (float(f(shifted[0])) - float(f(shifted[1]))) / (2 * epsilon)
        analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(gradient), jax.tree.leaves(direction)))
        assert abs(numeric) > 0.05  # a slope the comparison can see
        assert analytic == pytest.approx(numeric, rel=2e-3), seed


