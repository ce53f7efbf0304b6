"""A mixture of experts in place of the feed-forward (GShard, Switch): the "experts" feed_forward kind, in every
model.expert_every-th layer of each stack when model.num_experts > 0. Routing, capacity and the router's stats."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model import blocks
from transformer.model.blocks import Inputs
from transformer.model.config import ModelConfig, partitioned
from transformer.model.feed_forward import ACTIVATION_FUNCTIONS

Array = jax.Array

# What each mixture-of-experts layer reports, averaged over the model's expert layers (Transformer.__call__).
ROUTER_STATS = ("router_balance", "router_z", "expert_dropped", "expert_load_max")


def expert_capacity(tokens: int, config: ModelConfig, factor: float) -> int:
    """Assignments each expert takes from one row of `tokens` tokens: factor x k x tokens / experts, rounded up
    (factor 0: every assignment, none dropped)."""
    if factor == 0:
        return tokens * config.experts_per_token
    return max(1, math.ceil(factor * config.experts_per_token * tokens / config.num_experts))


def route(logits: Array, real: Array, experts_per_token: int, capacity: int) -> tuple[Array, Array, Array]:
    """Top-k token-choice routing with expert capacity (GShard; Switch for k = 1), per row: router logits
    [batch, length, experts] float32 and the real (non-padding) tokens [batch, length] ->
    (dispatch [batch, length, experts, capacity] 0/1, combine weights (the gates at the dispatched slots),
    stats [len(ROUTER_STATS)]).

    Gates: the softmax of the logits at each token's k best experts, renormalised to sum 1 when k > 1 (GShard),
    the raw probability when k = 1 (Switch). An expert takes assignments in priority order, every token's first
    choice (by position) before any second choice, up to `capacity` per row; the rest are dropped (the token keeps
    its residual path), and padding is never routed.

    Load-balancing loss, normalised so that it is 1 under perfectly uniform routing for any k:
        router_balance = E * sum_e f_e * P_e,
        f_e = (assignments to expert e among the top-k, before capacity) / (k * real tokens),
        P_e = mean over real tokens of the router probability of e,
    Switch's eq. 4 (Fedus et al. 2021) for k = 1; for k > 1 it is flaxformer's / ST-MoE's top-k form divided by k
    (theirs counts each token k times, so its uniform value is k, not 1). router_z (ST-MoE eq. 5): the mean over
    real tokens of logsumexp(logits)^2. expert_dropped: the share of assignments over capacity;
    expert_load_max: E * max_e f_e (1 when balanced, E when one expert takes everything)."""
    batch, length, experts = logits.shape
    real = real.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    gates, chosen = jax.lax.top_k(probs, experts_per_token)  # [batch, length, k]
    if experts_per_token > 1:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    wanted = jax.nn.one_hot(chosen, experts, dtype=jnp.float32) * real[..., None, None]  # [b, length, k, experts]
    # Priority: choice rank first, then position: [batch, k * length, experts], first choices first.
    ordered = jnp.swapaxes(wanted, 1, 2).reshape(batch, experts_per_token * length, experts)
    slot = ((jnp.cumsum(ordered, axis=1) - 1) * ordered).astype(jnp.int32)
    kept = ordered * (slot < capacity)
    slots = jax.nn.one_hot(slot, capacity, dtype=jnp.float32) * kept[..., None]  # [b, k * length, experts, cap]
    slots = jnp.swapaxes(slots.reshape(batch, experts_per_token, length, experts, capacity), 1, 2)
    dispatch = jnp.sum(slots, axis=2)  # a token's k choices are distinct experts: at most one slot per expert
    combine = jnp.sum(slots * gates[..., None, None], axis=2)
    tokens = jnp.maximum(jnp.sum(real), 1.0)
    assigned = jnp.sum(wanted, axis=(0, 1, 2))  # [experts]
    share = assigned / (experts_per_token * tokens)
    mean_probs = jnp.sum(probs * real[..., None], axis=(0, 1)) / tokens
    stats = jnp.stack([experts * jnp.sum(share * mean_probs),
                       jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * real) / tokens,
                       1.0 - jnp.sum(kept) / jnp.maximum(jnp.sum(ordered), 1.0),
                       experts * jnp.max(share)])
    return dispatch, combine, stats



@blocks.register("feed_forward", "experts")
class MoEFeedForward(blocks.PositionwiseBlock):
    """num_experts FeedForwards (weights [experts, ...], the `expert` logical axis, which mesh.rules may map to the
    mesh's expert axis) and a float32 router; each token goes to its experts_per_token best within capacity
    (route), its output the gate-weighted sum of theirs. Rows are the routing groups: capacity is per row, so a
    step's dispatch tensors are [batch, length, experts, capacity], local to the devices that hold the row."""

    stats = {"router": ROUTER_STATS}

    def __init__(self, config: ModelConfig, field: str = "num_experts", *, rngs: nnx.Rngs):
        self.config = config
        experts, d, ff = config.num_experts, config.emb_dim, config.mlp_dim
        base = (nnx.initializers.normal(config.init_std) if config.init_std  # lecun's fan-in is d (d_ff) per expert
                else nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,)))
        zeros = nnx.initializers.zeros_init()

        def param(init, shape, *names):
            return nnx.Param(partitioned(init, *names)(rngs.params(), shape, jnp.float32))
        self.router = param(base, (d, experts), "embed", None)
        self.hidden = param(base, (experts, d, ff), "expert", "embed", "mlp")
        self.hidden_bias = param(zeros, (experts, ff), "expert", "mlp")
        self.output = param(base, (experts, ff, d), "expert", "mlp", "embed")
        self.output_bias = param(zeros, (experts, d), "expert", "embed")
        self.dropout = nnx.Dropout(config.relu_dropout_rate)
        self.activation = config.activation

    @classmethod
    def checks(cls, config, field):
        return [
            (config.num_experts >= 1, f"num_experts={config.num_experts} must be >= 0"),
            (1 <= config.experts_per_token <= config.num_experts,
             f"experts_per_token={config.experts_per_token} must be in [1, num_experts={config.num_experts}]"),
            (config.expert_every >= 1, f"expert_every={config.expert_every} must be >= 1"),
            (config.capacity_factor > 0, f"capacity_factor={config.capacity_factor} must be > 0"),
            (config.eval_capacity_factor >= 0, f"eval_capacity_factor={config.eval_capacity_factor} must be >= 0 "
                                               "(0: no limit)"),
            (min(config.router_balance_weight, config.router_z_weight) >= 0,
             f"router_balance_weight={config.router_balance_weight} and router_z_weight={config.router_z_weight} "
             "must be >= 0"),
            (not config.scan_layers or config.expert_every == 1,
             f"scan_layers=True stacks identical layers, and expert_every={config.expert_every} makes every "
             f"{config.expert_every}th one a mixture of experts: set expert_every=1 or scan_layers=False"),
        ]

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, blocks.Stats]:
        """x [batch, length, embed] -> (y, {"router": [len(ROUTER_STATS)] float32}). inputs.real None (decoding):
        every token, without capacity: a step holds a row's few hypotheses, and a capacity would make one
        hypothesis's output depend on which experts the others chose."""
        dropless = inputs.real is None
        y, stats = self.mix(x, jnp.ones(x.shape[:2], bool) if dropless else inputs.real,
                            deterministic=deterministic, rngs=rngs, dropless=dropless)
        return y, {"router": stats}

    def mix(self, x: Array, real: Array, *, deterministic: bool, rngs: nnx.Rngs | None,
            dropless: bool = False) -> tuple[Array, Array]:
        """x [batch, length, embed], real [batch, length] -> ([batch, length, embed], stats [len(ROUTER_STATS)]).
        Capacity: capacity_factor's in training, eval_capacity_factor's when deterministic, none when dropless."""
        config, dtype = self.config, self.config.compute_dtype
        logits = jnp.einsum("bld,de->ble", x.astype(jnp.float32), self.router[...])
        factor = 0 if dropless else config.eval_capacity_factor if deterministic else config.capacity_factor
        capacity = expert_capacity(x.shape[1], config, factor)
        dispatch, combine, stats = route(logits, real, config.experts_per_token, capacity)
        inputs = jnp.einsum("blec,bld->becd", dispatch.astype(dtype), x.astype(dtype))
        hidden = jnp.einsum("becd,edf->becf", inputs, self.hidden[...].astype(dtype)) + self.hidden_bias[...][:, None]
        hidden = self.dropout(ACTIVATION_FUNCTIONS[self.activation](hidden.astype(dtype)), deterministic=deterministic, rngs=rngs)
        outputs = (jnp.einsum("becf,efd->becd", hidden, self.output[...].astype(dtype))
                   + self.output_bias[...][:, None]).astype(dtype)
        return jnp.einsum("blec,becd->bld", combine.astype(dtype), outputs).astype(x.dtype), stats
