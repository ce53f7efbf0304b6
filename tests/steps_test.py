import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.model import ModelConfig
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.plan import create_train_state, model_graphdef
from transformer.settings import TrainConfig
from transformer.steps import (COUNTER_HASH, dropout_rngs, eval_step, label_smoothed_cross_entropy, shift_right,
                               summarize, token_metrics, train_step)



def test_label_smoothed_loss_matches_a_hand_computation():
    logits = np.array([[2.0, 0.5, -1.0, 0.0]], np.float32)
    eps, vocab = 0.1, 4
    log_probs = logits[0] - np.log(np.sum(np.exp(logits[0])))
    soft = np.full(vocab, eps / (vocab - 1))
    soft[1] = 1 - eps
    expected = -np.sum(soft * log_probs) + np.sum(soft * np.log(soft))  # KL(soft || model)
    np.testing.assert_allclose(label_smoothed_cross_entropy(jnp.asarray(logits), jnp.array([1]), eps)[0], expected,
                               rtol=1e-5)
    # Without smoothing it is the plain negative log-likelihood.
    np.testing.assert_allclose(label_smoothed_cross_entropy(jnp.asarray(logits), jnp.array([1]), 0.0)[0],
                               -log_probs[1], rtol=1e-5)


def test_token_metrics_count_argmax_hits_and_skip_padding():
    logits = jax.random.normal(jax.random.key(0), (3, 5, 11))
    targets = jax.random.randint(jax.random.key(1), (3, 5), 1, 11).at[:, 0].set(jnp.argmax(logits[:, 0], -1))
    targets = targets.at[2, 3:].set(0)  # padding
    metrics = token_metrics(logits, {"inputs": targets, "targets": targets}, 0.1)
    weights = np.asarray(targets != 0)
    assert metrics["correct"] == np.sum((np.argmax(logits, -1) == targets) * weights) >= 3
    log_probs = jax.nn.log_softmax(logits)
    nll = -np.take_along_axis(np.asarray(log_probs), np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(metrics["nll"], np.sum(nll * weights), rtol=1e-5)
    assert metrics["denominator"] == weights.sum() == 13


def test_shift_right_starts_every_packed_segment_with_zero():
    targets = jnp.array([[4, 5, 1, 7, 1, 0]])
    segmentation = jnp.array([[1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(shift_right(targets), [[0, 4, 5, 1, 7, 1]])
    np.testing.assert_array_equal(shift_right(targets, segmentation), [[0, 4, 5, 0, 7, 0]])


def test_summarize_divides_sums_by_the_token_count():
    steps = [{"loss": 6.0, "nll": 4.0, "correct": 2.0, "denominator": 4.0, "source_tokens": 5.0, "learning_rate": 1.0},
             {"loss": 2.0, "nll": 0.0, "correct": 4.0, "denominator": 4.0, "source_tokens": 3.0, "learning_rate": 3.0}]
    summary = summarize(steps)
    assert summary["loss"] == 1.0 and summary["accuracy"] == 0.75 and summary["learning_rate"] == 2.0
    np.testing.assert_allclose(summary["perplexity"], np.exp(0.5))
    assert summary["target_tokens"] == 8.0 and summary["source_tokens"] == 8.0


@pytest.fixture(scope="module")
def compiled():
    model_config = ModelConfig(vocab_size=30, emb_dim=32, num_heads=4, num_encoder_layers=1, num_decoder_layers=1,
                               mlp_dim=64, dropout_rate=0.1)
    optimizer, schedule = make_optimizer(OptimizerConfig(learning_rate_scale=1.0, warmup_steps=10), 32)
    graphdef = model_graphdef(model_config)
    train = jax.jit(functools.partial(train_step, graphdef=graphdef, optimizer=optimizer, schedule=schedule,
                                      label_smoothing=0.1))
    evaluate = jax.jit(functools.partial(eval_step, graphdef=graphdef, label_smoothing=0.1))
    return model_config, optimizer, train, evaluate


BATCH = {"inputs": jnp.array([[5, 6, 7, 8, 1, 0], [9, 10, 11, 1, 0, 0]]),
         "targets": jnp.array([[12, 13, 14, 1, 0, 0], [15, 16, 17, 18, 19, 1]])}


def test_a_few_steps_on_a_fixed_batch_lower_the_loss(compiled):
    model_config, optimizer, train, evaluate = compiled
    state = create_train_state(model_config, optimizer, seed=0)
    before = evaluate(state.params, BATCH)
    for _ in range(30):
        state, metrics = train(state, BATCH)
    after = evaluate(state.params, BATCH)
    assert int(state.step) == 30
    assert float(before["denominator"]) == 10.0  # non-padding target tokens
    assert float(after["loss"]) < 0.5 * float(before["loss"])
    assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["learning_rate"]) > 0


def test_each_step_number_draws_its_own_dropout_masks(compiled):
    """The dropout key is fold_in(state.rng, state.step): the same state gives the same update (a pure step);
    the same parameters at the next step number see other masks, hence another loss before the update."""
    model_config, optimizer, train, _ = compiled
    state = create_train_state(model_config, optimizer, seed=3)
    first, metrics = train(state, BATCH)
    again, metrics_again = train(state, BATCH)
    assert float(metrics["loss"]) == float(metrics_again["loss"])
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(a, b)
    _, next_metrics = train(state.replace(step=state.step + 1), BATCH)
    assert abs(float(next_metrics["loss"]) - float(metrics["loss"])) > 1e-4 * float(metrics["loss"])


def test_train_and_eval_steps_make_no_implicit_host_transfers(compiled):
    model_config, optimizer, train, evaluate = compiled
    state = create_train_state(model_config, optimizer, seed=0)
    batch = jax.device_put(BATCH)
    train(state, batch), evaluate(state.params, batch)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        state, metrics = train(state, batch)
        evaluate(state.params, batch)
    assert jax.device_get(metrics)["denominator"] == 10.0


def test_counter_hash_dropout_bits_are_uniform_independent_and_deterministic():
    key = jax.random.fold_in(jax.random.PRNGKey(7), 3)
    draw = jax.jit(lambda key: dropout_rngs(key, "counter_hash").dropout())
    bits = np.asarray(jax.random.bits(draw(key), (1 << 20,), jnp.uint32))
    np.testing.assert_array_equal(bits, jax.random.bits(draw(key), (1 << 20,), jnp.uint32))  # same key, same bits
    assert len(np.unique(bits)) == bits.size  # one key maps distinct positions to distinct words
    # Every bit position is a fair coin (binomial std 0.0005 over 2^20 draws): catches a weak or missing mix.
    per_bit = np.unpackbits(bits.view(np.uint8)).reshape(-1, 32).mean(axis=0)
    np.testing.assert_array_less(np.abs(per_bit - 0.5), 0.003)
    uniform = bits / 2.0**32
    for lag in (1, 2, 256, 1024):  # neighbours along a row and down a [*, 256] / [*, 1024] activation
        assert abs(np.corrcoef(uniform[:-lag], uniform[lag:])[0, 1]) < 0.005, lag
    other = np.asarray(jax.random.bits(draw(jax.random.fold_in(jax.random.PRNGKey(7), 4)), (1 << 20,), jnp.uint32))
    assert abs(np.corrcoef(uniform, other / 2.0**32)[0, 1]) < 0.005  # the next step's key: independent bits
    raw = jax.random.key_data(draw(key))
    for word in (0, 1):  # keys one word apart (the hash's inputs) still give unrelated bits
        near = jax.random.wrap_key_data(raw.at[word].add(1), impl=COUNTER_HASH)
        near_bits = np.asarray(jax.random.bits(near, (1 << 20,), jnp.uint32)) / 2.0**32
        assert abs(np.corrcoef(uniform, near_bits)[0, 1]) < 0.005, word
    # Any shape draws the words of its row-major indices (so rows differ), and narrower bits are their low bits.
    grid = np.asarray(jax.random.bits(draw(key), (1024, 1024), jnp.uint32))
    np.testing.assert_array_equal(grid.ravel(), bits)
    np.testing.assert_array_equal(jax.random.bits(draw(key), (8, 128), jnp.uint16), (grid[0] & 0xFFFF).reshape(8, 128))
    np.testing.assert_array_equal(jax.random.bits(draw(key), (1024,), jnp.uint8), grid[0] & 0xFF)


def test_counter_hash_dropout_keeps_the_rate_and_differs_per_call():
    rngs = dropout_rngs(jax.random.PRNGKey(0), "counter_hash")
    dropout = nnx.Dropout(0.1)
    ones = jnp.ones((2048, 256))
    first, second = (np.asarray(dropout(ones, deterministic=False, rngs=rngs)) for _ in range(2))
    dropped, dropped_again = first == 0, second == 0
    assert abs(dropped.mean() - 0.1) < 0.002  # std 0.0004 over 524k draws
    np.testing.assert_allclose(first[~dropped], 1 / 0.9, rtol=1e-6)  # inverted dropout keeps the mean
    assert abs((dropped & dropped_again).mean() - 0.01) < 0.001  # two calls draw independent masks
    with pytest.raises(ValueError, match="train.dropout_rng='philox' is not one of"):
        TrainConfig(dropout_rng="philox")
