"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), top to bottom, in Flax NNX.

Reading order: ModelConfig -> masks -> positions -> Embedder -> MultiHeadAttention -> FeedForward ->
EncoderLayer / DecoderLayer -> LayerStack -> Transformer (encode, decode, decode_step, init_cache).

Conventions:
  * token id 0 is padding (and the decoder's start symbol, as in tensor2tensor and flax's wmt example);
  * every call takes optional `*_segmentation` / `*_position` arrays so that several sentences can be
    packed into one row: attention never crosses a segment boundary, and segment 0 is padding;
  * parameters are float32; matmuls run in `config.dtype`; logits come out in float32;
  * every parameter carries logical axis names (`vocab`, `embed`, `mlp`, `heads`); transformer/sharding.py
    alone maps them onto mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from transformer import config_files

Array = jax.Array
Cache = dict[str, Any]  # Transformer.init_cache: the source mask and, per decoder layer, its keys and values

POSITIONAL_ENCODINGS = ("sinusoidal", "learned")
# The three families built from the same layers (docs/families.md): the paper's encoder-decoder; a decoder-only
# language model over `source <sep> target` (loss on the target part); an encoder-only masked language model.
FAMILIES = ("encoder_decoder", "decoder_only", "encoder_only")
MASKED_SIDES = ("source", "target", "both")  # what encoder_only reads and masks: "both" is the pair, joined
LAYER_NORMS = ("post", "pre")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# reference: our own einsum + softmax below (supports attention dropout); xla / cudnn:
# jax.nn.dot_product_attention with that implementation (cudnn = flash attention, GPU and bf16/fp16 only).
ATTENTION_IMPLEMENTATIONS = ("reference", "xla", "cudnn")
# The attention kinds each sublayer may take (ModelConfig.encoder_attention, ...): not every kind has a meaning
# everywhere (a window over another sentence's positions, in cross-attention, has none).
ATTENTION_KINDS = {"encoder_attention": ("dense", "local", "linformer", "performer"),
                   "decoder_attention": ("dense", "local", "performer"), "cross_attention": ("dense", "performer")}
# Kinds that mix every position of a row (linformer's projection, performer's sums over the keys): one sentence
# per row (data.pack=false), which Settings checks.
ROW_KINDS = ("linformer", "performer")
# Queries per block of performer's causal prefix sums: each block's own keys are read as a (block x block) masked
# product, the earlier blocks' through their running sum, so memory grows as length / 64 sums of m x d per head.
PERFORMER_BLOCK = 64
# Performer's smallest normaliser: every query's largest term is 1/m (query_features), so only an estimate that
# float32 cannot hold falls below it; such a query reads 0, without gradient, rather than 0 / 0 (NaN).
PERFORMER_FLOOR = 1e-6
# The largest query feature exp(60), where causal_sums reads its own block's keys at a shift past the query's.
PERFORMER_CAP = 60.0
# A performer self-attention cache, per hypothesis: its running sums and the key shift they are kept at.
PERFORMER_SUMS = ("state", "total", "shift")


def partitioned(init, *names: str | None):
    """An initializer whose parameter carries logical axis names (read by sharding.py, never applied here:
    eager_sharding=False, so building a model needs no mesh)."""
    return nnx.with_partitioning(init, names, eager_sharding=False)


