import numpy as np
import pytest

from transformer.optim import OptimizerConfig, make_optimizer, rsqrt_schedule


def test_schedule_matches_the_paper_formula_at_known_steps():
    schedule = rsqrt_schedule(1.0, 512, 4000)
    # optax counts updates from 0; the paper's step_num is count + 1.
    np.testing.assert_allclose(schedule(0), 512**-0.5 * 4000**-1.5, rtol=1e-6)
    np.testing.assert_allclose(schedule(3999), 512**-0.5 * 4000**-0.5, rtol=1e-6)  # the peak, ~7.0e-4
    np.testing.assert_allclose(schedule(3999), 6.9877e-4, rtol=1e-4)
    np.testing.assert_allclose(schedule(15999), 512**-0.5 * 16000**-0.5, rtol=1e-6)  # halved at 4x warmup
    np.testing.assert_allclose(rsqrt_schedule(2.0, 256, 400)(99), 2.0 * 256**-0.5 * 100 * 400**-1.5, rtol=1e-6)


def test_adam_uses_the_papers_betas_and_epsilon():
    optimizer, _ = make_optimizer(OptimizerConfig(), emb_dim=512)
    state = optimizer.init({"w": np.zeros(3, np.float32)})
    _, state = optimizer.update({"w": np.ones(3, np.float32)}, state)
    adam_state = state[0]
    np.testing.assert_allclose(adam_state.mu["w"], 0.1)  # (1 - b1) * g with b1 = 0.9
    np.testing.assert_allclose(adam_state.nu["w"], 0.02, rtol=1e-6)  # (1 - b2) * g^2 with b2 = 0.98


def test_gradient_clipping_bounds_the_update():
    optimizer, _ = make_optimizer(OptimizerConfig(grad_clip_norm=1.0, warmup_steps=1), emb_dim=1)
    grads = {"w": np.full(4, 100.0, np.float32)}
    clipped_state = optimizer.init(grads)[0]
    assert clipped_state == ()  # clip_by_global_norm holds no state; it comes first in the chain


@pytest.mark.parametrize("bad", [dict(warmup_steps=0), dict(learning_rate_scale=-1.0)])
def test_bad_optimizer_settings_fail(bad):
    with pytest.raises(ValueError, match=list(bad)[0]):
        OptimizerConfig(**bad)
