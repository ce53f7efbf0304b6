"""ModelConfig: every shape and rate of the model, checked by a table of checks and by each block kind's own."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer import config_files
from transformer.model import blocks

POSITIONAL_ENCODINGS = ("sinusoidal", "learned")
# The three families built from the same layers (docs/families.md): the paper's encoder-decoder; a decoder-only
# language model over `source <sep> target` (loss on the target part); an encoder-only masked language model.
FAMILIES = ("encoder_decoder", "decoder_only", "encoder_only")
MASKED_SIDES = ("source", "target", "both")  # what encoder_only reads and masks: "both" is the pair, joined
LAYER_NORMS = ("post", "pre")
ACTIVATIONS = ("relu", "swish", "gelu")  # the feed-forward's (feed_forward.ACTIVATION_FUNCTIONS)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# reference: our own einsum + softmax (supports attention dropout); xla / cudnn: jax.nn.dot_product_attention with
# that implementation (cudnn = flash attention, GPU and bf16/fp16 only).
ATTENTION_IMPLEMENTATIONS = ("reference", "xla", "cudnn")
# The fields naming attention kinds, each with the role of its blocks and the stack they are in. The order numbers
# the fields (performer draws its features per field).
ATTENTION_FIELDS = {"encoder_attention": ("self_attention", "encoder"),
                    "decoder_attention": ("self_attention", "decoder"),
                    "cross_attention": ("cross_attention", "decoder")}


def partitioned(init, *names: str | None):
    """An initializer whose parameter carries logical axis names (read by sharding.py, never applied here:
    eager_sharding=False, so building a model needs no mesh)."""
    return nnx.with_partitioning(init, names, eager_sharding=False)


def accumulated_dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """nnx.Linear's dot_general: products accumulated in float32 and returned in the inputs' dtype. For bfloat16
    inputs this is what accelerators do anyway, and it is the form XLA's CPU backend runs as a bfloat16 matmul: a
    bfloat16-out dot it rewrites into a float32 one (base greedy, decode.weights=bfloat16: docs/benchmarks.md)."""
    del preferred_element_type  # Linear's None: always float32 here
    out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=jnp.float32,
                              **kwargs)
    return out.astype(jnp.result_type(lhs, rhs))


def allowed_kinds(field: str) -> tuple[str, ...]:
    """The registered kinds an attention field (ATTENTION_FIELDS) may name."""
    return blocks.kinds(*ATTENTION_FIELDS[field])


# The checks of every config, in order: (whether it holds, what is wrong, the message's {fields} filled from the
# config). A check may assume the ones before it hold.
CHECKS = (
    (lambda c: c.vocab_size > 0, "vocab_size must be positive, got {vocab_size}"),
    (lambda c: c.num_heads > 0 and c.emb_dim % c.num_heads == 0,
     "num_heads={num_heads} must divide emb_dim={emb_dim}"),
    (lambda c: c.positional_encoding in POSITIONAL_ENCODINGS,
     f"positional_encoding={{positional_encoding!r}} is not one of {POSITIONAL_ENCODINGS}"),
    (lambda c: c.layer_norm in LAYER_NORMS, f"layer_norm={{layer_norm!r}} is not one of {LAYER_NORMS}"),
    (lambda c: c.activation in ACTIVATIONS, f"activation={{activation!r}} is not one of {ACTIVATIONS}"),
    (lambda c: c.dtype in DTYPES, f"dtype={{dtype!r}} is not one of {tuple(DTYPES)}"),
    (lambda c: c.attention in ATTENTION_IMPLEMENTATIONS,
     f"attention={{attention!r}} is not one of {ATTENTION_IMPLEMENTATIONS}"),
    (lambda c: c.attention == "reference" or c.attention_dropout_rate == 0.0,
     "attention={attention!r} has no dropout on the attention weights: set attention_dropout_rate=0 or "
     "attention='reference'"),
    (lambda c: c.emb_dim % 2 == 0, "emb_dim={emb_dim} must be even for sinusoidal positions"),
    (lambda c: c.init_std >= 0.0, "init_std={init_std} must be >= 0 (0: lecun normal)"),
    (lambda c: not c.scan_layers or min(c.stack_depths.values(), default=1) >= 1,
     "scan_layers=True needs at least one layer per stack, got num_encoder_layers={num_encoder_layers}, "
     "num_decoder_layers={num_decoder_layers}"),
    (lambda c: c.family in FAMILIES, f"family={{family!r}} is not one of {FAMILIES}"),
    (lambda c: c.decoder_positions or c.family == "encoder_decoder",
     "decoder_positions=False is for family='encoder_decoder': {family!r} embeds its source with the same positions"),
    (lambda c: c.masked_side in MASKED_SIDES, f"masked_side={{masked_side!r}} is not one of {MASKED_SIDES}"),
    (lambda c: 0.0 < c.mask_rate < 1.0, "mask_rate={mask_rate} must be in (0, 1)"),
)
_ONE_EMBEDDING = (lambda c: c.share_embeddings,
                  "family={family!r} reads source and target with one embedding: set share_embeddings=True")
FAMILY_CHECKS = {
    "decoder_only": (
        _ONE_EMBEDDING,
        (lambda c: c.num_encoder_layers == 0,
         "family='decoder_only' has no encoder: set num_encoder_layers=0, got {num_encoder_layers}"),
        (lambda c: c.num_decoder_layers >= 1, "family='decoder_only' needs num_decoder_layers >= 1"),
    ),
    "encoder_only": (
        _ONE_EMBEDDING,
        (lambda c: c.num_decoder_layers == 0,
         "family='encoder_only' has no decoder: set num_decoder_layers=0, got {num_decoder_layers}"),
        (lambda c: c.num_encoder_layers >= 1, "family='encoder_only' needs num_encoder_layers >= 1"),
        (lambda c: c.masked_side != "both" or c.kinds("encoder_attention") == ("dense",),
         "masked_side='both' joins source and target in one row: encoder_attention={encoder_attention!r} must be "
         "'dense'"),
    ),
}
RATE_CHECKS = tuple((lambda c, rate=rate: 0.0 <= getattr(c, rate) < 1.0, f"{rate}={{{rate}}} must be in [0, 1)")
                    for rate in ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate"))


@config_files.section("model")
class ModelConfig:
    """Every shape and rate of the model: `config.model` (transformer/defaults.py holds each field's default and
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
    activation: str  # one of ACTIVATIONS
    projection_bias: bool
    output_bias: bool
    positional_encoding: str
    decoder_positions: bool  # False: no positions added to the decoder's embeddings (encoder_decoder only)
    max_length: int
    layer_norm: str
    layer_norm_epsilon: float
    share_embeddings: bool
    tie_output_embedding: bool
    dtype: str
    attention: str  # one of ATTENTION_IMPLEMENTATIONS
    # Each stack's attention: a registered kind (allowed_kinds), or a comma-separated pattern of kinds cycled over
    # the stack's layers ("local,dense": local in layers 0, 2, 4, ..., dense in 1, 3, ...).
    encoder_attention: str
    decoder_attention: str
    cross_attention: str
    local_window: int
    linformer_length: int
    performer_features: int
    # The "ssm" kind (Mamba-2, ssm.py): state size N, the inner width's factor, its head size (heads = expand x
    # emb_dim / head_dim), the convolution's taps and the chunk length of the training form.
    ssm_state: int
    ssm_expand: int
    ssm_head_dim: int
    ssm_conv: int
    ssm_chunk: int
    num_experts: int  # mixture of experts (experts.MoEFeedForward): 0 for none
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
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        for ok, message in self._checks():
            if not ok:
                raise ValueError(f"model config: {message.format(**fields)}")

    def _checks(self) -> Iterable[tuple[bool, str]]:
        """(ok, message) in order, lazily: a check runs only once those before it hold."""
        for table in (CHECKS, FAMILY_CHECKS.get(self.family, ())):
            yield from ((check(self), message) for check, message in table)
        yield from self._kind_checks()
        yield from ((check(self), message) for check, message in RATE_CHECKS)

    def _kind_checks(self) -> Iterable[tuple[bool, str]]:
        """Each attention field's kinds known to the registry, then each kind's own checks and what its stack needs
        of it; then the feed-forward kinds'. Messages are formatted (their braces are escaped)."""
        def escaped(message):
            return message.replace("{", "{{").replace("}", "}}")
        for field, (role, stack) in ATTENTION_FIELDS.items():
            value, known = getattr(self, field), allowed_kinds(field)
            for kind in dict.fromkeys(self.kinds(field)):
                where = f"{field}={kind!r}" if value == kind else f"{field}={value!r}: {kind!r}"
                yield kind in known, escaped(f"{where} is not one of {known}")
        for field, (role, stack) in ATTENTION_FIELDS.items():
            value, kinds = getattr(self, field), self.kinds(field)
            yield (not self.scan_layers or len(set(kinds)) == 1,
                   escaped(f"scan_layers=True stacks identical layers, and {field}={value!r} cycles {len(set(kinds))} "
                           "kinds: name one kind or set scan_layers=False"))
            for kind in dict.fromkeys(kinds):
                yield from ((ok, escaped(message)) for ok, message in blocks.lookup(role, kind).checks(self, field))
        if self.family == "decoder_only":
            prefilling = " or ".join(repr(kind) for kind in allowed_kinds("decoder_attention")
                                     if blocks.can_prefill(blocks.lookup("self_attention", kind)))
            for kind in dict.fromkeys(self.kinds("decoder_attention")):
                yield (blocks.can_prefill(blocks.lookup("self_attention", kind)),
                       escaped(f"family='decoder_only' runs the source prefix once before decoding (Block.prefill), "
                               f"which {kind!r} cannot: decoder_attention={self.decoder_attention!r} must be "
                               f"{prefilling}"))
        for kind in self.feed_forward_kinds:
            yield from ((ok, escaped(message)) for ok, message in
                        blocks.lookup("feed_forward", kind).checks(self, "num_experts"))

    def kinds(self, field: str) -> tuple[str, ...]:
        """The kinds an attention field names, in the order its pattern cycles them over a stack's layers."""
        return tuple(kind.strip() for kind in getattr(self, field).split(","))

    @property
    def feed_forward_kinds(self) -> tuple[str, ...]:
        return ("dense", "experts") if self.num_experts else ("dense",)

    def layer_kinds(self, stack: str, index: int) -> tuple[tuple[str, str, str], ...]:
        """Layer `index` of `stack` ("encoder" or "decoder") as its blocks in order: (role, kind, the field naming
        the kind). A decoder reads the encoder through cross-attention in the encoder-decoder family alone."""
        def cycled(field):
            kinds = self.kinds(field)
            return kinds[index % len(kinds)]
        layer = [("self_attention", cycled(f"{stack}_attention"), f"{stack}_attention")]
        if stack == "decoder" and self.family == "encoder_decoder":
            layer.append(("cross_attention", cycled("cross_attention"), "cross_attention"))
        layer.append(("feed_forward", "experts" if self.is_expert_layer(index) else "dense", "num_experts"))
        return tuple(layer)

    @property
    def stack_depths(self) -> dict[str, int]:
        """The family's stacks ("encoder", "decoder": Transformer's `<stack>_layers`) and their depths: the others
        are not built."""
        return {"encoder_decoder": {"encoder": self.num_encoder_layers, "decoder": self.num_decoder_layers},
                "decoder_only": {"decoder": self.num_decoder_layers},
                "encoder_only": {"encoder": self.num_encoder_layers}}.get(self.family, {})

    @property
    def joins_pair(self) -> bool:
        """Whether one row holds the source and the target joined (decoder_only; encoder_only over both sides)."""
        return self.family == "decoder_only" or (self.family == "encoder_only" and self.masked_side == "both")

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.num_heads

    @property
    def row_mixing(self) -> tuple[tuple[str, str, str], ...]:
        """(field, value, why) of each attention field naming a kind that mixes every position of a row: such a
        kind takes one sentence per row (data.pack=false), which Settings checks."""
        found = []
        for field, (role, _) in ATTENTION_FIELDS.items():
            why = [blocks.lookup(role, kind).mixes_row for kind in self.kinds(field)]
            if any(why):
                found.append((field, getattr(self, field), next(reason for reason in why if reason)))
        return tuple(found)

    @property
    def position_limit(self) -> int | None:
        """Longest input the model can represent: the learned table's size, or a kind's own limit (linformer's
        projected length's columns); sinusoids alone have no limit. A joined pair (joins_pair) numbers the target
        after the source, so each side has half the learned table."""
        limits = [blocks.lookup(role, kind).position_limit(self) for field, (role, _) in ATTENTION_FIELDS.items()
                  for kind in self.kinds(field)]
        if self.positional_encoding == "learned":
            limits.append(self.max_length // 2 if self.joins_pair else self.max_length)
        return min((limit for limit in limits if limit is not None), default=None)

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
