"""The Mamba-2 mixer (Dao and Gu 2024, "Transformers are SSMs"): a selective state-space block, the "ssm" kind of
the decoder's self-attention role, which a pattern interleaves with attention (model.decoder_attention=
"ssm,ssm,dense": the hybrid of Jamba and of Pitorro et al. 2024's MT study).

Per token t and head h (a scalar decay per head, one group of B and C shared by the heads):

    u = silu(causal depthwise conv(x W_x)),  B, C = silu(conv(x W_B)), silu(conv(x W_C)),  dt = softplus(x W_dt + b)
    state_t = exp(dt_t A_h) state_{t-1} + dt_t B_t u_t^T          (state: [state, head_dim] per head)
    y_t = C_t^T state_t + D_h u_t,   out = W_out RMSNorm(y * silu(x W_z))

Training runs the chunked form (`ssd`): within chunks of model.ssm_chunk tokens the quadratic "attention" form,
between chunks a lax.scan of the states, never a loop over tokens. Decoding carries, per hypothesis, the last
ssm_conv - 1 inputs of the convolution and the [heads, state, head_dim] state: constant memory per token, which beam
search reorders through the parents.

A sentence never reads another: the state and the convolution start afresh at each segment's first token, and
padding neither decays nor feeds the state. decoder_only's stream (join_pair) holds the sources, then the targets; the
block reads it with each segment's target right after its source (`segment_order`), as a recurrence must.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model import blocks
from transformer.model.blocks import Cache, CacheSetup, Inputs, Step
from transformer.model.config import ModelConfig, accumulated_dot, partitioned

Array = jax.Array


def causal_conv(u: Array, weight: Array, bias: Array, segmentation: Array) -> Array:
    """Depthwise causal convolution within segments: out_t = bias + sum_i weight[i] u_{t-(K-1-i)}, over the earlier
    positions of t's own segment (the kernel's K taps as K shifted products: K is a handful). u [batch, length,
    channels], weight [K, channels], segmentation [batch, length] -> [batch, length, channels]."""
    taps, length = weight.shape[0], u.shape[1]
    out = u * weight[-1] + bias
    for back in range(1, min(taps, length)):
        earlier = jnp.pad(u, [(0, 0), (back, 0), (0, 0)])[:, :length]
        same = jnp.pad(segmentation, [(0, 0), (back, 0)], constant_values=-1)[:, :length] == segmentation
        out = out + jnp.where(same[..., None], earlier, 0) * weight[-1 - back]
    return out


def ssd(x: Array, dt: Array, a: Array, b: Array, c: Array, segmentation: Array, chunk: int
        ) -> tuple[Array, Array]:
    """The state-space recurrence above (without D) in Mamba-2's chunked form, in float32.

    x [batch, length, heads, head_dim], dt [batch, length, heads] (0 at padding), a [heads] (negative), b and c
    [batch, length, state], segmentation [batch, length] (contiguous segments; the state restarts where it changes)
    -> (y [batch, length, heads, head_dim], the state after the last position, [batch, heads, state, head_dim]).
    """
    batch, length, heads, head_dim = x.shape
    size = min(chunk, length)
    count, pad = -(-length // size), -length % size

    def chunks(array, value=0):  # [batch, length, ...] -> [batch, count, size, ...]; padding is inert (dt = 0)
        array = jnp.pad(array, [(0, 0), (0, pad)] + [(0, 0)] * (array.ndim - 2), constant_values=value)
        return array.reshape(batch, count, size, *array.shape[2:])

    f32 = jnp.float32
    # The padded tail continues the last segment: with dt = 0 it neither decays nor feeds the final state.
    segments = chunks(segmentation, 0)
    segments = jnp.where(jnp.arange(count * size).reshape(count, size) < length, segments, segmentation[:, -1:, None])
    inputs = chunks(x.astype(f32) * dt.astype(f32)[..., None])  # [b, c, s, h, p]: dt B u's u part
    log_decay = jnp.moveaxis(chunks(dt.astype(f32) * a.astype(f32)), 3, 1)  # [b, h, c, s]
    b, c = chunks(b.astype(f32)), chunks(c.astype(f32))
    cumulative = jnp.cumsum(log_decay, axis=-1)  # [b, h, c, s]: log decay from the chunk's start to each position

    # Inside each chunk: y_t = sum_{s <= t, same segment} C_t.B_s exp(cum_t - cum_s) dt_s u_s.
    same = (segments[..., :, None] == segments[..., None, :]) & jnp.tril(jnp.ones((size, size), bool))
    decay = jnp.exp(jnp.where(same[:, None], cumulative[..., :, None] - cumulative[..., None, :], -jnp.inf))
    scores = jnp.einsum("bctn,bcsn->bcts", c, b)
    y = jnp.einsum("bhcts,bcshp->bcthp", decay * scores[:, None], inputs)

    # Each chunk's own contribution to the state at its end (from the positions of its last segment) ...
    last = segments[..., -1]  # [b, c]
    to_end = jnp.exp(cumulative[..., -1:] - cumulative) * (segments == last[..., None])[:, None]  # [b, h, c, s]
    states = jnp.einsum("bcsn,bhcs,bcshp->bchnp", b, to_end, inputs)

    # ... then a scan between chunks: the state entering chunk i, carried on where its segment goes on.
    def carry(previous, chunk_in):
        state, segment = previous
        chunk_state, chunk_decay, chunk_last = chunk_in
        goes_on = (chunk_last == segment)[:, None, None, None]
        after = jnp.where(goes_on, jnp.exp(chunk_decay)[..., None, None] * state, 0.0) + chunk_state
        return (after, chunk_last), (state, segment)

    start = (jnp.zeros((batch, heads, b.shape[-1], head_dim), f32), jnp.full((batch,), -1, segmentation.dtype))
    (final, _), (entering, entering_segment) = jax.lax.scan(
        carry, start, (jnp.moveaxis(states, 1, 0), jnp.moveaxis(cumulative[..., -1], 2, 0), jnp.moveaxis(last, 1, 0)))
    entering, entering_segment = jnp.moveaxis(entering, 0, 1), jnp.moveaxis(entering_segment, 0, 1)  # [b, c, ...]
    # The entering state reaches position t of a chunk if t is still in the segment it belongs to.
    reach = jnp.exp(cumulative) * (segments == entering_segment[..., None])[:, None]  # [b, h, c, t]
    y = y + jnp.einsum("bctn,bchnp,bhct->bcthp", c, entering, reach)
    return y.reshape(batch, count * size, heads, head_dim)[:, :length], final


def segment_order(segmentation: Array) -> Array:
    """[batch, length] -> the row order that puts each segment's positions together, in their order, padding last:
    decoder_only's join_pair stream [sources | targets] read as source 1, target 1, source 2, ... (a stable sort)."""
    key = jnp.where(segmentation == 0, jnp.iinfo(jnp.int32).max, segmentation.astype(jnp.int32))
    return jnp.argsort(key, axis=1, stable=True)


