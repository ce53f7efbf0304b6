"""Multi-head attention (paper section 3.2) and the dense kinds: the one attention body for training,
teacher-forced passes and cached decoding, the decoding cache held in blocks, and the dense self- and
cross-attention blocks that the other kinds build on."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model import blocks
from transformer.model.blocks import Cache, CacheSetup, Inputs, Step
from transformer.model.config import ModelConfig, accumulated_dot, partitioned
from transformer.model.masks import SelfMask, attention_mask

Array = jax.Array


def attention(implementation: str, query: Array, key: Array, value: Array, mask: Array | SelfMask,
              dropout: nnx.Dropout | None, *, deterministic: bool, rngs: nnx.Rngs | None,
              window_size: tuple[int, int] | None = None) -> Array:
    """Scaled dot-product attention by `implementation` (ModelConfig.attention); same shapes as
    dot_product_attention. window_size: jax's local_window_size, for the kernels' form of local attention."""
    if isinstance(mask, SelfMask):
        mask = mask.dense()
    if implementation == "reference":
        return dot_product_attention(query, key, value, mask, dropout, deterministic=deterministic, rngs=rngs)
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(f"model.attention='cudnn' (flash attention) needs a GPU; this is a {jax.default_backend()} "
                         "backend: use model.attention='xla' or 'reference'")
    # jax's kernels take the mask as [batch, heads or 1, q_length, k_length], like ours; softmax is float32 inside.
    return jax.nn.dot_product_attention(query, key.astype(query.dtype), value.astype(query.dtype), mask=mask,
                                        local_window_size=window_size, implementation=implementation)


def dot_product_attention(query: Array, key: Array, value: Array, mask: Array, dropout: nnx.Dropout | None = None, *,
                          deterministic: bool = True, rngs: nnx.Rngs | None = None) -> Array:
    """softmax(Q K^T / sqrt(d_k)) V with a boolean mask; softmax in float32 (`head_major_attention` on these
    operands). query [batch, q_length, heads, head_dim], key/value [batch, k_length, heads, head_dim],
    mask [batch, 1, q_length, k_length] -> [batch, q_length, heads, head_dim]."""
    attended = head_major_attention(jnp.transpose(query, (0, 2, 1, 3)), *to_cache_layout(key, value), mask, dropout,
                                    deterministic=deterministic, rngs=rngs)
    return jnp.transpose(attended, (0, 2, 1, 3))


def head_major_attention(query: Array, keys: Array, values: Array, mask: Array, dropout: nnx.Dropout | None = None, *,
                         deterministic: bool = True, rngs: nnx.Rngs | None = None, normalize: bool = True
                         ) -> Array | tuple[Array, Array, Array]:
    """The one attention body, for training, teacher-forced passes and cached decoding alike: query [batch, heads,
    q_length, head_dim], keys [batch, heads, head_dim, k_length] and values [batch, heads, k_length, head_dim] (the
    caches' layout, to_cache_layout), mask [batch, 1, q_length, k_length] -> [batch, heads, q_length, head_dim].
    normalize=False (no dropout) leaves the softmax unnormalised, for blocked_attention to join blocks: ->
    (exp(logits - top) V float32, top, sum(exp(logits - top))), top being each row's largest logit [..., 1].

    Head-major operands make both products batched matrix products in the layout XLA's CPU backend runs them
    in, so a decoding cache is read where it lies (over [batch, length, heads, head_dim] views, XLA copied every
    cache into another layout at every step).
    """
    query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
    logits = jnp.einsum("bhqd,bhdk->bhqk", query, keys.astype(query.dtype), preferred_element_type=jnp.float32)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    if not normalize:
        top = jnp.max(logits, axis=-1, keepdims=True)
        weights = jnp.exp(logits - top)
        attended = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(values.dtype), values,
                              preferred_element_type=jnp.float32)
        return attended, top, jnp.sum(weights, axis=-1, keepdims=True)
    weights = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
    if dropout is not None:
        weights = dropout(weights, deterministic=deterministic, rngs=rngs)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, values, preferred_element_type=jnp.float32).astype(values.dtype)


def to_cache_layout(keys: Array, values: Array) -> tuple[Array, Array]:
    """keys, values [batch, length, heads, head_dim] -> keys [batch, heads, head_dim, length], values [batch, heads,
    length, head_dim]: the head-major layout of head_major_attention and of the decoding caches."""
    return jnp.transpose(keys, (0, 2, 3, 1)), jnp.transpose(values, (0, 2, 1, 3))


def blocked_attention(query: Array, key_blocks: tuple[Array, ...], value_blocks: tuple[Array, ...], mask: Array,
                      last_row: Array | int, prefix: tuple = ()) -> Array:
    """head_major_attention over a decoding cache held in blocks (DenseSelfAttention.init_cache): query [batch,
    heads, q_length, head_dim]; key blocks [batch, heads, head_dim, n_i] and value blocks [batch, heads, n_i,
    head_dim]; mask [batch, 1, q_length, sum n_i] -> [batch, heads, q_length, head_dim]. No dropout. prefix: () or
    one (keys, values, mask) of keys every query may read besides the blocks (decoder_only's source prefix),
    joined into the same softmax.

    Each block is attended to alone and the results are joined into one softmax, so the blocks wholly
    past `last_row` (the last row written so far, dynamic) are never read: one lax.switch on the count of blocks
    written picks the branch that reads just those, each as a whole array (XLA's CPU backend copies a slice of an
    array before a product, and a lax.cond per block made beam search slower than one switch).
    """
    def read(count, query, key_blocks, value_blocks, mask, prefix):
        spans, start = list(prefix), 0
        for keys, values in zip(key_blocks[:count], value_blocks[:count]):
            spans.append((keys, values, mask[..., start:start + keys.shape[-1]]))
            start += keys.shape[-1]
        if len(spans) == 1:
            return head_major_attention(query, *spans[0])
        parts = [head_major_attention(query, *span, normalize=False) for span in spans]
        top = functools.reduce(jnp.maximum, [block_top for _, block_top, _ in parts])
        scales = [jnp.exp(block_top - top) for _, block_top, _ in parts]
        total = sum(block_sum * scale for (_, _, block_sum), scale in zip(parts, scales))
        return (sum(attended * scale for (attended, _, _), scale in zip(parts, scales)) / total).astype(values.dtype)

    if len(key_blocks) == 1:
        return read(1, query, key_blocks, value_blocks, mask, prefix)
    branches = [functools.partial(read, count) for count in range(1, len(key_blocks) + 1)]
    return jax.lax.switch(last_row // key_blocks[0].shape[-1], branches, query, key_blocks, value_blocks, mask,
                          prefix)


def write_cache_rows(blocks: tuple[Array, ...], rows: Array, axis: int, index: Array) -> tuple[Array, ...]:
    """Write `rows` into a cache held in equal blocks along `axis`, at row `index` (dynamic) of the whole cache;
    the rows lie in one block. Every block is updated in place at a clamped offset, the others with the rows
    they already hold: no block is copied, whichever holds `index` (a select of whole blocks would copy them)."""
    if len(blocks) == 1:
        return (jax.lax.dynamic_update_slice_in_dim(blocks[0], rows.astype(blocks[0].dtype), index, axis),)
    length, count = blocks[0].shape[axis], rows.shape[axis]
    written = []
    for number, block in enumerate(blocks):
        offset = jnp.clip(index - number * length, 0, length - count)
        here = jax.lax.dynamic_slice_in_dim(block, offset, count, axis)
        mine = (index >= number * length) & (index < (number + 1) * length)
        written.append(jax.lax.dynamic_update_slice_in_dim(block, jnp.where(mine, rows.astype(block.dtype), here),
                                                           offset, axis))
    return tuple(written)


def cache_rows_mask(step: Step, slots: int, window: int | None) -> tuple[Array, Array]:
    """Which cache rows each hypothesis reads at step.position, of a cache of `slots` positions x hypotheses rows,
    position-major (row t * hypotheses + j: position t of hypothesis j): -> (mask [batch, 1, hypotheses, slots x
    hypotheses], the first row this step writes). The cache is a ring of `slots` positions (as many as the
    decode's, unless a window keeps fewer), overwritten in turn; window: the earlier positions a query reads."""
    count = step.hypotheses
    # The position each slot holds after this step's write, negative where none has been written.
    held = step.position - (step.position - jnp.arange(slots)) % slots
    written = held >= 0
    if window is not None:
        written &= held >= step.position - window
    if step.history is None:  # each hypothesis's rows are its own: [1, count, slots]
        owner = jnp.broadcast_to(jnp.arange(count)[None, :, None], (1, count, slots))
    else:  # the hypothesis whose rows hold each slot's position, for each hypothesis: [batch, count, slots]
        owner = jnp.take(step.history, jnp.maximum(held, 0), axis=2)
    visible = written[:, None] & (owner[..., None] == jnp.arange(count))
    mask = jnp.broadcast_to(visible, (step.batch, count, slots, count)).reshape(step.batch, 1, count, slots * count)
    return mask, step.position % slots * count


class MultiHeadAttention(blocks.Block):
    """h parallel heads of scaled dot-product attention with learned projections (paper section 3.2.2), the base of
    every attention kind. Projections have no bias, as in tensor2tensor, unless model.projection_bias (Marian's)."""

    def __init__(self, config: ModelConfig, field: str, *, rngs: nnx.Rngs):
        """field: the config field naming this attention's kind (encoder_attention, ...)."""
        self.config, self.field = config, field
        dim, dtype = config.emb_dim, config.compute_dtype
        def linear(*names):
            return nnx.Linear(dim, dim, use_bias=config.projection_bias, dtype=dtype, dot_general=accumulated_dot,
                              kernel_init=config.kernel_init(*names),
                              bias_init=partitioned(nnx.initializers.zeros_init(), names[1]), rngs=rngs)
        self.query, self.key, self.value = linear("embed", "heads"), linear("embed", "heads"), linear("embed", "heads")
        self.output = linear("heads", "embed")
        self.dropout = nnx.Dropout(config.attention_dropout_rate)

    def split_heads(self, x: Array) -> Array:
        return x.reshape(*x.shape[:-1], self.config.num_heads, self.config.head_dim)

    def keys_values(self, x: Array) -> tuple[Array, Array]:
        """[batch, length, embed] -> keys and values, each [batch, length, heads, head_dim]."""
        return self.split_heads(self.key(x)), self.split_heads(self.value(x))

    def merge_heads(self, attended: Array, x: Array) -> Array:
        """attended [batch, length, heads, head_dim] of queries x -> the output projection [batch, length, embed]."""
        return self.output(attended.reshape(*x.shape[:-1], self.config.emb_dim))

    def attend(self, x: Array, keys: Array, values: Array, mask: Array | SelfMask, *, deterministic: bool,
               rngs: nnx.Rngs | None) -> Array:
        """Queries from x [batch, q_length, embed] over given keys/values -> [batch, q_length, embed]."""
        attended = attention(self.config.attention, self.split_heads(self.query(x)), keys, values, mask,
                             self.dropout, deterministic=deterministic, rngs=rngs)
        return self.merge_heads(attended, x)

    def attend_cache(self, x: Array, key_blocks: tuple[Array, ...], value_blocks: tuple[Array, ...], mask: Array,
                     last_row: Array | int = 0, prefix: tuple = ()) -> Array:
        """As attend, over keys/values of a decoding cache (blocked_attention, with its prefix). Cached decoding
        always takes this path, whatever config.attention: jax's kernels have no form for a few queries over a
        cache. It computes in the cache's dtype (CacheSetup.dtype), the projections in the model's."""
        query = jnp.transpose(self.split_heads(self.query(x)), (0, 2, 1, 3)).astype(key_blocks[0].dtype)
        attended = jnp.transpose(blocked_attention(query, key_blocks, value_blocks, mask, last_row, prefix),
                                 (0, 2, 1, 3))
        return self.merge_heads(attended.astype(x.dtype), x)


@blocks.register("self_attention", "dense")
class DenseSelfAttention(MultiHeadAttention):
    """Every query reads every key its mask allows. Decoding keeps each position's keys/values in cache rows
    (init_cache), which the step's mask finds through the ancestor table, so beam search never moves them."""

    window: int | None = None  # the earlier positions a decoding query reads (local's window); None: all

    @staticmethod
    def prepare(inputs: Inputs) -> Inputs:
        return inputs.replace(self_mask=inputs.self_mask.formed())  # the matrix once for the stack, not per layer

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, blocks.Stats]:
        keys, values = self.keys_values(x)
        return self.attend(x, keys, values, inputs.self_mask, deterministic=deterministic, rngs=rngs), {}

    def cache_positions(self, setup: CacheSetup) -> tuple[int, int]:
        """(positions, blocks) of the cache: every position of the decode, in setup.blocks arrays."""
        return setup.max_length, setup.blocks

    def init_cache(self, setup: CacheSetup) -> Cache:
        """Empty key/value rows, hypotheses x positions of them, position-major (cache_rows_mask), in
        to_cache_layout. The positions are rounded up to a multiple of the blocks, the arrays the rows are held
        in; a step reads only the blocks written so far (blocked_attention)."""
        positions, count = self.cache_positions(setup)
        rows = -(-positions // count) * count * setup.hypotheses
        config, length = self.config, rows // count
        dtype = setup.dtype or config.compute_dtype
        return {"key": tuple(jnp.zeros((setup.batch, config.num_heads, config.head_dim, length), dtype)
                             for _ in range(count)),
                "value": tuple(jnp.zeros((setup.batch, config.num_heads, length, config.head_dim), dtype)
                               for _ in range(count))}

    def decode_step(self, x: Array, cache: Cache, step: Step) -> tuple[Array, Cache]:
        """This position's keys/values written into the cache's rows, then each query reads the rows its
        hypothesis's mask shows it (and decoder_only's prefilled source prefix, where the source mask shows it)."""
        slots = sum(block.shape[-1] for block in cache["key"]) // step.hypotheses
        mask, cache_index = step.remember(("cache rows", slots, self.window),
                                          lambda: cache_rows_mask(step, slots, self.window))
        keys, values = to_cache_layout(*self.keys_values(x))
        cache = {**cache, "key": write_cache_rows(cache["key"], keys, 3, cache_index),
                 "value": write_cache_rows(cache["value"], values, 2, cache_index)}
        prefix = ((cache["prefix_key"], cache["prefix_value"], step.source_mask),) if "prefix_key" in cache else ()
        return self.attend_cache(x, cache["key"], cache["value"], mask, cache_index + x.shape[1] - 1, prefix), cache

    def prefill(self, x: Array, inputs: Inputs, cache: Cache) -> tuple[Array, Cache]:
        """The prefix's keys/values, kept for every step to read."""
        keys, values = self.keys_values(x)
        cache = {**cache, **dict(zip(("prefix_key", "prefix_value"), to_cache_layout(keys, values)))}
        return self.attend(x, keys, values, inputs.self_mask, deterministic=True, rngs=None), cache


@blocks.register("cross_attention", "dense")
class DenseCrossAttention(MultiHeadAttention):
    """The decoder's queries over the encoder's outputs; decoding computes their keys/values once (init_cache)."""

    @staticmethod
    def prepare(inputs: Inputs) -> Inputs:
        if inputs.cross_mask is not None:
            return inputs
        return inputs.replace(cross_mask=attention_mask(inputs.self_mask.segmentation, inputs.source_segmentation))

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, blocks.Stats]:
        keys, values = self.keys_values(inputs.encoded)
        return self.attend(x, keys, values, inputs.cross_mask, deterministic=deterministic, rngs=rngs), {}

    def init_cache(self, setup: CacheSetup) -> Cache:
        dtype = setup.dtype or self.config.compute_dtype
        return dict(zip(("key", "value"), (x.astype(dtype) for x in to_cache_layout(*self.keys_values(setup.encoded)))))

    def decode_step(self, x: Array, cache: Cache, step: Step) -> tuple[Array, Cache]:
        return self.attend_cache(x, (cache["key"],), (cache["value"],), step.source_mask), cache