@config_files.section("model")
class ModelConfig:
    """Every shape and rate of the model: `config.model` (configs/default.py holds each field's default and
    meaning) plus the tokenizer's vocab_size."""

    vocab_size: int
    family: str  # one of FAMILIES
    prefix_lm: bool  # decoder_only: the source prefix attends to itself bidirectionally (t5x's prefix LM)
    masked_side: str  # encoder_only: one of MASKED_SIDES
    mask_rate: float  # encoder_only: the share of tokens masked (BERT's 15%: 80% <mask>, 10% random, 10% kept)
    emb_dim: int  # d_model
    num_heads: int  # h; d_k = d_v = emb_dim // num_heads
    num_encoder_layers: int
    num_decoder_layers: int
    mlp_dim: int  # d_ff
    dropout_rate: float  # P_drop: embeddings and each sublayer's output before the residual add
    attention_dropout_rate: float
    relu_dropout_rate: float
    positional_encoding: str
    max_length: int
    layer_norm: str
    layer_norm_epsilon: float
    share_embeddings: bool
    tie_output_embedding: bool
    dtype: str
    attention: str  # one of ATTENTION_IMPLEMENTATIONS
    encoder_attention: str  # the kind of each sublayer's attention: one of ATTENTION_KINDS
    decoder_attention: str
    cross_attention: str
    local_window: int
    linformer_length: int
    performer_features: int
    num_experts: int  # mixture of experts (MoEFeedForward): 0 for none
    expert_every: int
    experts_per_token: int
    capacity_factor: float
    eval_capacity_factor: float
    router_balance_weight: float
    router_z_weight: float
    remat: bool
    # Each stack's layers as one LayerStack (parameters with a leading `layers` axis) applied by one lax.scan, so
    # the train step compiles one layer per stack whatever the depth; the same model, another parameter layout.
    scan_layers: bool
    init_std: float
    # The run's seed (config.seed, which Settings.model_config passes; not a config.model key): performer's random
    # features are drawn from it, so a resumed, averaged or evaluated model rebuilds them from its config.
    seed: int = 0

    def __post_init__(self):
        checks = [
            (self.vocab_size > 0, f"vocab_size must be positive, got {self.vocab_size}"),
            (self.num_heads > 0 and self.emb_dim % self.num_heads == 0,
             f"num_heads={self.num_heads} must divide emb_dim={self.emb_dim}"),
            (self.positional_encoding in POSITIONAL_ENCODINGS,
             f"positional_encoding={self.positional_encoding!r} is not one of {POSITIONAL_ENCODINGS}"),
            (self.layer_norm in LAYER_NORMS, f"layer_norm={self.layer_norm!r} is not one of {LAYER_NORMS}"),
            (self.dtype in DTYPES, f"dtype={self.dtype!r} is not one of {tuple(DTYPES)}"),
            (self.attention in ATTENTION_IMPLEMENTATIONS,
             f"attention={self.attention!r} is not one of {ATTENTION_IMPLEMENTATIONS}"),
            (self.attention == "reference" or self.attention_dropout_rate == 0.0,
             f"attention={self.attention!r} has no dropout on the attention weights: set attention_dropout_rate=0 "
             "or attention='reference'"),
            (self.emb_dim % 2 == 0, f"emb_dim={self.emb_dim} must be even for sinusoidal positions"),
            (self.init_std >= 0.0, f"init_std={self.init_std} must be >= 0 (0: lecun normal)"),
            (not self.scan_layers or min(self.stack_depths.values(), default=1) >= 1,
             f"scan_layers=True needs at least one layer per stack, got num_encoder_layers={self.num_encoder_layers}, "
             f"num_decoder_layers={self.num_decoder_layers}"),
            (self.family in FAMILIES, f"family={self.family!r} is not one of {FAMILIES}"),
            (self.masked_side in MASKED_SIDES, f"masked_side={self.masked_side!r} is not one of {MASKED_SIDES}"),
            (0.0 < self.mask_rate < 1.0, f"mask_rate={self.mask_rate} must be in (0, 1)"),
        ]
        if self.family != "encoder_decoder":
            checks.append((self.share_embeddings, f"family={self.family!r} reads source and target with one "
                                                  "embedding: set share_embeddings=True"))
        if self.family == "decoder_only":
            checks += [
                (self.num_encoder_layers == 0, f"family='decoder_only' has no encoder: set num_encoder_layers=0, "
                                               f"got {self.num_encoder_layers}"),
                (self.num_decoder_layers >= 1, "family='decoder_only' needs num_decoder_layers >= 1"),
                (self.decoder_attention == "dense", f"family='decoder_only' masks the joined source and target "
                                                    f"densely: decoder_attention={self.decoder_attention!r} must be "
                                                    "'dense'"),
            ]
        elif self.family == "encoder_only":
            checks += [
                (self.num_decoder_layers == 0, f"family='encoder_only' has no decoder: set num_decoder_layers=0, "
                                               f"got {self.num_decoder_layers}"),
                (self.num_encoder_layers >= 1, "family='encoder_only' needs num_encoder_layers >= 1"),
                (self.masked_side != "both" or self.encoder_attention == "dense",
                 f"masked_side='both' joins source and target in one row: encoder_attention="
                 f"{self.encoder_attention!r} must be 'dense'"),
            ]
        for field, kinds in ATTENTION_KINDS.items():
            checks.append((getattr(self, field) in kinds, f"{field}={getattr(self, field)!r} is not one of {kinds}"))
        checks.append((self.local_window >= 1, f"local_window={self.local_window} must be >= 1"))
        checks.append((self.linformer_length >= 1, f"linformer_length={self.linformer_length} must be >= 1"))
        checks.append((self.performer_features >= 1, f"performer_features={self.performer_features} must be >= 1"))
        performers = [field for field in ATTENTION_KINDS if getattr(self, field) == "performer"]
        checks.append((not performers or self.attention_dropout_rate == 0.0,
                       f"{performers[0] if performers else ''}='performer' forms no attention weights for "
                       f"attention_dropout_rate={self.attention_dropout_rate} to drop: set it to 0"))
        if self.num_experts:
            checks += [
                (self.num_experts >= 1, f"num_experts={self.num_experts} must be >= 0"),
                (1 <= self.experts_per_token <= self.num_experts,
                 f"experts_per_token={self.experts_per_token} must be in [1, num_experts={self.num_experts}]"),
                (self.expert_every >= 1, f"expert_every={self.expert_every} must be >= 1"),
                (self.capacity_factor > 0, f"capacity_factor={self.capacity_factor} must be > 0"),
                (self.eval_capacity_factor >= 0, f"eval_capacity_factor={self.eval_capacity_factor} must be >= 0 "
                                                 "(0: no limit)"),
                (min(self.router_balance_weight, self.router_z_weight) >= 0,
                 f"router_balance_weight={self.router_balance_weight} and router_z_weight={self.router_z_weight} "
                 "must be >= 0"),
                (not self.scan_layers or self.expert_every == 1,
                 f"scan_layers=True stacks identical layers, and expert_every={self.expert_every} makes every "
                 f"{self.expert_every}th one a mixture of experts: set expert_every=1 or scan_layers=False"),
            ]
        for rate_name in ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate"):
            rate = getattr(self, rate_name)
            checks.append((0.0 <= rate < 1.0, f"{rate_name}={rate} must be in [0, 1)"))
        for ok, message in checks:
            if not ok:
                raise ValueError(f"model config: {message}")

    @property
    def stack_depths(self) -> dict[str, int]:
        """The family's stacks (Transformer's attributes) and their depths: the others are not built."""
        return {"encoder_decoder": {"encoder_layers": self.num_encoder_layers, "decoder_layers": self.num_decoder_layers},
                "decoder_only": {"decoder_layers": self.num_decoder_layers},
                "encoder_only": {"encoder_layers": self.num_encoder_layers}}.get(self.family, {})

    @property
    def joins_pair(self) -> bool:
        """Whether one row holds the source and the target joined (decoder_only; encoder_only over both sides)."""
        return self.family == "decoder_only" or (self.family == "encoder_only" and self.masked_side == "both")

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.num_heads

    @property
    def position_limit(self) -> int | None:
        """Longest input the model can represent: the learned table's size, or linformer's projected length's
        columns; sinusoids alone have no limit. A joined pair (joins_pair) numbers the target after the source, so
        each side has half the learned table."""
        if self.encoder_attention == "linformer":
            return self.max_length
        if self.positional_encoding == "learned":
            return self.max_length // 2 if self.joins_pair else self.max_length
        return None

    def is_expert_layer(self, index: int) -> bool:
        """Whether layer `index` of a stack has a mixture of experts (every expert_every-th: GShard's every other)."""
        return self.num_experts > 0 and index % self.expert_every == self.expert_every - 1

    def expert_layers(self, count: int) -> int:
        return sum(self.is_expert_layer(index) for index in range(count))

    @property
    def compute_dtype(self) -> Any:
        return DTYPES[self.dtype]

    def kernel_init(self, *names: str | None):
        return partitioned(nnx.initializers.normal(self.init_std) if self.init_std else nnx.initializers.lecun_normal(),
                           *names)


# ----------------------------------------------------------------------------------------------------
# Masks and positions


def segmentation_of(tokens: Array, segmentation: Array | None) -> Array:
    """Unpacked rows are one segment: every non-padding token is segment 1, padding is 0."""
    return (tokens != 0).astype(jnp.int32) if segmentation is None else segmentation


def positions_of(tokens: Array, positions: Array | None) -> Array:
    if positions is not None:
        return positions
    return jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)


@struct.dataclass
class SelfMask:
    """A self-attention mask by its parts, segmentation [batch, length] (0: padding) and causality, rather than as
    the [batch, 1, length, length] matrix: a kind that never forms the whole matrix (local) builds only the
    blocks it reads; `dense()` is the matrix for the others."""

    segmentation: Array
    causal: bool = struct.field(pytree_node=False, default=False)

    def dense(self) -> Array:
        return attention_mask(self.segmentation, self.segmentation, causal=self.causal)


def attention_mask(query_segmentation: Array, key_segmentation: Array, causal: bool = False) -> Array:
    """[batch, 1, q_length, k_length] bool: same segment, key not padding, (causal) key not in the future.

    Segments are contiguous within a row, so "not in the future" is a comparison of row indices.
    """
    mask = (query_segmentation[:, :, None] == key_segmentation[:, None, :]) & (key_segmentation[:, None, :] != 0)
    if causal:
        q_length, k_length = query_segmentation.shape[-1], key_segmentation.shape[-1]
        mask &= jnp.arange(q_length)[:, None] >= jnp.arange(k_length)[None, :]
    return mask[:, None, :, :]


def join_pair(source: Array, source_segmentation: Array, source_position: Array, target: Array,
              target_segmentation: Array, target_position: Array) -> tuple[Array, Array, Array]:
    """A row's sources [batch, src_length] and targets [batch, tgt_length] as one stream [batch, src_length +
    tgt_length] of (tokens, segmentation, positions), for the families that read a pair as one sequence: the
    sources, then the targets, each segment's target numbered on from its source's length (as t5x's decoder-only
    inputs number them). The halves keep packing's order, so a segment's tokens are in order within each half."""
    source_length = jnp.sum((source_segmentation[:, None, :] == target_segmentation[:, :, None])
                            & (source_segmentation[:, None, :] != 0), axis=-1)  # per target token: its source's
    return (jnp.concatenate([source, target], axis=1),
            jnp.concatenate([source_segmentation, target_segmentation], axis=1),
            jnp.concatenate([source_position, target_position + source_length.astype(target_position.dtype)], axis=1))


