"""Performer attention (FAVOR+, Choromanski et al. 2020): softmax estimated by model.performer_features positive
orthogonal random features, phi(Q) (phi(K)^T V) / phi(Q) (phi(K)^T 1), never forming the [q_length, k_length]
weights, so time and memory grow linearly in the length. Any sublayer; the sums run over a whole row: one
sentence per row. Decoding keeps each hypothesis's running sums, of constant size, which beam search reorders."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model import blocks
from transformer.model.attention import MultiHeadAttention
from transformer.model.blocks import Cache, CacheSetup, Inputs, Step
from transformer.model.config import ATTENTION_FIELDS
from transformer.model.masks import SelfMask

Array = jax.Array

# Queries per block of performer's causal prefix sums: each block's own keys are read as a (block x block) masked
# product, the earlier blocks' through their running sum, so memory grows as length / 64 sums of m x d per head.
PERFORMER_BLOCK = 64
# Performer's smallest normaliser: every query's largest term is 1/m (query_features), so only an estimate that
# float32 cannot hold falls below it; such a query reads 0, without gradient, rather than 0 / 0 (NaN).
PERFORMER_FLOOR = 1e-6
# The largest query feature exp(60), where causal_sums reads its own block's keys at a shift past the query's.
PERFORMER_CAP = 60.0
# The largest query factor causal_sums' fast own-block product may meet; past it the block is summed exactly.
PERFORMER_EXACT = 30.0


def random_features(key: Array, count: int, dim: int) -> Array:
    """FAVOR+'s orthogonal random features (Choromanski et al. 2020): [count, dim] float32, in blocks of `dim`
    exactly orthogonal directions (QR of a Gaussian matrix), each row scaled to the norm of its own Gaussian
    vector, so every row is marginally N(0, I) and the rows of a block are orthogonal, which lowers the
    estimate's variance below independent draws."""
    count_blocks = -(-count // dim)
    keys = jax.random.split(key, count_blocks + 1)
    directions = jnp.concatenate([jnp.linalg.qr(jax.random.normal(k, (dim, dim)))[0].T for k in keys[:-1]])
    return directions[:count] * jnp.linalg.norm(jax.random.normal(keys[-1], (count, dim)), axis=-1, keepdims=True)


def feature_exponents(x: Array, features: Array) -> Array:
    """The exponents of FAVOR+'s positive features, w x - |x|^2 / 2 for each of the m rows w of `features`, of x
    [batch, length, heads, head_dim] scaled by head_dim^-1/4 -> [batch, length, heads, m] float32: with
    phi(x) = exp(exponent) / sqrt(m), phi(q) . phi(k) is an unbiased estimate of exp(q . k / sqrt(d))."""
    x = x.astype(jnp.float32) * x.shape[-1] ** -0.25
    return jnp.einsum("blhd,md->blhm", x, features) - jnp.sum(x * x, axis=-1, keepdims=True) / 2


def key_exponents(key: Array, features: Array, segmentation: Array) -> Array:
    """feature_exponents of the keys, -inf at padding (segmentation 0), whose features are then exactly 0."""
    return jnp.where((segmentation != 0)[:, :, None, None], feature_exponents(key, features), -jnp.inf)


# Unshifted, the features of keys of large norm underflowed to 0 and 0 / 0 made NaN gradients in training. So each
# feature of the keys is shifted by its largest exponent over the keys a query reads (F, without gradient: keys'
# features <= 1) and the queries' features by the opposite, which leaves every product phi(q) . phi(k) as it was;
# each query is then shifted by a constant of its own, which its normalisation cancels, so that its largest term
# is 1: no normaliser underflows, no feature overflows. Causal sums keep F per position, as decoding does.
def key_shift(exponents: Array, axis: int) -> Array:
    """F: the largest of key exponents along the length `axis` (kept), without gradient, 0 where all are padding."""
    shift = jax.lax.stop_gradient(jnp.max(exponents, axis=axis, keepdims=True))
    return jnp.where(jnp.isfinite(shift), shift, 0.0)


def key_features(exponents: Array, shift: Array) -> Array:
    return jnp.exp(exponents - shift) / math.sqrt(exponents.shape[-1])


def query_features(exponents: Array, shift: Array, largest: Array | None = None) -> Array:
    """phi(q) [batch, length, heads, m] of query exponents, over keys whose features were shifted by `shift`
    (broadcast), each query at a constant that makes its largest term 1 over keys whose largest exponents are
    `largest` (default: shift). Capped at exp(PERFORMER_CAP): only a read of keys shifted past what the query
    sees (causal_sums' own block) reaches it, and it keeps the sums and their gradients finite."""
    largest = shift if largest is None else largest
    own = jax.lax.stop_gradient(jnp.max(exponents + largest, axis=-1, keepdims=True))
    return jnp.exp(jnp.minimum(exponents + shift - own, PERFORMER_CAP)) / math.sqrt(exponents.shape[-1])


def normalized(numerator: Array, normalizer: Array, dtype) -> Array:
    held = normalizer > PERFORMER_FLOOR
    return jnp.where(held[..., None], numerator / jnp.where(held, normalizer, 1)[..., None], 0).astype(dtype)


def performer_attention(query: Array, key: Array, value: Array, mask: SelfMask, features: Array) -> Array:
    """Softmax attention estimated by positive random features (FAVOR+): phi(Q) (phi(K)^T V) / phi(Q) (phi(K)^T 1),
    never forming the [q_length, k_length] weights, so time and memory grow linearly in the length. Same shapes as
    dot_product_attention; mask.segmentation is the keys' (0: padding, whose features are zeroed: they add
    nothing); causal (self-attention): each query's sums run over the keys up to it, by blocks (causal_sums).
    Rows hold one sentence each (Settings refuses packing): the sums run over the whole row."""
    queries = feature_exponents(query, features)
    exponents = key_exponents(key, features, mask.segmentation)
    value = value.astype(jnp.float32)
    if mask.causal:
        numerator, normalizer = causal_sums(queries, exponents, value)
    else:
        shift = key_shift(exponents, 1)
        numerator, normalizer = read_sums(query_features(queries, shift),
                                          *key_sums(key_features(exponents, shift), value))
    return normalized(numerator, normalizer, query.dtype)


def key_sums(keys: Array, values: Array) -> tuple[Array, Array]:
    """The sums a performer query reads: phi(K)^T V [batch, heads, m, head_dim] and phi(K)^T 1 [batch, heads, m]."""
    return jnp.einsum("blhm,blhd->bhmd", keys, values), jnp.sum(keys, axis=1)


def read_sums(queries: Array, state: Array, total: Array) -> tuple[Array, Array]:
    """Queries' features [batch, length, heads, m] over key_sums -> numerators [batch, length, heads, head_dim],
    normalizers [batch, length, heads]."""
    return jnp.einsum("blhm,bhmd->blhd", queries, state), jnp.einsum("blhm,bhm->blh", queries, total)


def causal_sums(queries: Array, exponents: Array, values: Array, block: int = PERFORMER_BLOCK
                ) -> tuple[Array, Array]:
    """read_sums with each query reading only the keys up to its own position, of query and key exponents
    [batch, length, heads, m]: in blocks of `block` positions, its own block's keys through a masked (block x block)
    product and the earlier blocks' through the running sum of their key_sums (the prefix-sum form of causal
    FAVOR+, without a state per position). A block's sums are kept at the key shift of its last position, and
    rescaled as the shift grows from block to block (an associative scan); each query is shifted by the keys up
    to itself, as in decoding (attend_sums), so no query depends on later keys."""
    batch, length, heads, _ = queries.shape
    size = min(block, length)
    count, pad = -(-length // size), -length % size
    seen = jax.lax.cummax(jax.lax.stop_gradient(exponents), axis=1)  # F up to each position
    seen = jnp.where(jnp.isfinite(seen), seen, 0.0)

    def blocks(x, **fill):  # [batch, length, heads, ...] -> [batch, count, size, heads, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), **fill)
        return x.reshape(batch, count, size, *x.shape[2:])

    queries, values, seen = blocks(queries), blocks(values), blocks(seen, mode="edge")
    exponents = blocks(exponents, constant_values=-jnp.inf)
    last = seen[:, :, -1:]  # each block's sums are kept at its last position's shift: [batch, count, 1, heads, m]
    earlier = jnp.concatenate([last[:, :1], last[:, :-1]], axis=1)  # the previous block's (the first: its own)
    keys = key_features(exponents, last)

    def scan(earlier, later):  # the later block's sums: the earlier ones rescaled to its shift, then its own added
        (decay_a, state_a, total_a), (decay_b, state_b, total_b) = earlier, later
        return decay_a * decay_b, decay_b[..., None] * state_a + state_b, decay_b * total_a + total_b

    _, state, total = jax.lax.associative_scan(scan, (jnp.exp(earlier - last)[:, :, 0],
                                                      jnp.einsum("bcshm,bcshd->bchmd", keys, values),
                                                      jnp.sum(keys, axis=2)), axis=1)
    state = jnp.pad(state, [(0, 0), (1, 0), (0, 0), (0, 0), (0, 0)])[:, :-1]  # the blocks before, at `earlier`
    total = jnp.pad(total, [(0, 0), (1, 0), (0, 0), (0, 0)])[:, :-1]
    # Fast: one (block x block) product at the block's last shift, exact while no query's factor there exceeds
    # exp(PERFORMER_EXACT) (then keys that underflow weigh under exp(-57) of the query's largest term). Past it
    # (keys jumping inside a block), the exact pairwise sums in the log domain, whose terms are all <= 1.
    own = jax.lax.stop_gradient(jnp.max(queries + seen, axis=-1, keepdims=True))
    fast = jnp.max(jax.lax.stop_gradient(queries) + last - own) <= PERFORMER_EXACT
    within = jax.lax.cond(
        fast, lambda: jnp.einsum("bcqhm,bckhm->bchqk", query_features(queries, last, seen), keys) * jnp.tri(size),
        lambda: exact_within(queries, exponents, own) / queries.shape[-1])  # phi(q), phi(k) each carry m^-1/2
    before = query_features(queries, earlier, seen)
    numerator = (jnp.einsum("bchqk,bckhd->bcqhd", within, values)
                 + jnp.einsum("bcqhm,bchmd->bcqhd", before, state))
    normalizer = jnp.swapaxes(jnp.sum(within, axis=-1), 2, 3) + jnp.einsum("bcqhm,bchm->bcqh", before, total)
    return (numerator.reshape(batch, count * size, heads, -1)[:, :length],
            normalizer.reshape(batch, count * size, heads)[:, :length])


def exact_within(queries: Array, exponents: Array, own: Array, chunk: int = 16) -> Array:
    """causal_sums' own-block products sum_m exp(q_m + k_m - own) for keys k <= query q, of blocked query and key
    exponents [batch, count, size, heads, m] and each query's largest term `own` [..., 1]: [batch, count, heads,
    size, size]. Every term is <= 1 and exact, whatever the keys' range; the cost is size^2 x m per block, so it is
    computed a block and `chunk` features at a time, recomputed in the backward pass."""
    size, features = queries.shape[2], queries.shape[-1]
    pad = -features % chunk
    causal = jnp.tri(size, dtype=bool)[:, :, None, None]  # [q, k, 1, 1]

    def split(x, fill):  # [b, c, s, h, m] -> [m / chunk, c, b, s, h, chunk]
        x = jnp.pad(x, [(0, 0)] * 4 + [(0, pad)], constant_values=fill)
        return jnp.moveaxis(x.reshape(*x.shape[:-1], -1, chunk), (-2, 1), (0, 1))

    largest = jnp.swapaxes(own, 0, 1)[:, :, :, None]  # [c, b, q, 1, h, 1], the same for every chunk

    @jax.checkpoint
    def add(total, parts):  # total [c, b, q, k, h]
        q, k = parts
        logits = q[:, :, :, None] + k[:, :, None] - largest  # [c, b, q, k, h, chunk]
        return total + jnp.sum(jnp.exp(jnp.where(causal, logits, -jnp.inf)), axis=-1), None

    q, k = split(queries, 0.0), split(exponents, -jnp.inf)
    count, batch, heads = queries.shape[1], queries.shape[0], queries.shape[3]
    total, _ = jax.lax.scan(add, jnp.zeros((count, batch, size, size, heads), jnp.float32), (q, k))
    return jnp.transpose(total, (1, 0, 4, 2, 3))  # [b, c, h, q, k]


class PerformerAttention(MultiHeadAttention):
    """What performer's self- and cross-attention share: the random features and the reading of running sums."""

    mixes_row = "performer sums over the keys"

    @classmethod
    def checks(cls, config, field):
        return [(config.performer_features >= 1, f"performer_features={config.performer_features} must be >= 1"),
                (config.attention_dropout_rate == 0.0,
                 f"{field}='performer' forms no attention weights for attention_dropout_rate="
                 f"{config.attention_dropout_rate} to drop: set it to 0")]

    def features(self) -> Array:
        """The random features [m, head_dim], the same at every call: drawn from the run's seed and this sublayer's
        field, one draw per field shared by its layers and heads (as the Performer reference's fixed draw is
        shared), so nothing but the config is needed to rebuild them."""
        key = jax.random.fold_in(jax.random.key(self.config.seed), list(ATTENTION_FIELDS).index(self.field))
        return random_features(key, self.config.performer_features, self.config.head_dim)

    def attend_sums(self, x: Array, sums: Cache, keys: Array | None = None,
                    values: Array | None = None) -> tuple[Array, Cache]:
        """Performer over running sums, for cached decoding: queries from x [batch, n, embed] read sums {"state":
        [batch, (n,) heads, m, head_dim], "total": [batch, (n,) heads, m], "shift": the keys' [batch, n or 1,
        heads, m]} (key_sums), each query its own where they have the n axis. Given keys/values [batch, n, heads,
        head_dim], query i's own key and value first join its sums (causal self-attention: a constant state per
        step, however long the output), the shift growing to take it and the sums rescaled (causal_sums' shift,
        per position) -> (output [batch, n, embed], sums)."""
        features = self.features()
        if keys is not None:
            exponents = feature_exponents(keys, features)
            shift = jnp.maximum(sums["shift"], exponents)
            decay, new_keys = jnp.exp(sums["shift"] - shift), key_features(exponents, shift)
            sums = {"state": decay[..., None] * sums["state"]
                             + jnp.einsum("blhm,blhd->blhmd", new_keys, values.astype(jnp.float32)),
                    "total": decay * sums["total"] + new_keys, "shift": shift}
        queries = query_features(feature_exponents(self.split_heads(self.query(x)), features), sums["shift"])
        if sums["state"].ndim == 5:
            numerator = jnp.einsum("blhm,blhmd->blhd", queries, sums["state"])
            normalizer = jnp.einsum("blhm,blhm->blh", queries, sums["total"])
        else:
            numerator, normalizer = read_sums(queries, sums["state"], sums["total"])
        return self.merge_heads(normalized(numerator, normalizer, x.dtype), x), sums


@blocks.register("self_attention", "performer")
class PerformerSelfAttention(PerformerAttention):
    """Causal in the decoder (causal_sums); decoding keeps each hypothesis's running sums: {"state": [batch,
    hypotheses, heads, m, head_dim], "total": [batch, hypotheses, heads, m], "shift": the same}, whatever the
    length, which a reordering search moves to follow each hypothesis's parent."""

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, blocks.Stats]:
        keys, values = self.keys_values(x)
        attended = performer_attention(self.split_heads(self.query(x)), keys, values, inputs.self_mask,
                                       self.features())
        return self.merge_heads(attended, x), {}

    def init_cache(self, setup: CacheSetup) -> Cache:
        config = self.config
        shape = (setup.batch, setup.hypotheses, config.num_heads, config.performer_features)
        return {"state": jnp.zeros((*shape, config.head_dim), jnp.float32), "total": jnp.zeros(shape, jnp.float32),
                "shift": jnp.full(shape, -jnp.inf, jnp.float32)}

    def decode_step(self, x: Array, cache: Cache, step: Step) -> tuple[Array, Cache]:
        keys, values = self.keys_values(x)  # this position's key and value join each hypothesis's running sums
        return self.attend_sums(x, cache, keys, values)

    def reorder(self, cache: Cache, parents: Array) -> Cache:
        def follow(x):
            return jnp.take_along_axis(x, parents.reshape(*parents.shape, *[1] * (x.ndim - 2)), axis=1)
        return {name: follow(array) for name, array in cache.items()}


@blocks.register("cross_attention", "performer")
class PerformerCrossAttention(PerformerAttention):
    """Over the source's keys, padding left out; decoding keeps their sums, computed once (init_cache)."""

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, blocks.Stats]:
        keys, values = self.keys_values(inputs.encoded)
        attended = performer_attention(self.split_heads(self.query(x)), keys, values,
                                       SelfMask(inputs.source_segmentation), self.features())
        return self.merge_heads(attended, x), {}

    def init_cache(self, setup: CacheSetup) -> Cache:
        """The sums of the keys/values of the encoded source, at the shift the full pass takes: {"state": [batch,
        heads, m, head_dim], "total": [batch, heads, m], "shift": [batch, 1, heads, m]}."""
        keys, values = self.keys_values(setup.encoded)
        exponents = key_exponents(keys, self.features(), setup.source_segmentation)
        shift = key_shift(exponents, 1)
        state, total = key_sums(key_features(exponents, shift), values.astype(jnp.float32))
        return {"state": state, "total": total, "shift": shift}

    def decode_step(self, x: Array, cache: Cache, step: Step) -> tuple[Array, Cache]:
        return self.attend_sums(x, cache)[0], cache
