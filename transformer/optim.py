"""The paper's optimiser (section 5.3): Adam(0.9, 0.98, 1e-9) with warmup then inverse-square-root decay."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate_scale: float = 1.0  # multiplies the paper's d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    warmup_steps: int = 4000
    adam_b1: float = 0.9
    adam_b2: float = 0.98
    adam_eps: float = 1e-9
    grad_clip_norm: float = 0.0  # clip by global norm when > 0 (the paper does not clip)

    def __post_init__(self):
        if self.warmup_steps <= 0:
            raise ValueError(f"warmup_steps must be positive, got {self.warmup_steps}")
        if self.learning_rate_scale <= 0:
            raise ValueError(f"learning_rate_scale must be positive, got {self.learning_rate_scale}")


def rsqrt_schedule(scale: float, emb_dim: int, warmup_steps: int) -> optax.Schedule:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), with step_num counted from 1.

    optax passes the number of updates already applied (0 for the first update), hence `count + 1`.
    """
    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * emb_dim**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)
    return schedule


def make_optimizer(config: OptimizerConfig, emb_dim: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = rsqrt_schedule(config.learning_rate_scale, emb_dim, config.warmup_steps)
    adam = optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
    if config.grad_clip_norm > 0:
        adam = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam)
    return adam, schedule