def prefix_lm_mask(segmentation: Array, source_length: int, prefix_lm: bool) -> Array:
    """decoder_only's [batch, 1, length, length] mask over a join_pair stream whose first source_length columns
    are sources: within a segment, every query sees the keys at or before it in the row (causal: a target sees its
    whole source and its earlier targets, a source never a target), and with prefix_lm a source also sees its
    later sources (bidirectional over the prefix)."""
    mask = attention_mask(segmentation, segmentation, causal=True)
    if prefix_lm:
        source = jnp.arange(segmentation.shape[-1]) < source_length
        mask |= attention_mask(segmentation, segmentation) & (source[:, None] & source[None, :])
    return mask


def sinusoidal_positions(positions: Array, emb_dim: int) -> Array:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...): the paper's interleaved layout.

    Computed from the positions themselves rather than a table, so decoding has no length limit.
    """
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, emb_dim, 2, dtype=jnp.float32) / emb_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, length, emb_dim / 2]
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, emb_dim)


# ----------------------------------------------------------------------------------------------------
# Layers


class Embedder(nnx.Module):
    """Token embedding scaled by sqrt(d_model), plus positions, then dropout (paper section 3.4, 3.5)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        # stddev d^-0.5 makes the sqrt(d)-scaled embedding unit-variance, and suits the tied output layer.
        init = partitioned(nnx.initializers.normal(stddev=config.init_std or config.emb_dim**-0.5), "vocab", "embed")
        self.embedding = nnx.Embed(config.vocab_size, config.emb_dim, embedding_init=init, rngs=rngs)
        if config.positional_encoding == "learned":
            self.position_embedding = nnx.Embed(
                config.max_length, config.emb_dim, embedding_init=partitioned(nnx.initializers.normal(0.02), None,
                                                                              "embed"), rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout_rate)

    def __call__(self, tokens: Array, positions: Array, *, deterministic: bool, rngs: nnx.Rngs | None) -> Array:
        """tokens, positions: [batch, length] int -> [batch, length, embed] in the compute dtype."""
        x = self.embedding(tokens) * math.sqrt(self.config.emb_dim)
        if self.config.positional_encoding == "learned":
            # Clamped: jnp.take would return NaN past the table, and padding positions of a long decode batch
            # can pass it. Real tokens never do: Settings and decode.translate keep inputs within max_length.
            x = x + self.position_embedding(jnp.minimum(positions, self.config.max_length - 1))
        else:
            x = x + sinusoidal_positions(positions, self.config.emb_dim)
        x = self.dropout(x, deterministic=deterministic, rngs=rngs)
        return x.astype(self.config.compute_dtype)

    def logits(self, x: Array) -> Array:
        """[batch, length, embed] -> [batch, length, vocab] float32, through the transposed embedding."""
        table = self.embedding.embedding[...].astype(x.dtype)
        return jnp.einsum("ble,ve->blv", x, table, preferred_element_type=jnp.float32)


def attention(implementation: str, query: Array, key: Array, value: Array, mask: Array | SelfMask,
              dropout: nnx.Dropout, *, deterministic: bool, rngs: nnx.Rngs | None, kind: str = "dense",
              window: int = 0) -> Array:
    """Scaled dot-product attention of `kind` (ATTENTION_KINDS) by `implementation` (ModelConfig.attention); same
    shapes as dot_product_attention. jax's kernels take a local kind as their local_window_size, which has our
    window's meaning (keys at distance <= window on each side the mask allows)."""
    window_size = None
    if kind == "local":
        if implementation == "reference":
            return local_attention(query, key, value, mask, window, dropout, deterministic=deterministic, rngs=rngs)
        window_size = (window, 0 if mask.causal else window)
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


