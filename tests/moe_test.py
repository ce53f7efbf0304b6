"""The mixture-of-experts feed-forward (model.num_experts): routing against hand computation, capacity, the
router losses against values worked out by hand, one expert equal to the dense feed-forward, and a model with
experts that trains, evaluates and decodes like the dense one and reports the mean of its expert layers' stats;
descent on the balance loss spreads a lopsided router's load. Sharded experts: multidevice_test.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import default
from tiny import decode_incrementally
from transformer import throughput
from transformer.model import ROUTER_STATS, ModelConfig, build
from transformer.model.blocks import Inputs
from transformer.model.experts import MoEFeedForward, expert_capacity, route
from transformer.model.feed_forward import FeedForward
from transformer.steps import step_metrics
from transformer.settings import Settings


MOE = ModelConfig(vocab_size=40, emb_dim=16, num_heads=2, num_encoder_layers=2, num_decoder_layers=2, mlp_dim=32,
                  num_experts=4, experts_per_token=2, expert_every=2)
INPUTS = jnp.array([[5, 6, 7, 8, 9, 10, 11, 1, 0], [9, 10, 1, 0, 0, 0, 0, 0, 0]])
DECODER_INPUTS = jnp.array([[0, 11, 12, 13, 14, 15, 16, 17, 1], [0, 15, 16, 1, 0, 0, 0, 0, 0]])


@functools.partial(jax.jit, static_argnums=(2, 3))  # one compile per shape: op by op, each call took seconds
def router_stats(logits, real, k, capacity):
    return route(logits, real, k, capacity)[2]


def stats_of(logits, real, k, capacity):
    return dict(zip(ROUTER_STATS, np.asarray(router_stats(jnp.asarray(logits, jnp.float32), jnp.asarray(real), k,
                                                          capacity))))


LN2, LN3 = np.log(2.0), np.log(3.0)
# Router logits of 4 real tokens whose probabilities are simple fractions, and what route() must report of them,
# worked out by hand: the balance loss E * sum_e f_e P_e (f_e: expert e's share of the top-k assignments, P_e: its
# mean probability), the busiest load E * max_e f_e and the z-loss, the mean of logsumexp(logits)^2.
HAND_CASES = {
    # softmax(ln 3, 0) = (3/4, 1/4): three tokens choose expert 0, one expert 1; f = (3/4, 1/4), P = (5/8, 3/8):
    # 2 (3/4 x 5/8 + 1/4 x 3/8) = 9/8; every logsumexp is ln 4.
    "k1-three-of-four-to-one": (1, [[LN3, 0.0], [LN3, 0.0], [0.0, LN3], [LN3, 0.0]], 9 / 8, 3 / 2,
                                np.log(4.0) ** 2),
    # All four to expert 0: f = (1, 0), P = (3/4, 1/4): 2 x 3/4. The logits shifted by 2 keep the probabilities
    # and add 2 to every logsumexp.
    "k1-all-to-one": (1, [[LN3 + 2, 2.0]] * 4, 3 / 2, 2.0, (np.log(4.0) + 2) ** 2),
    # softmax(ln 3, ln 2, 0) = (1/2, 1/3, 1/6): every token's top 2 are experts 0 and 1; f = (1/2, 1/2, 0),
    # P = (1/2, 1/3, 1/6): 3 (1/4 + 1/6) = 5/4; load 3 x 1/2; logsumexp ln 6.
    "k2-all-to-two-of-three": (2, [[LN3, LN2, 0.0]] * 4, 5 / 4, 3 / 2, np.log(6.0) ** 2),
}


@pytest.mark.parametrize("case", HAND_CASES)
def test_the_router_losses_equal_their_values_by_hand(case):
    """A fifth token, padding, whose logits would change every value, is left out of them all."""
    k, logits, balance, load_max, z = HAND_CASES[case]
    padding = [9.0] + [-9.0] * (len(logits[0]) - 1)
    stats = stats_of(np.array([logits + [padding]]), np.array([[True] * 4 + [False]]), k, capacity=8)
    np.testing.assert_allclose(stats["router_balance"], balance, rtol=1e-6)
    np.testing.assert_allclose(stats["expert_load_max"], load_max, rtol=1e-6)
    np.testing.assert_allclose(stats["router_z"], z, rtol=1e-6)
    assert stats["expert_dropped"] == 0.0


@pytest.mark.parametrize("k", [1, 2])
def test_uniform_routing_has_a_balance_loss_of_one_for_any_k(k):
    """Every token spread evenly over the experts (cyclic logits): f_e = P_e = 1/E, so the loss is 1, not k."""
    logits = np.tile(np.eye(4) * 5.0, (1, 2, 1))  # 8 tokens, each expert first for two of them
    if k == 2:  # and second for two others
        logits = logits + np.roll(np.tile(np.eye(4) * 2.0, (1, 2, 1)), 1, axis=-1)
    stats = stats_of(logits, np.ones((1, 8), bool), k, capacity=8)
    np.testing.assert_allclose(stats["router_balance"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(stats["expert_load_max"], 1.0, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_no_expert_takes_more_than_its_capacity_and_first_choices_come_first(k):
    logits = jax.random.normal(jax.random.key(0), (3, 40, 4)) + jnp.array([3.0, 0.0, 0.0, 0.0])  # expert 0 popular
    real = jnp.ones((3, 40), bool).at[2, 30:].set(False)
    capacity = expert_capacity(40, dataclasses.replace(MOE, experts_per_token=k), 1.0)
    assert capacity == 10 * k
    dispatch, combine, stats = route(logits, real, k, capacity)
    dispatch = np.asarray(dispatch)
    assert dispatch.sum(axis=(1, 3)).max() <= capacity  # assignments per expert and row
    assert dispatch.sum(axis=1).max() <= 1  # one token per slot
    assert dispatch[2, 30:].sum() == 0  # padding takes no slot
    chosen = np.asarray(jax.lax.top_k(logits, k)[1])
    wanted = (np.arange(4) == chosen[..., None]).any(-2) & np.asarray(real)[..., None]  # [b, length, experts]
    kept = dispatch.sum(-1) > 0
    assert not (kept & ~wanted).any()  # only a token's own choices
    np.testing.assert_allclose(stats[2], 1 - kept.sum() / wanted.sum(), rtol=1e-6)  # expert_dropped
    assert stats[2] > 0.2  # expert 0 overflows
    if k == 2:  # an expert's slots go to first choices before any second choice
        first = (chosen[..., 0, None] == np.arange(4)) & wanted
        second = (chosen[..., 1, None] == np.arange(4)) & wanted
        first_dropped, second_kept = (first & ~kept).any(axis=1), (second & kept).any(axis=1)  # [b, experts]
        assert first_dropped.any() and not (first_dropped & second_kept).any()
    gates = np.asarray(combine).sum(axis=(-2, -1))[kept.sum(-1) == k]  # tokens with every choice kept
    probs = np.asarray(jax.nn.softmax(logits))[kept.sum(-1) == k]
    np.testing.assert_allclose(gates, 1.0 if k == 2 else probs.max(-1), rtol=1e-5)  # GShard's renormalised, Switch's


def test_descending_on_the_balance_loss_moves_the_load_toward_balance():
    """A router that sends most tokens to expert 0 (a feature all tokens share, weighted toward it), trained 50
    Adam steps on a regression to noise through the layer plus weight x the balance loss: at weight 1 the load
    spreads (the loss's gradient reaches the router through the mean probabilities P_e), at weight 0 it stays on
    expert 0.
    Measured (top-1, 4 experts): before, balance 3.00 and busiest load 3.50 of 4; after, at weight 0, 3.39 and
    3.69; at weight 1, 1.22 and 1.81."""
    config = dataclasses.replace(MOE, experts_per_token=1, eval_capacity_factor=0.0)  # no token dropped
    layer = MoEFeedForward(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 16, MOE.emb_dim)).at[..., 0].set(2.0)
    layer.router[...] = layer.router[...].at[0, 0].add(3.0)
    target = jax.random.normal(jax.random.key(2), x.shape)
    graphdef, params = nnx.split(layer)
    optimizer = optax.adam(0.03)

    def objective(params, weight):
        y, stats = nnx.merge(graphdef, params)(x, Inputs(real=jnp.ones(x.shape[:2], bool)), deterministic=True,
                                               rngs=None)
        stats = stats["router"]
        return jnp.mean((y - target) ** 2) + weight * stats[ROUTER_STATS.index("router_balance")], stats

    @jax.jit  # one compile for both weights, the loop inside
    def train(weight):
        def step(_, carry):
            params, opt_state = carry
            updates, opt_state = optimizer.update(jax.grad(objective, has_aux=True)(params, weight)[0], opt_state)
            return optax.apply_updates(params, updates), opt_state
        trained, _ = jax.lax.fori_loop(0, 50, step, (params, optimizer.init(params)))
        return objective(params, weight)[1], objective(trained, weight)[1]

    def named(stats):
        return dict(zip(ROUTER_STATS, np.asarray(stats)))
    before, unweighted = map(named, train(0.0))
    weighted = named(train(1.0)[1])
    assert before["expert_load_max"] >= 3.4 and before["router_balance"] > 2.5  # the setup: expert 0 takes most
    assert weighted["router_balance"] < 1.5 and weighted["expert_load_max"] < 2.5
    assert unweighted["router_balance"] > 3.0 and unweighted["expert_load_max"] >= before["expert_load_max"]


def test_one_expert_with_room_for_every_token_equals_the_dense_feed_forward():
    config = dataclasses.replace(MOE, num_experts=1, experts_per_token=1, capacity_factor=1.0)
    moe, dense = MoEFeedForward(config, rngs=nnx.Rngs(0)), FeedForward(config, rngs=nnx.Rngs(1))
    dense.hidden.kernel[...] = moe.hidden[...][0]
    dense.hidden.bias[...] = moe.hidden_bias[...][0]
    dense.output.kernel[...] = moe.output[...][0]
    dense.output.bias[...] = moe.output_bias[...][0]
    x = jax.random.normal(jax.random.key(2), (3, 7, 16))
    real = jnp.ones((3, 7), bool).at[1, 5:].set(False)
    y, stats = moe(x, Inputs(real=real), deterministic=True, rngs=None)
    expected, _ = dense(x, Inputs(), deterministic=True, rngs=None)
    np.testing.assert_allclose(np.asarray(y)[np.asarray(real)], np.asarray(expected)[np.asarray(real)], atol=1e-5)
    assert np.abs(np.asarray(y)[~np.asarray(real)]).max() == 0  # padding is never routed
    # one expert takes everything: balanced by definition
    np.testing.assert_allclose(stats["router"][0], 1.0, rtol=1e-6)


@pytest.fixture(scope="module")
def moe_model():
    return build(dataclasses.replace(MOE, eval_capacity_factor=0.0), rngs=nnx.Rngs(0))


def test_expert_layers_are_every_other_and_the_model_reports_their_mean(moe_model, monkeypatch):
    assert [type(layer.feed_forward).__name__ for layer in moe_model.encoder_layers] == ["FeedForward",
                                                                                         "MoEFeedForward"]
    layer_stats = []  # each expert layer's own stats, as it returns them, in the same trace
    call = MoEFeedForward.__call__

    def recorded(self, *args, **kwargs):
        y, stats = call(self, *args, **kwargs)
        layer_stats.append(stats["router"])
        return y, stats
    monkeypatch.setattr(MoEFeedForward, "__call__", recorded)
    logits, router, layers = nnx.jit(lambda m: (*m(INPUTS, DECODER_INPUTS, with_router_stats=True), layer_stats))(
        moe_model)
    assert set(router) == set(ROUTER_STATS) and logits.shape == (2, 9, 40)
    assert len(layers) == 2  # the encoder's second layer and the decoder's
    np.testing.assert_allclose([router[name] for name in ROUTER_STATS], np.mean(layers, axis=0), rtol=1e-6)
    assert np.abs(np.asarray(layers[0]) - np.asarray(layers[1])).max() > 1e-3  # two layers, two routings
    dense = build(dataclasses.replace(MOE, num_experts=0), rngs=nnx.Rngs(0))
    assert dense(INPUTS, DECODER_INPUTS, with_router_stats=True)[1] == {}


def test_the_objective_adds_the_weighted_router_losses(moe_model):
    batch = {"inputs": INPUTS, "targets": DECODER_INPUTS[:, 1:]}
    # one jitted pass: op by op, the forward and backward passes take ~50 s on 2 cores
    objective_and_grads = nnx.jit(nnx.value_and_grad(
        lambda m: step_metrics(m, batch, 0.1, deterministic=True, rngs=None), has_aux=True))
    (objective, metrics), grads = objective_and_grads(moe_model)
    tokens = metrics["denominator"]
    expected = metrics["loss"] + MOE.router_balance_weight * metrics["router_balance"] + \
        MOE.router_z_weight * metrics["router_z"]  # the router metrics are sums over the tokens, like the loss
    np.testing.assert_allclose(objective, expected, rtol=1e-6)
    router = grads.encoder_layers[1].feed_forward.router[...]
    assert float(jnp.abs(router).max()) > 0 and tokens > 0


def test_cached_decoding_with_experts_equals_the_teacher_forced_pass(moe_model):
    """Decoding routes a step's tokens without capacity, as the teacher-forced pass does at
    eval_capacity_factor=0: the outputs agree."""
    together = nnx.jit(decode_incrementally)(moe_model, INPUTS, DECODER_INPUTS[:, None])[:, 0]
    real = np.asarray((DECODER_INPUTS != 0) | (jnp.arange(9) == 0))  # the teacher-forced pass routes no padding
    np.testing.assert_allclose(np.asarray(together)[real], np.asarray(moe_model(INPUTS, DECODER_INPUTS))[real],
                               atol=1e-4)


def test_flops_count_only_the_active_experts():
    """Top-1 over any number of experts costs a dense layer plus the router: the experts a token skips are
    not counted."""
    counts = dict(source_tokens=100.0, target_tokens=80.0, encoder_pairs=1000.0, decoder_pairs=800.0,
                  cross_pairs=900.0)
    dense = throughput.model_flops(dataclasses.replace(MOE, num_experts=0), **counts)
    for experts in (2, 8):
        top1 = throughput.model_flops(dataclasses.replace(MOE, num_experts=experts, experts_per_token=1), **counts)
        router = 6 * MOE.emb_dim * experts * (100.0 + 80.0)  # one expert layer per stack (expert_every=2)
        np.testing.assert_allclose(top1 - dense, router)
    top2 = throughput.model_flops(dataclasses.replace(MOE, num_experts=8, experts_per_token=2), **counts)
    np.testing.assert_allclose(top2 - top1, 6 * 2 * MOE.emb_dim * MOE.mlp_dim * 180.0)


def test_bad_expert_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"experts_per_token=3 must be in \[1, num_experts=2\]"):
        dataclasses.replace(MOE, num_experts=2, experts_per_token=3)
    with pytest.raises(ValueError, match="scan_layers=True stacks identical layers, and expert_every=2"):
        dataclasses.replace(MOE, scan_layers=True)
    config = default.get_config()
    config.model.num_experts, config.model.capacity_factor = 4, 0.0
    with pytest.raises(ValueError, match="capacity_factor=0.0 must be > 0"):
        Settings.from_config(config)
