import jax
import numpy as np
import optax
import pytest

from transformer import optim
from transformer.optim import OptimizerConfig, make_optimizer, rsqrt_schedule


def test_the_schedule_warms_up_linearly_then_decays_as_the_inverse_square_root():
    """Section 5.3's shape: linear growth over warmup_steps, the peak at the last warmup step, then step^-0.5
    (so 4x the warmup halves it); d_model^-0.5 and learning_rate_scale multiply the whole curve."""
    schedule = rsqrt_schedule(1.0, 512, 4000)
    counts = np.arange(0, 40_000, 7)
    rates = np.asarray(jax.vmap(schedule)(counts))
    # optax counts updates from 0; the paper's step_num (from 1) is count + 1, so the first update is not 0.
    np.testing.assert_allclose(rates[counts < 4000], (counts[counts < 4000] + 1) * float(schedule(0)), rtol=1e-5)
    assert float(schedule(0)) > 0 and float(schedule(3999)) >= rates.max() * (1 - 1e-6)
    after = counts >= 3999
    np.testing.assert_allclose(rates[after] * np.sqrt(counts[after] + 1), float(schedule(3999)) * 4000**0.5, rtol=1e-5)
    np.testing.assert_allclose(schedule(15999), schedule(3999) / 2, rtol=1e-6)
    # The peak, the paper's lrate at step_num = warmup_steps, is (d_model x warmup_steps)^-0.5: about 7e-4 here.
    np.testing.assert_allclose(schedule(3999), (512 * 4000) ** -0.5, rtol=1e-6)
    np.testing.assert_allclose(rsqrt_schedule(1.0, 2048, 4000)(123), schedule(123) / 2, rtol=1e-6)
    np.testing.assert_allclose(rsqrt_schedule(3.0, 512, 4000)(5000), 3 * schedule(5000), rtol=1e-6)


def test_constant_decay_holds_the_warmup_peak():
    rsqrt, constant = rsqrt_schedule(1.0, 256, 100), rsqrt_schedule(1.0, 256, 100, "constant")
    for count in (0, 49, 99):
        np.testing.assert_allclose(constant(count), rsqrt(count), rtol=1e-6)  # the same warmup and peak
    for count in (100, 9999):
        np.testing.assert_allclose(constant(count), rsqrt(99), rtol=1e-6)  # held there
    assert rsqrt(9999) < 0.11 * constant(9999)


def adam_moments(state):
    return next(s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                if isinstance(s, optax.ScaleByAdamState))


def test_adam_takes_its_betas_and_epsilon_from_the_config():
    """Values other than the paper's (0.9, 0.98, 1e-9), the defaults, reach Adam: none is fixed in make_optimizer."""
    config = OptimizerConfig(adam_b1=0.8, adam_b2=0.9, adam_eps=1e-6)
    optimizer, schedule = make_optimizer(config, emb_dim=512)
    state = optimizer.init({"w": np.zeros(3, np.float32)})
    _, state = optimizer.update({"w": np.full(3, 2.0, np.float32)}, state)
    np.testing.assert_allclose(adam_moments(state).mu["w"], (1 - 0.8) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(adam_moments(state).nu["w"], (1 - 0.9) * 4.0, rtol=1e-6)
    # The first update is -lr g / (|g| + eps) after bias correction: at |g| = eps it is half the learning rate.
    lr = float(schedule(0))
    assert lr > 0
    updates, _ = optimizer.update({"w": np.full(3, 1e-6, np.float32)}, optimizer.init({"w": np.zeros(3, np.float32)}))
    np.testing.assert_allclose(updates["w"], -lr / 2, rtol=1e-4)  # (about -lr with the paper's 1e-9)


def test_gradient_clipping_bounds_the_update():
    optimizer, _ = make_optimizer(OptimizerConfig(grad_clip_norm=1.0, warmup_steps=1), emb_dim=1)
    zeros = {"w": np.zeros(4, np.float32)}
    # Norm 200 is clipped to norm 1 (0.5 per entry) before Adam sees it; norm 0.2 passes as it is.
    _, state = optimizer.update({"w": np.full(4, 100.0, np.float32)}, optimizer.init(zeros))
    np.testing.assert_allclose(adam_moments(state).mu["w"], 0.1 * 0.5, rtol=1e-6)
    _, state = optimizer.update({"w": np.full(4, 0.1, np.float32)}, optimizer.init(zeros))
    np.testing.assert_allclose(adam_moments(state).mu["w"], 0.1 * 0.1, rtol=1e-6)
    unclipped, _ = make_optimizer(OptimizerConfig(warmup_steps=1), emb_dim=1)
    _, state = unclipped.update({"w": np.full(4, 100.0, np.float32)}, unclipped.init(zeros))
    np.testing.assert_allclose(adam_moments(state).mu["w"], 0.1 * 100.0, rtol=1e-6)


@pytest.mark.parametrize("bad", [dict(warmup_steps=0), dict(learning_rate_scale=-1.0), dict(decay="cosine")])
def test_bad_optimizer_settings_fail(bad):
    with pytest.raises(ValueError, match=list(bad)[0]):
        OptimizerConfig(**bad)


def test_the_cooldown_decays_the_learning_rate_linearly_to_zero_from_where_it_was_set():
    config = OptimizerConfig(learning_rate_scale=1.0, warmup_steps=2, cooldown_fraction=0.5)
    optimizer, schedule = make_optimizer(config, emb_dim=4)
    params = {"w": np.zeros(2, np.float32)}
    state = optimizer.init(params)
    assert optim.cooldown_steps(state) is None  # not begun: the paper's schedule
    np.testing.assert_allclose(optim.learning_rate(schedule, 0, state), schedule(0))
    state = optim.begin_cooldown(state, start=3, end=5)  # steps 3, 4, 5 get 3/3, 2/3, 1/3 of the schedule
    assert optim.cooldown_steps(state) == (3, 5)
    plain, _ = make_optimizer(OptimizerConfig(learning_rate_scale=1.0, warmup_steps=2), emb_dim=4)
    plain_state = plain.init(params)
    grads = {"w": np.array([1.0, -2.0], np.float32)}
    for count, factor in enumerate([1, 1, 1, 2 / 3, 1 / 3, 0, 0]):  # count = updates applied = step - 1
        np.testing.assert_allclose(optim.learning_rate(schedule, count, state), factor * schedule(count), rtol=1e-6)
        updates, state = optimizer.update(grads, state, params)
        reference, plain_state = plain.update(grads, plain_state, params)
        np.testing.assert_allclose(updates["w"], factor * reference["w"], rtol=1e-6)


def test_a_cooldown_needs_the_optimizer_to_have_one():
    optimizer, _ = make_optimizer(OptimizerConfig(), emb_dim=4)
    with pytest.raises(ValueError, match="cooldown_fraction"):
        optim.begin_cooldown(optimizer.init({"w": np.zeros(2, np.float32)}), 1, 2)
    with pytest.raises(ValueError, match="cooldown_fraction"):
        OptimizerConfig(cooldown_fraction=1.0)