def local_attention(query: Array, key: Array, value: Array, mask: SelfMask, window: int,
                    dropout: nnx.Dropout | None = None, *, deterministic: bool = True,
                    rngs: nnx.Rngs | None = None) -> Array:
    """Self-attention restricted to a neighbourhood (the paper's section 4): each query sees the keys of its own
    segment at distance <= window (causal: itself and the window positions before it). The sequence is cut into
    blocks of `window` queries, each attending to its own block and its neighbours' (the one before; causal: and
    not the one after), so time and memory grow as length * window, never length^2. Same shapes as
    dot_product_attention, with the mask by its parts; softmax in float32."""
    batch, length, _, head_dim = query.shape
    size = min(window, length)  # queries per block; a window past the length reaches every key from one block
    count, pad = -(-length // size), -length % size
    reach = (1, 0) if mask.causal else (1, 1)  # neighbouring blocks read before and after

    def blocks(x):  # [batch, length, ...] -> [batch, count, size, ...]; the padding is segment 0, never seen
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(batch, count, size, *x.shape[2:])

    def around(x):  # [batch, count, size, ...] -> [batch, count, (1 + sum(reach)) * size, ...]
        x = jnp.pad(x, [(0, 0), reach] + [(0, 0)] * (x.ndim - 2))
        return jnp.concatenate([x[:, i:i + count] for i in range(1 + sum(reach))], axis=2)

    distance = jnp.arange(size)[:, None] - jnp.arange(-size, (1 + reach[1]) * size)[None, :]  # query - key
    band = (distance <= window) & (distance >= (0 if mask.causal else -window))
    query_segment, key_segment = blocks(mask.segmentation)[..., :, None], around(blocks(mask.segmentation))
    allowed = band & (query_segment == key_segment[..., None, :]) & (key_segment[..., None, :] != 0)
    query = blocks(query) / jnp.sqrt(head_dim).astype(query.dtype)
    logits = jnp.einsum("bcqhd,bckhd->bchqk", query, around(blocks(key)).astype(query.dtype),
                        preferred_element_type=jnp.float32)
    logits = jnp.where(allowed[:, :, None], logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    if dropout is not None:
        weights = dropout(weights, deterministic=deterministic, rngs=rngs)
    attended = jnp.einsum("bchqk,bckhd->bcqhd", weights, around(blocks(value)))
    return attended.reshape(batch, count * size, *attended.shape[3:])[:, :length]


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
    within = (jnp.einsum("bcqhm,bckhm->bchqk", query_features(queries, last, seen), keys) * jnp.tri(size))
    before = query_features(queries, earlier, seen)
    numerator = (jnp.einsum("bchqk,bckhd->bcqhd", within, values)
                 + jnp.einsum("bcqhm,bchmd->bcqhd", before, state))
    normalizer = jnp.swapaxes(jnp.sum(within, axis=-1), 2, 3) + jnp.einsum("bcqhm,bchm->bcqh", before, total)
    return (numerator.reshape(batch, count * size, heads, -1)[:, :length],
            normalizer.reshape(batch, count * size, heads)[:, :length])


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
    return jnp.einsum("bhqk,bhkd->bhqd", weights, values)


def to_cache_layout(keys: Array, values: Array) -> tuple[Array, Array]:
    """keys, values [batch, length, heads, head_dim] -> keys [batch, heads, head_dim, length], values [batch, heads,
    length, head_dim]: the head-major layout of head_major_attention and of the decoding caches."""
    return jnp.transpose(keys, (0, 2, 3, 1)), jnp.transpose(values, (0, 2, 1, 3))


def blocked_attention(query: Array, key_blocks: tuple[Array, ...], value_blocks: tuple[Array, ...], mask: Array,
                      last_row: Array | int, prefix: tuple = ()) -> Array:
    """head_major_attention over a decoding cache held in blocks (Transformer.init_cache): query [batch, heads,
    q_length, head_dim]; key blocks [batch, heads, head_dim, n_i] and value blocks [batch, heads, n_i, head_dim];
    mask [batch, 1, q_length, sum n_i] -> [batch, heads, q_length, head_dim]. No dropout. prefix: () or one
    (keys, values, mask) of keys every query may read besides the blocks (decoder_only's source prefix), joined
    into the same softmax.

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


class MultiHeadAttention(nnx.Module):
    """h parallel heads of scaled dot-product attention with learned projections (paper section 3.2.2).

    Projections have no bias, as in tensor2tensor.
    """

    def __init__(self, config: ModelConfig, sublayer: str = "encoder_attention", *, rngs: nnx.Rngs):
        """sublayer: the ATTENTION_KINDS field naming this attention's kind (encoder_attention, ...)."""
        self.config, self.sublayer, self.kind = config, sublayer, getattr(config, sublayer)
        dim, dtype = config.emb_dim, config.compute_dtype
        def linear(*names):
            return nnx.Linear(dim, dim, use_bias=False, dtype=dtype, kernel_init=config.kernel_init(*names), rngs=rngs)
        self.query, self.key, self.value = linear("embed", "heads"), linear("embed", "heads"), linear("embed", "heads")
        self.output = linear("heads", "embed")
        self.dropout = nnx.Dropout(config.attention_dropout_rate)
        if self.kind == "linformer":  # Wang et al. 2020's E and F, shared by the heads: [max_length, linformer_length]
            shape = (config.max_length, config.linformer_length)
            init = config.kernel_init(None, None)
            self.key_projection = nnx.Param(init(rngs.params(), shape, jnp.float32))
            self.value_projection = nnx.Param(init(rngs.params(), shape, jnp.float32))

    def split_heads(self, x: Array) -> Array:
        return x.reshape(*x.shape[:-1], self.config.num_heads, self.config.head_dim)

    def keys_values(self, x: Array) -> tuple[Array, Array]:
        """[batch, length, embed] -> keys and values, each [batch, length, heads, head_dim]."""
        return self.split_heads(self.key(x)), self.split_heads(self.value(x))

    def __call__(self, x: Array, keys: Array, values: Array, mask: Array | SelfMask, *, deterministic: bool,
                 rngs: nnx.Rngs | None) -> Array:
        """Queries from x [batch, q_length, embed] over given keys/values -> [batch, q_length, embed]."""
        if self.kind == "performer":
            attended = performer_attention(self.split_heads(self.query(x)), keys, values, mask, self.features())
            return self.output(attended.reshape(*x.shape[:-1], self.config.emb_dim))
        if self.kind == "linformer":
            keys, values, mask = self.project(keys, values, mask)
        attended = attention(self.config.attention, self.split_heads(self.query(x)), keys, values, mask,
                             self.dropout, deterministic=deterministic, rngs=rngs, kind=self.kind,
                             window=self.config.local_window)
        return self.output(attended.reshape(*x.shape[:-1], self.config.emb_dim))

    def project(self, keys: Array, values: Array, mask: SelfMask) -> tuple[Array, Array, Array]:
        """Linformer: keys and values [batch, length, heads, head_dim] projected along the length to
        linformer_length rows, padding positions zeroed first so that they add nothing; every query sees every
        projected row. One sentence per row (Settings refuses packing): the projection mixes positions."""
        length, dtype = keys.shape[1], keys.dtype
        real = (mask.segmentation != 0)[:, :, None, None].astype(dtype)
        def projected(x, table):
            return jnp.einsum("blhd,lk->bkhd", x * real, table[:length].astype(dtype))
        keys, values = projected(keys, self.key_projection[...]), projected(values, self.value_projection[...])
        return keys, values, jnp.ones((keys.shape[0], 1, 1, keys.shape[1]), bool)

    def features(self) -> Array:
        """Performer's random features [m, head_dim], the same at every call: drawn from the run's seed and this
        sublayer's name, one draw per kind of sublayer shared by its layers and heads (as the Performer
        reference's fixed draw is shared), so nothing but the config is needed to rebuild them."""
        key = jax.random.fold_in(jax.random.key(self.config.seed), list(ATTENTION_KINDS).index(self.sublayer))
        return random_features(key, self.config.performer_features, self.config.head_dim)

    def key_sums(self, keys: Array, values: Array, segmentation: Array) -> dict[str, Array]:
        """Performer's sums of keys/values [batch, length, heads, head_dim], padding (segmentation 0) left out, at
        the shift the full pass takes: what cross-attention reads at every decoding step, computed once ->
        {"state": [batch, heads, m, head_dim], "total": [batch, heads, m], "shift": [batch, 1, heads, m]}."""
        exponents = key_exponents(keys, self.features(), segmentation)
        shift = key_shift(exponents, 1)
        state, total = key_sums(key_features(exponents, shift), values.astype(jnp.float32))
        return {"state": state, "total": total, "shift": shift}

    def attend_sums(self, x: Array, sums: dict[str, Array], keys: Array | None = None,
                    values: Array | None = None) -> tuple[Array, dict[str, Array]]:
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
        attended = normalized(numerator, normalizer, x.dtype)
        return self.output(attended.reshape(*x.shape[:-1], self.config.emb_dim)), sums

    def attend_cache(self, x: Array, key_blocks: tuple[Array, ...], value_blocks: tuple[Array, ...], mask: Array,
                     last_row: Array | int = 0, prefix: tuple = ()) -> Array:
        """As __call__, over keys/values of a decoding cache (blocked_attention, with its prefix). Cached decoding
        always takes this path, whatever config.attention: jax's kernels have no form for a few queries over a
        cache."""
        query = jnp.transpose(self.split_heads(self.query(x)), (0, 2, 1, 3))
        attended = jnp.transpose(blocked_attention(query, key_blocks, value_blocks, mask, last_row, prefix),
                                 (0, 2, 1, 3))
        return self.output(attended.reshape(*x.shape[:-1], self.config.emb_dim))


class FeedForward(nnx.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (paper section 3.3), with relu dropout between."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dtype, bias = config.compute_dtype, nnx.initializers.zeros_init()
        self.hidden = nnx.Linear(config.emb_dim, config.mlp_dim, dtype=dtype, rngs=rngs,
                                 kernel_init=config.kernel_init("embed", "mlp"), bias_init=partitioned(bias, "mlp"))
        self.output = nnx.Linear(config.mlp_dim, config.emb_dim, dtype=dtype, rngs=rngs,
                                 kernel_init=config.kernel_init("mlp", "embed"), bias_init=partitioned(bias, "embed"))
        self.dropout = nnx.Dropout(config.relu_dropout_rate)

    def __call__(self, x: Array, *, deterministic: bool, rngs: nnx.Rngs | None) -> Array:
        hidden = self.dropout(jax.nn.relu(self.hidden(x)), deterministic=deterministic, rngs=rngs)
        return self.output(hidden)


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


class MoEFeedForward(nnx.Module):
    """A mixture of experts in place of the feed-forward: num_experts FeedForwards (weights [experts, ...], the
    `expert` logical axis, which mesh.rules may map to the mesh's expert axis) and a float32 router; each token
    goes to its experts_per_token best within capacity (route), its output the gate-weighted sum of theirs.
    Rows are the routing groups: capacity is per row, so a step's dispatch tensors are [batch, length, experts,
    capacity], local to the devices that hold the row."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
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

    def __call__(self, x: Array, real: Array, *, deterministic: bool, rngs: nnx.Rngs | None,
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
        hidden = self.dropout(jax.nn.relu(hidden.astype(dtype)), deterministic=deterministic, rngs=rngs)
        outputs = (jnp.einsum("becf,efd->becd", hidden, self.output[...].astype(dtype))
                   + self.output_bias[...][:, None]).astype(dtype)
        return jnp.einsum("blec,becd->bld", combine.astype(dtype), outputs).astype(x.dtype), stats


def feed_forward(config: ModelConfig, index: int, rngs: nnx.Rngs) -> nnx.Module:
    return MoEFeedForward(config, rngs=rngs) if config.is_expert_layer(index) else FeedForward(config, rngs=rngs)


def layer_norm(config: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(config.emb_dim, epsilon=config.layer_norm_epsilon, dtype=config.compute_dtype,
                         scale_init=partitioned(nnx.initializers.ones_init(), "embed"),
                         bias_init=partitioned(nnx.initializers.zeros_init(), "embed"), rngs=rngs)


class Residual(nnx.Module):
    """Add & norm around one sublayer: post-LN LayerNorm(x + Dropout(f(x))), or pre-LN x + Dropout(f(LayerNorm(x)))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.pre_norm = config.layer_norm == "pre"
        self.norm = layer_norm(config, rngs)
        self.dropout = nnx.Dropout(config.dropout_rate)

    def __call__(self, x: Array, sublayer, *, deterministic: bool, rngs: nnx.Rngs | None) -> Array:
        y = sublayer(self.norm(x) if self.pre_norm else x)
        x = x + self.dropout(y, deterministic=deterministic, rngs=rngs)
        return x if self.pre_norm else self.norm(x)


class EncoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, index: int = 0):
        self.self_attention = MultiHeadAttention(config, "encoder_attention", rngs=rngs)
        self.self_attention_residual = Residual(config, rngs=rngs)
        self.feed_forward = feed_forward(config, index, rngs)
        self.feed_forward_residual = Residual(config, rngs=rngs)

    def __call__(self, x: Array, mask: Array | SelfMask, real: Array, *, deterministic: bool,
                 rngs: nnx.Rngs | None) -> tuple[Array, Array]:
        """x [batch, length, embed], real [batch, length] (not padding) -> ([batch, length, embed], router stats)."""
        kw = dict(deterministic=deterministic, rngs=rngs)
        def attend(y):
            return self.self_attention(y, *self.self_attention.keys_values(y), mask, **kw)
        x = self.self_attention_residual(x, attend, **kw)
        return feed_forward_sublayer(self, x, real, kw)


def feed_forward_sublayer(layer: nnx.Module, x: Array, real: Array | None, kw: dict) -> tuple[Array, Array]:
    """A layer's last sublayer, the (mixture of experts or dense) feed-forward in its residual -> (x, router stats;
    zeros for the dense one). real None (cached decoding): every token, without capacity: a step holds a row's few
    hypotheses, and a capacity would make one hypothesis's output depend on which experts the others chose."""
    stats = [jnp.zeros(len(ROUTER_STATS), jnp.float32)]
    def feed(y):
        if not isinstance(layer.feed_forward, MoEFeedForward):
            return layer.feed_forward(y, **kw)
        dropless = real is None
        y, stats[0] = layer.feed_forward(y, jnp.ones(y.shape[:2], bool) if dropless else real, dropless=dropless,
                                         **kw)
        return y
    x = layer.feed_forward_residual(x, feed, **kw)
    return x, stats[0]


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, index: int = 0):
        self.self_attention = MultiHeadAttention(config, "decoder_attention", rngs=rngs)
        self.self_attention_residual = Residual(config, rngs=rngs)
        self.has_cross_attention = config.family == "encoder_decoder"  # decoder_only: self-attention alone
        if self.has_cross_attention:
            self.cross_attention = MultiHeadAttention(config, "cross_attention", rngs=rngs)
            self.cross_attention_residual = Residual(config, rngs=rngs)
        self.feed_forward = feed_forward(config, index, rngs)
        self.feed_forward_residual = Residual(config, rngs=rngs)

    def init_cache(self, encoded: Array, source_segmentation: Array, rows: int, blocks: int,
                   hypotheses: int) -> dict[str, Any]:
        """This layer's part of Transformer.init_cache: an empty self-attention cache of `rows` rows in `blocks`
        equal arrays (performer: zero running sums per hypothesis), and what cross-attention reads of encoded
        [batch, src_length, embed]: its keys/values (performer: their sums, padding left out); without
        cross-attention (decoder_only) the prefix's keys/values come from Transformer.init_cache instead."""
        batch, config = encoded.shape[0], self.self_attention.config
        cache = {}
        if self.self_attention.kind == "performer":
            shape = (batch, hypotheses, config.num_heads, config.performer_features)
            cache.update(state=jnp.zeros((*shape, config.head_dim), jnp.float32), total=jnp.zeros(shape, jnp.float32),
                         shift=jnp.full(shape, -jnp.inf, jnp.float32))
        else:
            length, dtype = rows // blocks, config.compute_dtype
            cache.update(key=tuple(jnp.zeros((batch, config.num_heads, config.head_dim, length), dtype)
                                   for _ in range(blocks)),
                         value=tuple(jnp.zeros((batch, config.num_heads, length, config.head_dim), dtype)
                                     for _ in range(blocks)))
        if not self.has_cross_attention:
            return cache
        keys, values = self.cross_attention.keys_values(encoded)
        if self.cross_attention.kind == "performer":
            sums = self.cross_attention.key_sums(keys, values, source_segmentation)
            cache.update({f"cross_{name}": array for name, array in sums.items()})
        else:
            cache["cross_key"], cache["cross_value"] = to_cache_layout(keys, values)
        return cache

    def __call__(self, x: Array, encoded: Array | None, self_mask: Array, cross_mask: Array, real: Array | None, *,
                 deterministic: bool, rngs: nnx.Rngs | None, cache: dict[str, Any] | None = None,
                 cache_index: Array | None = None, keep_keys: bool = False
                 ) -> tuple[Array, dict[str, Any] | None, Array]:
        """x [batch, length, embed], encoded [batch, src_length, embed], real [batch, length] (not padding; None:
        every position) -> ([batch, length, embed], cache, router stats).

        With a cache (init_cache), x holds the queries of cache rows cache_index ... cache_index + length - 1
        (they lie in one block): their keys/values are written there, each query attends to the cache rows
        self_mask shows it, and cross-attention reads the keys/values computed once by init_cache (encoded unused).
        Without cross-attention (decoder_only), a cache's "prefix_key"/"prefix_value" are the source prefix's,
        which every query reads where cross_mask [batch, 1, 1, src_length] shows them; keep_keys (no cache)
        returns this pass's self-attention keys/values as such a prefix.
        """
        kw = dict(deterministic=deterministic, rngs=rngs)

        def self_attend(y):
            nonlocal cache
            keys, values = self.self_attention.keys_values(y)
            if cache is None:
                if keep_keys:
                    cache = dict(zip(("prefix_key", "prefix_value"), to_cache_layout(keys, values)))
                return self.self_attention(y, keys, values, self_mask, **kw)
            if "state" in cache:  # performer: this position's key and value join each hypothesis's running sums
                y, sums = self.self_attention.attend_sums(y, {name: cache[name] for name in PERFORMER_SUMS},
                                                          keys, values)
                cache = {**cache, **sums}
                return y
            keys, values = to_cache_layout(keys, values)
            cache = {**cache, "key": write_cache_rows(cache["key"], keys, 3, cache_index),
                     "value": write_cache_rows(cache["value"], values, 2, cache_index)}
            prefix = ((cache["prefix_key"], cache["prefix_value"], cross_mask),) if "prefix_key" in cache else ()
            return self.self_attention.attend_cache(y, cache["key"], cache["value"], self_mask,
                                                    cache_index + y.shape[1] - 1, prefix)

        def cross_attend(y):
            if cache is None:
                return self.cross_attention(y, *self.cross_attention.keys_values(encoded), cross_mask, **kw)
            if "cross_state" in cache:
                return self.cross_attention.attend_sums(
                    y, {name: cache[f"cross_{name}"] for name in PERFORMER_SUMS})[0]
            return self.cross_attention.attend_cache(y, (cache["cross_key"],), (cache["cross_value"],), cross_mask)

        x = self.self_attention_residual(x, self_attend, **kw)
        if self.has_cross_attention:
            x = self.cross_attention_residual(x, cross_attend, **kw)
        x, stats = feed_forward_sublayer(self, x, real, kw)
        return x, cache, stats


# The leading axis of a LayerStack's parameters: the logical name sharding.py's rules keep whole.
LAYER_AXIS = "layers"
_LAYER_METADATA = {nnx.PARTITION_NAME: LAYER_AXIS}


class LayerStack(nnx.Module):
    """`count` layers of one kind held as one module whose parameters have a leading `layers` axis (built with
    nnx.vmap over split rngs, as flax's scan-over-layers guide does), for ModelConfig.scan_layers.

    `scan` applies the layers in turn under one jax.lax.scan, so a step traces and compiles a single layer however
    deep the stack. Indexing and iterating give each layer as its own module, a view of its slice of the
    parameters, so cached decoding (init_cache, and run_layers with caches) reads a stack as it reads a list.
    """

    def __init__(self, layer: type[nnx.Module], config: ModelConfig, count: int, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=count)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYER_METADATA)
        def create(rngs):
            return layer(config, rngs=rngs)
        self.stacked = create(rngs)
        self.count = count

    def __len__(self) -> int:
        return self.count

    @staticmethod
    def _view(graphdef: nnx.GraphDef, layer_state: nnx.State) -> nnx.Module:
        # The slice's variables are fresh copies (jax.tree.map), so dropping `layers` from their axis names leaves
        # the stack's own metadata as it is.
        return nnx.merge(graphdef, nnx.spmd.remove_axis(layer_state, 0, _LAYER_METADATA))

    def __getitem__(self, index: int) -> nnx.Module:
        if not -self.count <= index < self.count:
            raise IndexError(f"layer {index} of a stack of {self.count}")
        graphdef, state = nnx.split(self.stacked)
        return self._view(graphdef, jax.tree.map(lambda x: x[index], state))

    def __iter__(self):
        graphdef, state = nnx.split(self.stacked)
        return iter([self._view(graphdef, jax.tree.map(lambda x, i=i: x[i], state)) for i in range(self.count)])

    def scan(self, call, x: Array, *, rngs: nnx.Rngs | None) -> tuple[Array, Array]:
        """x, stats = call(layer, x, layer_rngs) through each layer in turn, in one jax.lax.scan -> (x, the sum of
        the layers' router stats). Layer i draws its dropout from its own key, the i-th of a split of one draw from
        `rngs` (None: no randomness)."""
        graphdef, state = nnx.split(self.stacked)
        keys = None if rngs is None else jax.random.split(rngs.dropout(), self.count)

        def body(carry, inputs):
            (x, total), (layer_state, key) = carry, inputs
            layer_rngs = None if key is None else nnx.Rngs(dropout=key)
            x, stats = call(self._view(graphdef, layer_state), x, layer_rngs)
            return (x, total + stats), None
        return jax.lax.scan(body, (x, jnp.zeros(len(ROUTER_STATS), jnp.float32)), (state, keys))[0]