@blocks.register("self_attention", "ssm")
class Mamba2(blocks.Block):
    """The Mamba-2 (SSD) mixer in place of the decoder's self-attention in the layers a pattern names."""

    # A causal recurrence: the encoder's bidirectional reading has no form here.
    stacks = ("decoder",)

    def __init__(self, config: ModelConfig, field: str, *, rngs: nnx.Rngs):
        self.config, self.field = config, field
        dim, inner, state, dtype = config.emb_dim, self.inner, config.ssm_state, config.compute_dtype

        def linear(out, *names):
            return nnx.Linear(dim, out, use_bias=False, dtype=dtype, kernel_init=config.kernel_init(*names), rngs=rngs,
                              dot_general=accumulated_dot)

        def param(value, *names):
            return nnx.Param(partitioned(lambda *_: value, *names)(None, value.shape, jnp.float32))

        self.in_x, self.in_z = linear(inner, "embed", "mlp"), linear(inner, "embed", "mlp")
        self.in_bc, self.in_dt = linear(2 * state, "embed", None), linear(self.heads, "embed", None)
        taps = config.ssm_conv
        conv = nnx.initializers.uniform(2 / math.sqrt(taps))  # PyTorch's depthwise Conv1d init: U(+-1/sqrt(fan in))
        self.conv_x = param(conv(rngs.params(), (taps, inner)) - 1 / math.sqrt(taps), None, "mlp")
        self.conv_bc = param(conv(rngs.params(), (taps, 2 * state)) - 1 / math.sqrt(taps), None, None)
        self.conv_x_bias = param(jnp.zeros((inner,)), "mlp")
        self.conv_bc_bias = param(jnp.zeros((2 * state,)), None)
        # Mamba's initialisation: dt log-uniform in [0.001, 0.1] through softplus's inverse, A uniform in [1, 16].
        dt = jnp.exp(jax.random.uniform(rngs.params(), (self.heads,), minval=math.log(1e-3), maxval=math.log(0.1)))
        self.dt_bias = param(dt + jnp.log(-jnp.expm1(-dt)), None)
        self.a_log = param(jnp.log(jax.random.uniform(rngs.params(), (self.heads,), minval=1.0, maxval=16.0)), None)
        self.skip = param(jnp.ones((self.heads,)), None)  # D
        self.norm_scale = param(jnp.ones((inner,)), "mlp")
        self.output = nnx.Linear(inner, dim, use_bias=False, dtype=dtype, kernel_init=config.kernel_init("mlp", "embed"),
                                 rngs=rngs, dot_general=accumulated_dot)

    @classmethod
    def checks(cls, config, field):
        inner = config.ssm_expand * config.emb_dim
        sizes = ("ssm_state", "ssm_expand", "ssm_head_dim", "ssm_conv", "ssm_chunk")
        return [(all(getattr(config, size) >= 1 for size in sizes),
                 ", ".join(f"{size}={getattr(config, size)}" for size in sizes) + " must all be >= 1"),
                (inner % config.ssm_head_dim == 0,
                 f"ssm_head_dim={config.ssm_head_dim} must divide ssm_expand x emb_dim = {inner}")]

    @property
    def inner(self) -> int:
        return self.config.ssm_expand * self.config.emb_dim

    @property
    def heads(self) -> int:
        return self.inner // self.config.ssm_head_dim

    def project(self, x: Array) -> tuple[Array, Array, Array, Array]:
        """x [..., embed] -> the convolution's inputs (u [..., inner], bc [..., 2 state]), the gate z and dt's
        pre-activation [..., heads]."""
        return self.in_x(x), self.in_bc(x), self.in_z(x), self.in_dt(x)

    def finish(self, y: Array, u: Array, z: Array) -> Array:
        """y [..., heads, head_dim] of the recurrence -> the block's output [..., embed]: D's skip, the gate, the
        RMSNorm (Mamba-2's gated norm) and the output projection."""
        y = y + self.skip[...][:, None] * u.reshape(y.shape).astype(jnp.float32)
        y = y.reshape(*y.shape[:-2], self.inner) * jax.nn.silu(z.astype(jnp.float32))
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.config.layer_norm_epsilon)
        return self.output((y * self.norm_scale[...]).astype(self.config.compute_dtype))

    def step_size(self, dt: Array) -> Array:
        return jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...])

    def mix(self, x: Array, segmentation: Array, real: Array | None = None) -> tuple[Array, Cache]:
        """The block over rows whose segments are contiguous -> (y, the decoding state after each row's last
        position: its state and the convolution's inputs). real [batch, length]: the tokens that feed the state
        (default: segment != 0)."""
        real = (segmentation != 0 if real is None else real)[..., None]
        u, bc, z, dt = self.project(x)
        u, bc = u * real, bc * real
        conv_u = jax.nn.silu(causal_conv(u, self.conv_x[...], self.conv_x_bias[...], segmentation))
        conv_bc = jax.nn.silu(causal_conv(bc, self.conv_bc[...], self.conv_bc_bias[...], segmentation))
        b, c = jnp.split(conv_bc, 2, axis=-1)
        heads = conv_u.reshape(*conv_u.shape[:-1], self.heads, self.config.ssm_head_dim)
        y, state = ssd(heads, self.step_size(dt) * real, -jnp.exp(self.a_log[...]), b, c, segmentation,
                       self.config.ssm_chunk)
        return self.finish(y, conv_u, z), {"state": state, "u": u, "bc": bc}

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, blocks.Stats]:
        segmentation = inputs.self_mask.segmentation
        if not self.config.joins_pair:  # the decoder's targets: each segment's positions are together already
            return self.mix(x, segmentation)[0], {}
        order = segment_order(segmentation)
        y, _ = self.mix(jnp.take_along_axis(x, order[..., None], axis=1),
                        jnp.take_along_axis(segmentation, order, axis=1))
        return jnp.take_along_axis(y, jnp.argsort(order, axis=1)[..., None], axis=1), {}

    def init_cache(self, setup: CacheSetup) -> Cache:
        """Per hypothesis: the state [heads, state, head_dim] (float32) and the convolution's last ssm_conv - 1
        inputs, zero before the first position."""
        config, rows = self.config, (setup.batch, setup.hypotheses)
        window = config.ssm_conv - 1
        return {"state": jnp.zeros((*rows, self.heads, config.ssm_state, config.ssm_head_dim), jnp.float32),
                "u": jnp.zeros((*rows, window, self.inner), config.compute_dtype),
                "bc": jnp.zeros((*rows, window, 2 * config.ssm_state), config.compute_dtype)}

    def decode_step(self, x: Array, cache: Cache, step: Step) -> tuple[Array, Cache]:
        """One position of every hypothesis: the convolution over its window, one step of the recurrence."""
        u, bc, z, dt = self.project(x)  # [batch, hypotheses, ...]
        windows = {name: jnp.concatenate([cache[name], new[:, :, None].astype(cache[name].dtype)], axis=2)
                   for name, new in (("u", u), ("bc", bc))}
        conv_u = jax.nn.silu(jnp.sum(windows["u"] * self.conv_x[...], axis=2) + self.conv_x_bias[...])
        conv_bc = jax.nn.silu(jnp.sum(windows["bc"] * self.conv_bc[...], axis=2) + self.conv_bc_bias[...])
        b, c = jnp.split(conv_bc.astype(jnp.float32), 2, axis=-1)
        heads = conv_u.reshape(*conv_u.shape[:-1], self.heads, self.config.ssm_head_dim).astype(jnp.float32)
        dt = self.step_size(dt)  # [batch, hypotheses, heads]
        decay = jnp.exp(dt * -jnp.exp(self.a_log[...]))
        state = (decay[..., None, None] * cache["state"]
                 + jnp.einsum("bjh,bjn,bjhp->bjhnp", dt, b, heads))
        y = jnp.einsum("bjn,bjhnp->bjhp", c, state)
        return self.finish(y, conv_u, z), {"state": state, **{name: w[:, :, 1:] for name, w in windows.items()}}

    def reorder(self, cache: Cache, parents: Array) -> Cache:
        def follow(array):
            return jnp.take_along_axis(array, parents.reshape(*parents.shape, *[1] * (array.ndim - 2)), axis=1)
        return {name: follow(array) for name, array in cache.items()}

    def prefill(self, x: Array, inputs: Inputs, cache: Cache) -> tuple[Array, Cache]:
        """decoder_only's source prefix (real tokens first, padding after): its outputs, and each row's state after
        its last real token with the convolution's inputs before it, for every hypothesis."""
        real = inputs.self_mask.segmentation != 0
        # One segment through the padding too: padded positions are inert, so the final state is the last real one's.
        y, after = self.mix(x, jnp.ones_like(real, jnp.int32), real)
        lengths = jnp.sum(real, axis=1)
        window = self.config.ssm_conv - 1
        back = lengths[:, None] - window + jnp.arange(window)  # the last `window` real positions, negative: before
        hypotheses = cache["state"].shape[1]

        def last_inputs(array):  # [batch, length, channels] -> [batch, hypotheses, window, channels]
            taken = jnp.take_along_axis(array, jnp.maximum(back, 0)[..., None], axis=1) * (back >= 0)[..., None]
            return jnp.broadcast_to(taken[:, None], (array.shape[0], hypotheses, *taken.shape[1:]))
        state = jnp.broadcast_to(after["state"][:, None], cache["state"].shape)
        return y, {"state": state, "u": last_inputs(after["u"]).astype(cache["u"].dtype),
                   "bc": last_inputs(after["bc"]).astype(cache["bc"].dtype)}
