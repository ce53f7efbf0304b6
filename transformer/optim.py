"""The paper's optimiser (section 5.3): Adam(0.9, 0.98, 1e-9) with warmup then inverse-square-root decay,
and an optional cooldown: a linear decay of the learning rate toward 0 over the last part of a run."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from transformer import config_files

DECAYS = ("rsqrt", "constant")  # OptimizerConfig.decay: what the learning rate does after the warmup


@config_files.section("optimizer")
class OptimizerConfig:
    learning_rate_scale: float
    warmup_steps: int
    decay: str
    adam_b1: float
    adam_b2: float
    adam_eps: float
    grad_clip_norm: float
    cooldown_fraction: float

    def __post_init__(self):
        if not 0.0 <= self.cooldown_fraction < 1.0:
            raise ValueError(f"optimizer.cooldown_fraction={self.cooldown_fraction} must be in [0, 1)")
        if self.decay not in DECAYS:
            raise ValueError(f"optimizer.decay={self.decay!r} must be one of {DECAYS}")
        if self.warmup_steps <= 0:
            raise ValueError(f"warmup_steps must be positive, got {self.warmup_steps}")
        if self.learning_rate_scale <= 0:
            raise ValueError(f"learning_rate_scale must be positive, got {self.learning_rate_scale}")


def rsqrt_schedule(scale: float, emb_dim: int, warmup_steps: int, decay: str = "rsqrt") -> optax.Schedule:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), with step_num counted from 1;
    decay="constant" holds the peak after the warmup: scale * d_model^-0.5 * min(step, warmup) * warmup^-1.5.

    optax passes the number of updates already applied (0 for the first update), hence `count + 1`.
    """
    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        after = step**-0.5 if decay == "rsqrt" else jnp.asarray(warmup_steps**-0.5, jnp.float32)
        return scale * emb_dim**-0.5 * jnp.minimum(after, step * warmup_steps**-1.5)
    return schedule


class CooldownState(NamedTuple):
    """Where the linear decay toward 0 runs, in steps (the paper's step_num, from 1); start < 0: not begun."""

    cooldown_start: jax.Array  # float32 scalar
    cooldown_end: jax.Array  # float32 scalar: the step whose update is the last one (lr > 0)
    count: jax.Array  # int32 scalar: updates applied so far


def cooldown_factor(step: jax.Array, start: jax.Array, end: jax.Array) -> jax.Array:
    """1 before the cooldown, then (end - step + 1) / (end - start + 1): linear to the last step, then 0."""
    fraction = (end - step + 1.0) / jnp.maximum(end - start + 1.0, 1.0)
    return jnp.where(start < 0, 1.0, jnp.clip(fraction, 0.0, 1.0))


def scale_by_cooldown() -> optax.GradientTransformation:
    """Scales the updates by `cooldown_factor`, with the decay's start and end held in the optimizer state.

    The end is not a function of the step alone: under a time budget the last step is only known while
    training, so the trainer sets both with `begin_cooldown` when the decay begins. Being state, they are
    checkpointed, so a resumed run continues the same decay.
    """
    def init(params):
        del params
        return CooldownState(jnp.asarray(-1.0, jnp.float32), jnp.asarray(-1.0, jnp.float32),
                             jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        factor = cooldown_factor(state.count.astype(jnp.float32) + 1.0, state.cooldown_start, state.cooldown_end)
        updates = jax.tree.map(lambda u: u * factor.astype(u.dtype), updates)
        return updates, state._replace(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def _cooldown_state(opt_state: Any) -> CooldownState | None:
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, CooldownState))
             if isinstance(s, CooldownState)]
    return found[0] if found else None


def learning_rate(schedule: optax.Schedule, step: jax.Array, opt_state: Any) -> jax.Array:
    """The learning rate of the update at `step` (updates applied so far): the schedule times the cooldown."""
    lr = schedule(step)
    state = _cooldown_state(opt_state)
    if state is None:
        return lr
    return lr * cooldown_factor(jnp.asarray(step, jnp.float32) + 1.0, state.cooldown_start, state.cooldown_end)


def cooldown_steps(opt_state: Any) -> tuple[int, int] | None:
    """Host-side: the (start, end) steps that `begin_cooldown` set, or None (not begun, or no cooldown)."""
    state = _cooldown_state(opt_state)
    if state is None:
        return None
    start, end = (float(x) for x in jax.device_get((state.cooldown_start, state.cooldown_end)))
    return (int(start), int(end)) if start >= 0 else None


def begin_cooldown(opt_state: Any, start: int, end: int) -> Any:
    """The optimizer state with the decay set to run from step `start` to step `end` (both from 1).

    The new scalars keep the old ones' shardings, so the jitted step sees the same input layout."""
    def set_(state):
        if not isinstance(state, CooldownState):
            return state
        put = lambda value, like: jax.device_put(jnp.asarray(value, like.dtype), like.sharding)
        return state._replace(cooldown_start=put(float(start), state.cooldown_start),
                              cooldown_end=put(float(max(end, start)), state.cooldown_end))
    if _cooldown_state(opt_state) is None:
        raise ValueError("the optimizer has no cooldown: set optimizer.cooldown_fraction > 0")
    return jax.tree.map(set_, opt_state, is_leaf=lambda x: isinstance(x, CooldownState))


def make_optimizer(config: OptimizerConfig, emb_dim: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = rsqrt_schedule(config.learning_rate_scale, emb_dim, config.warmup_steps, config.decay)
    adam = optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
    if config.cooldown_fraction > 0:  # only then, so that the checkpoints of other runs keep their structure
        adam = optax.chain(adam, scale_by_cooldown())
    if config.grad_clip_norm > 0:
        adam = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam)
    return adam, schedule