def run_layers(layers: nnx.List | LayerStack, call, x: Array, rngs: nnx.Rngs | None,
               caches: list | None = None) -> tuple[Array, list | None, Array]:
    """x, cache, stats = call(layer, x, rngs, cache) through each layer in turn -> (x, the layers' new caches, the
    sum of their router stats). Without caches (None to each call): one lax.scan over a LayerStack, a loop over a
    list. With caches (cached decoding, one per layer), a loop either way: a LayerStack gives each layer as a view
    of its slice."""
    if caches is None and isinstance(layers, LayerStack):
        def scanned(layer, x, rngs):
            x, _, stats = call(layer, x, rngs, None)
            return x, stats
        x, total = layers.scan(scanned, x, rngs=rngs)
        return x, None, total
    new_caches, total = [], jnp.zeros(len(ROUTER_STATS), jnp.float32)
    for layer, cache in zip(layers, [None] * len(layers) if caches is None else caches, strict=True):
        x, cache, stats = call(layer, x, rngs, cache)
        new_caches.append(cache)
        total = total + stats
    return x, None if caches is None else new_caches, total


def stack_layer_params(params: dict) -> dict:
    """Parameters (a pure dict, as TrainState.params) of a model without scan_layers -> the same model's parameters
    for scan_layers=True: each stack's per-layer trees {0: ..., 1: ...} as one {"stacked": ...} tree whose arrays
    gain a leading layer axis."""
    def stack(layers):
        return {"stacked": jax.tree.map(lambda *xs: jnp.stack(xs), *(layers[i] for i in range(len(layers))))}
    return {**params, **{name: stack(params[name]) for name in ("encoder_layers", "decoder_layers") if name in params}}


def unstack_layer_params(params: dict) -> dict:
    """The inverse of stack_layer_params: scan_layers=True parameters -> per-layer ones."""
    def unstack(stack):
        count = jax.tree.leaves(stack["stacked"])[0].shape[0]
        return {i: jax.tree.map(lambda x, i=i: x[i], stack["stacked"]) for i in range(count)}
    return {**params, **{name: unstack(params[name]) for name in ("encoder_layers", "decoder_layers")
                         if name in params}}


class Transformer(nnx.Module):
    """Encoder-decoder with shared embeddings: `encode`, `decode` (teacher-forced), and for incremental decoding
    `init_cache` and `decode_step`, which every search uses. config.family builds the same layers as a
    decoder-only language model over `source <sep> target` (the same four calls) or an encoder-only masked
    language model (`__call__` and `encode`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.target_embedder = Embedder(config, rngs=rngs)
        self.source_embedder = self.target_embedder if config.share_embeddings else Embedder(config, rngs=rngs)
        if not config.tie_output_embedding:
            self.output_projection = nnx.Linear(
                config.emb_dim, config.vocab_size, use_bias=False, dtype=config.compute_dtype,
                preferred_element_type=jnp.float32,
                kernel_init=config.kernel_init("embed", "vocab"), rngs=rngs)
        # The family's stacks only (ModelConfig.stack_depths): decoder_only has no encoder, encoder_only no decoder.
        for name, depth in config.stack_depths.items():
            layer = EncoderLayer if name == "encoder_layers" else DecoderLayer
            setattr(self, name, LayerStack(layer, config, depth, rngs=rngs) if config.scan_layers else
                    nnx.List([layer(config, rngs=rngs, index=index) for index in range(depth)]))
            if config.layer_norm == "pre":  # pre-LN leaves the residual stream unnormalised: close each stack
                setattr(self, name.replace("_layers", "_norm"), layer_norm(config, rngs))

    def encode(self, inputs: Array, *, inputs_segmentation: Array | None = None, inputs_position: Array | None = None,
               deterministic: bool = True, rngs: nnx.Rngs | None = None) -> Array:
        """inputs [batch, src_length] int -> encoded [batch, src_length, embed]: the encoder's outputs
        (decoder_only: the embedded source prefix, which init_cache runs through the decoder)."""
        if self.config.family == "decoder_only":
            return self.target_embedder(inputs, positions_of(inputs, inputs_position), deterministic=deterministic,
                                        rngs=rngs)
        return self._encode(inputs, inputs_segmentation, inputs_position, deterministic, rngs)[0]

    def _encode(self, inputs, inputs_segmentation, inputs_position, deterministic, rngs) -> tuple[Array, Array]:
        segmentation = segmentation_of(inputs, inputs_segmentation)
        mask, real = SelfMask(segmentation), segmentation != 0
        if self.config.encoder_attention == "dense":  # the matrix once for the stack, not once per layer
            mask = mask.dense()
        x = self.source_embedder(inputs, positions_of(inputs, inputs_position), deterministic=deterministic, rngs=rngs)
        def layer_call(layer, x, rngs, cache):
            x, stats = self._maybe_remat(layer, deterministic)(x, mask, real, rngs=rngs)
            return x, cache, stats
        x, _, stats = run_layers(self.encoder_layers, layer_call, x, rngs)
        return (self.encoder_norm(x) if self.config.layer_norm == "pre" else x), stats

    def decode(self, decoder_inputs: Array, encoded: Array, inputs: Array, *,
               inputs_segmentation: Array | None = None, targets_segmentation: Array | None = None,
               targets_position: Array | None = None, deterministic: bool = True,
               rngs: nnx.Rngs | None = None) -> Array:
        """Teacher-forced decoder: decoder_inputs [batch, tgt_length] (targets shifted right) -> float32 logits
        [batch, tgt_length, vocab]. `inputs` (or inputs_segmentation) supplies the source padding mask.

        Without targets_segmentation every position is a query (position 0 holds the start symbol 0).
        """
        return self._decode(decoder_inputs, encoded, inputs, inputs_segmentation, targets_segmentation,
                            targets_position, deterministic, rngs)[0]

    def _decode(self, decoder_inputs, encoded, inputs, inputs_segmentation, targets_segmentation, targets_position,
                deterministic, rngs) -> tuple[Array, Array]:
        source_segmentation = segmentation_of(inputs, inputs_segmentation)
        if targets_segmentation is None:
            targets_segmentation = jnp.ones_like(decoder_inputs)
            # An unpacked row's real positions for routing: the start symbol, then its nonzero inputs.
            real = (decoder_inputs != 0) | (jnp.arange(decoder_inputs.shape[1]) == 0)
        else:
            real = targets_segmentation != 0
        self_mask = SelfMask(targets_segmentation, causal=True)
        if self.config.decoder_attention == "dense":
            self_mask = self_mask.dense()
        cross_mask = attention_mask(targets_segmentation, source_segmentation)
        if self.config.cross_attention == "performer":  # the keys' padding, never a [q, k] matrix
            cross_mask = SelfMask(source_segmentation)
        positions = positions_of(decoder_inputs, targets_position)
        x = self.target_embedder(decoder_inputs, positions, deterministic=deterministic, rngs=rngs)
        x, _, stats = self._decoder_stack(x, encoded, self_mask, cross_mask, real, deterministic=deterministic,
                                          rngs=rngs)
        return self.logits(x), stats

    def _decoder_stack(self, x: Array, encoded: Array | None, self_mask: Array, cross_mask: Array,
                       real: Array | None, *, deterministic: bool, rngs: nnx.Rngs | None, caches: list | None = None,
                       cache_index: Array | None = None) -> tuple[Array, list | None, Array]:
        """The decoder layers in turn, for `decode` (teacher-forced; under nnx.remat when config.remat) and
        `decode_step` (with the layers' caches: see DecoderLayer) -> (x, caches, router stats)."""
        def layer_call(layer, x, rngs, cache):
            if cache is None:
                return self._maybe_remat(layer, deterministic)(x, encoded, self_mask, cross_mask, real, rngs=rngs)
            return layer(x, None, self_mask, cross_mask, real, deterministic=True, rngs=None, cache=cache,
                         cache_index=cache_index)
        return run_layers(self.decoder_layers, layer_call, x, rngs, caches)

    def _maybe_remat(self, layer: nnx.Module, deterministic: bool):
        """The layer's call, under nnx.remat when config.remat: its activations are recomputed in the backward
        pass instead of stored (per-layer checkpointing, as in flax's wmt example)."""
        def call(layer, rngs, *args):  # positional only: nnx.remat resolves no keyword arguments
            return layer(*args, deterministic=deterministic, rngs=rngs)
        wrapped = nnx.remat(call) if self.config.remat else call
        return lambda *args, rngs: wrapped(layer, rngs, *args)

    def _decode_joined(self, inputs, decoder_inputs, inputs_segmentation, inputs_position, targets_segmentation,
                       targets_position, deterministic, rngs) -> tuple[Array, Array]:
        """decoder_only's teacher-forced pass: the sources and the shifted targets (whose start symbol 0 is the
        `<sep>`) joined into one stream (join_pair) under prefix_lm_mask -> (logits of the target part [batch,
        tgt_length, vocab], router stats)."""
        source_segmentation = segmentation_of(inputs, inputs_segmentation)
        if targets_segmentation is None:  # unpacked: as _decode, every target position is a query
            targets_segmentation = jnp.ones_like(decoder_inputs)
            target_real = (decoder_inputs != 0) | (jnp.arange(decoder_inputs.shape[1]) == 0)
        else:
            target_real = targets_segmentation != 0
        tokens, segmentation, positions = join_pair(
            inputs, source_segmentation, positions_of(inputs, inputs_position), decoder_inputs, targets_segmentation,
            positions_of(decoder_inputs, targets_position))
        mask = prefix_lm_mask(segmentation, inputs.shape[1], self.config.prefix_lm)
        real = jnp.concatenate([source_segmentation != 0, target_real], axis=1)
        x = self.target_embedder(tokens, positions, deterministic=deterministic, rngs=rngs)
        x, _, stats = self._decoder_stack(x, None, mask, None, real, deterministic=deterministic, rngs=rngs)
        return self.logits(x[:, inputs.shape[1]:]), stats

    def __call__(self, inputs: Array, decoder_inputs: Array | None = None, *, inputs_segmentation: Array | None = None,
                 inputs_position: Array | None = None, targets_segmentation: Array | None = None,
                 targets_position: Array | None = None, deterministic: bool = True,
                 rngs: nnx.Rngs | None = None, with_router_stats: bool = False) -> Array | tuple[Array, dict]:
        """The training pass: logits [batch, tgt_length, vocab] float32 of the targets (encoder_only, which takes
        no decoder_inputs: of every position of `inputs`, its masked stream); with_router_stats: (logits, the
        ROUTER_STATS of route() averaged over the model's expert layers, {} when it has none)."""
        config = self.config
        if config.family == "decoder_only":
            logits, stats = self._decode_joined(inputs, decoder_inputs, inputs_segmentation, inputs_position,
                                                targets_segmentation, targets_position, deterministic, rngs)
        else:
            encoded, stats = self._encode(inputs, inputs_segmentation, inputs_position, deterministic, rngs)
            if config.family == "encoder_only":  # the masked language model's head: the tied embedding
                logits = self.output(encoded)
            else:
                logits, decoder_stats = self._decode(decoder_inputs, encoded, inputs, inputs_segmentation,
                                                     targets_segmentation, targets_position, deterministic, rngs)
                stats = stats + decoder_stats
        if not with_router_stats:
            return logits
        layers = config.expert_layers(config.num_encoder_layers) + config.expert_layers(config.num_decoder_layers)
        if not layers:
            return logits, {}
        return logits, dict(zip(ROUTER_STATS, stats / layers))

    def logits(self, x: Array) -> Array:
        """The decoder's outputs [batch, length, embed] -> float32 logits [batch, length, vocab]."""
        return self.output(self.decoder_norm(x) if self.config.layer_norm == "pre" else x)

    def output(self, x: Array) -> Array:
        """The pre-softmax projection of normalised outputs: the tied embedding, or its own matrix."""
        if self.config.tie_output_embedding:
            return self.target_embedder.logits(x)
        return self.output_projection(x)  # accumulated in float32 (preferred_element_type)

    def init_cache(self, encoded: Array, inputs: Array, max_decode_length: int, *, hypotheses: int = 1,
                   blocks: int = 1) -> Cache:
        """The decoding cache of `hypotheses` hypotheses per source sentence (inputs [batch, src_length], encoded
        its `encode`), each of up to max_decode_length positions: the source mask; per decoder layer the
        cross-attention keys/values, computed once for the whole decode, and an empty self-attention cache of
        hypotheses x positions rows, position-major (row t * hypotheses + j: position t of hypothesis j), in
        to_cache_layout. The positions are rounded up to a multiple of `blocks`, the arrays each layer's rows
        are held in; a step reads only the blocks written so far (blocked_attention). With local decoder
        self-attention the cache is a ring of the window's local_window + 1 positions (one block), overwritten in
        turn: its memory does not grow with the output's length; with performer's, it is each hypothesis's running
        sums, of constant size (and performer cross-attention keeps the sums of the keys/values, not them)."""
        if blocks < 1:
            raise ValueError(f"blocks={blocks} must be >= 1")
        positions = max_decode_length
        if self.config.decoder_attention == "local" and self.config.local_window + 1 < max_decode_length:
            positions, blocks = self.config.local_window + 1, 1
        rows = -(-positions // blocks) * blocks * hypotheses
        cache = {"source_mask": (inputs != 0)[:, None, None, :],
                 "layers": [layer.init_cache(encoded, inputs != 0, rows, blocks, hypotheses)
                            for layer in self.decoder_layers]}
        if self.config.family == "decoder_only":
            cache = self._prefill(encoded, inputs, cache)
        return cache

    def _prefill(self, embedded: Array, inputs: Array, cache: Cache) -> Cache:
        """decoder_only: the source prefix (embedded: `encode`) through the decoder once, as the teacher-forced
        pass runs it (a source never sees a target, so its states are the same), keeping each layer's keys/values
        for every step to read, and each row's prefix length, which numbers the steps' positions on from it."""
        segmentation = (inputs != 0).astype(jnp.int32)
        mask = attention_mask(segmentation, segmentation, causal=not self.config.prefix_lm)
        x, layers = embedded, []
        for layer, layer_cache in zip(self.decoder_layers, cache["layers"], strict=True):
            x, prefix, _ = layer(x, None, mask, None, segmentation != 0, deterministic=True, rngs=None,
                                 keep_keys=True)
            layers.append({**layer_cache, **prefix})
        return {**cache, "layers": layers, "prefix_length": jnp.sum(segmentation, axis=1)}

    def decode_step(self, tokens: Array, position: Array, cache: Cache, *,
                    history: Array | None = None) -> tuple[Array, Cache]:
        """One decoding position of every hypothesis: tokens [batch, hypotheses] (each one's previous output, 0 at
        the start), position a scalar -> (logits [batch, hypotheses, vocab] float32, the cache with this
        position's keys/values written).

        history [batch, hypotheses, <= max_decode_length] int says, for each hypothesis and earlier position, which
        hypothesis's rows hold it (default: its own), so a search that reorders its hypotheses (beam search) moves
        this table rather than every layer's cache.
        """
        positions = jnp.full(tokens.shape, position, jnp.int32)
        if "prefix_length" in cache:  # decoder_only: the target is numbered on from its source prefix (join_pair)
            positions = positions + cache["prefix_length"][:, None]
        x = self.target_embedder(tokens, positions, deterministic=True, rngs=None)
        if self.config.decoder_attention == "performer":
            return self._performer_step(x, position, cache, history)
        batch, count = tokens.shape
        slots = sum(block.shape[-1] for block in cache["layers"][0]["key"]) // count  # positions the cache holds
        # The cache is a ring of `slots` positions (as many as the decode's, unless local attention keeps fewer):
        # the position each slot holds after this step's write, negative where none has been written.
        held = position - (position - jnp.arange(slots)) % slots
        written = held >= 0
        if self.config.decoder_attention == "local":
            written &= held >= position - self.config.local_window
        if history is None:  # each hypothesis's rows are its own: [1, count, slots, count]
            owner = jnp.broadcast_to(jnp.arange(count)[None, :, None], (1, count, slots))
        else:  # the hypothesis whose rows hold each slot's position, for each hypothesis: [batch, count, slots]
            owner = jnp.take(history, jnp.maximum(held, 0), axis=2)
        visible = written[:, None] & (owner[..., None] == jnp.arange(count))
        self_mask = jnp.broadcast_to(visible, (batch, count, slots, count)).reshape(batch, 1, count, slots * count)
        x, layers, _ = self._decoder_stack(x, None, self_mask, cache["source_mask"], None, deterministic=True,
                                           rngs=None, caches=cache["layers"], cache_index=position % slots * count)
        return self.logits(x), {**cache, "layers": layers}

    def _performer_step(self, x: Array, position: Array, cache: Cache,
                        history: Array | None) -> tuple[Array, Cache]:
        """decode_step with performer self-attention: each hypothesis's cache is its running sums, so a reordering
        search's hypothesis takes its parent's, the hypothesis whose rows hold its previous position (history)."""
        layers = cache["layers"]
        if history is not None:
            parents = jnp.take(history, jnp.maximum(position - 1, 0), axis=2)  # [batch, hypotheses]
            def follow(x):
                return jnp.take_along_axis(x, parents.reshape(*parents.shape, *[1] * (x.ndim - 2)), axis=1)
            layers = [{**layer, **{name: follow(layer[name]) for name in PERFORMER_SUMS}} for layer in layers]
        x, layers, _ = self._decoder_stack(x, None, None, cache["source_mask"], None, deterministic=True, rngs=None,
                                           caches=layers, cache_index=position)
        return self.logits(x), {**cache, "layers": layers}
