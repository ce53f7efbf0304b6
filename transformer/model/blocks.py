"""The block interface and its registry: a layer is a list of blocks, each a sublayer inside its residual.

A block kind is a `Block` subclass registered under a role and a name, which config fields choose:

    @blocks.register("self_attention", "mine")   # model.decoder_attention="mine" (or a pattern, "dense,mine")
    class Mine(blocks.Block): ...

Roles, in a layer's order: "self_attention" (the mixer over the layer's own positions: model.encoder_attention,
model.decoder_attention), "cross_attention" (the decoder's reading of the encoder: model.cross_attention) and
"feed_forward" (model.num_experts and expert_every choose "dense" or "experts" per layer). A block is built as
`Kind(config, field, rngs=rngs)`, field being the config field that named it, and takes part in

  * training and teacher-forced passes: `__call__(x, inputs, deterministic=, rngs=) -> (y, stats)`;
  * cached decoding: `init_cache(setup) -> cache`, then per position `decode_step(x, cache, step) -> (y, cache)`,
    with `reorder(cache, parents)` where its cache is per-hypothesis state that beam search must move to follow
    each hypothesis's parent;
  * decoder_only's prefill of the source prefix: `prefill(x, inputs, cache) -> (y, cache)`.

x and y are [batch, length, embed]; in decode_step [batch, hypotheses, embed], one position of every hypothesis.
Whatever several layers read (a mask, the parents) is formed once per stack (`prepare`) or per step (`Step`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
from flax import nnx, struct

Array = jax.Array
Cache = dict[str, Any]
Stats = dict[str, Array]  # a block's stats by group (Block.stats); a model's by name

ROLES = ("self_attention", "cross_attention", "feed_forward")
# Every registered kind by (role, name), in registration order: the order their names are listed in.
REGISTRY: dict[tuple[str, str], type[Block]] = {}


@struct.dataclass
class Inputs:
    """What the blocks of a stack read besides x in a training or teacher-forced pass, formed once per stack."""

    self_mask: Any = None  # masks.SelfMask over the stack's positions (decoder: causal)
    real: Array | None = None  # [batch, length] bool, not padding (what experts route); None: every token, no capacity
    encoded: Array | None = None  # [batch, src_length, embed]: the encoder's outputs, for cross-attention
    source_segmentation: Array | None = None  # [batch, src_length] (0: padding)
    cross_mask: Array | None = None  # [batch, 1, length, src_length] bool, formed by a kind that reads it (prepare)


@dataclasses.dataclass(frozen=True)
class CacheSetup:
    """What a block's init_cache reads: a decode of `hypotheses` hypotheses per source sentence, each of up to
    max_length positions, a growing cache held in `blocks` arrays (attention.blocked_attention)."""

    encoded: Array  # [batch, src_length, embed]: `encode`'s outputs (decoder_only: the embedded prefix)
    source_segmentation: Array  # [batch, src_length] bool: a real source token
    max_length: int
    hypotheses: int
    blocks: int
    dtype: Any = None  # the caches' dtype (attention over them computes in it); None: the model's compute dtype

    @property
    def batch(self) -> int:
        return self.encoded.shape[0]


class Step:
    """One decoding position of every hypothesis, as each block's decode_step reads it. What several layers read
    is formed once per step, at trace time (`remember`), not once per layer."""

    def __init__(self, position: Array, batch: int, hypotheses: int, source_mask: Array,
                 history: Array | None = None):
        self.position = position  # int32 scalar: the position decoded now
        self.batch, self.hypotheses = batch, hypotheses
        self.source_mask = source_mask  # [batch, 1, 1, src_length] bool: the real source tokens
        # [batch, hypotheses, <= max_length] int: for each hypothesis and earlier position, the hypothesis whose cache
        # rows hold it (beam search's ancestor table); None: each its own.
        self.history = history
        self._memo: dict[Any, Any] = {}

    def remember(self, key: Any, compute: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @functools.cached_property
    def parents(self) -> Array:
        """[batch, hypotheses]: the hypothesis each one continues, the one whose rows hold its previous position."""
        return jnp.take(self.history, jnp.maximum(self.position - 1, 0), axis=2)


class Block(nnx.Module):
    """One sublayer kind. Subclasses implement __call__, and for the decoder init_cache and decode_step; the class
    attributes and classmethods below declare what the config checks (ModelConfig) read of a kind."""

    role: str = ""  # set by register
    kind: str = ""
    # The stacks whose self-attention a mixer may be (linformer's projection has no causal form: encoder only).
    stacks: tuple[str, ...] = ("encoder", "decoder")
    # The stats __call__ reports, {group: the names of its vector's entries} (the experts' {"router":
    # ROUTER_STATS}): each group's vector is summed over the layers and averaged over the blocks reporting it
    # (Transformer.__call__'s with_router_stats), then its entries named. Read-only.
    stats: dict[str, tuple[str, ...]] = {}
    # Why the kind mixes every position of a row, if it does: it then takes one sentence per row (data.pack=false).
    mixes_row: str = ""

    @classmethod
    def checks(cls, config, field: str) -> Iterable[tuple[bool, str]]:
        """(ok, message) of the kind's own settings, for the config field naming it (ModelConfig runs them)."""
        return ()

    @classmethod
    def position_limit(cls, config) -> int | None:
        """The longest input the kind can read (None: no limit of its own)."""
        return None

    @staticmethod
    def prepare(inputs: Inputs) -> Inputs:
        """inputs with what this kind reads formed once for its whole stack (e.g. the dense mask): run before the
        layers, outside remat and scan, so that no layer forms it again."""
        return inputs

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, Stats]:
        """x [batch, length, embed] -> (y [batch, length, embed], stats {group of self.stats: float32 [its names]})."""
        raise NotImplementedError

    def init_cache(self, setup: CacheSetup) -> Cache:
        """The block's decoding state before the first position: a pytree of arrays (empty: none)."""
        return {}

    def decode_step(self, x: Array, cache: Cache, step: Step) -> tuple[Array, Cache]:
        """x [batch, hypotheses, embed] at step.position -> (y [batch, hypotheses, embed], cache after it)."""
        raise NotImplementedError(f"{self.role} kind {self.kind!r} has no cached decoding")

    def reorder(self, cache: Cache, parents: Array) -> Cache:
        """The cache with each hypothesis's state taken from its parent (parents [batch, hypotheses]). Identity by
        default: a cache of rows that decode_step's mask finds through step.history is never moved."""
        return cache

    def prefill(self, x: Array, inputs: Inputs, cache: Cache) -> tuple[Array, Cache]:
        """decoder_only: the source prefix x [batch, src_length, embed] in one pass (deterministic), with the cache
        init_cache gave -> (y, the cache decode_step then reads the prefix from). A mixer that prefills reads
        inputs.self_mask.dense() in __call__ too (the prefix LM mask); decoder_only refuses a kind without one."""
        raise NotImplementedError(f"{self.role} kind {self.kind!r} cannot prefill")


def reorders(block: Block) -> bool:
    return type(block).reorder is not Block.reorder


def can_prefill(kind: type[Block]) -> bool:
    return kind.prefill is not Block.prefill


class PositionwiseBlock(Block):
    """A block that reads each position alone (a feed-forward): nothing to cache, reorder or prefill beyond its
    call. Decoding passes inputs without `real`: every token of a step, a hypothesis never waiting on another."""

    def decode_step(self, x: Array, cache: Cache, step: Step) -> tuple[Array, Cache]:
        return self(x, Inputs(), deterministic=True, rngs=None)[0], cache

    def prefill(self, x: Array, inputs: Inputs, cache: Cache) -> tuple[Array, Cache]:
        return self(x, inputs, deterministic=True, rngs=None)[0], cache


def register(role: str, kind: str):
    """Decorate a Block subclass as the kind `kind` of `role` (ROLES): config fields may then name it."""
    if role not in ROLES:
        raise ValueError(f"role {role!r} is not one of {ROLES}")

    def decorate(cls: type[Block]) -> type[Block]:
        if not (isinstance(cls, type) and issubclass(cls, Block)):
            raise TypeError(f"{role} kind {kind!r}: {cls!r} is not a Block subclass")
        known = REGISTRY.get((role, kind))
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"{role} kind {kind!r} is registered already, as {known.__qualname__}")
        cls.role, cls.kind = role, kind
        REGISTRY[role, kind] = cls
        return cls
    return decorate


def kinds(role: str, stack: str | None = None) -> tuple[str, ...]:
    """The registered kinds of `role` (of a mixer: those whose stacks include `stack`), in registration order."""
    return tuple(kind for (known_role, kind), cls in REGISTRY.items()
                 if known_role == role and (stack is None or stack in cls.stacks))


def lookup(role: str, kind: str) -> type[Block]:
    try:
        return REGISTRY[role, kind]
    except KeyError:
        raise ValueError(f"{role} kind {kind!r} is not one of {kinds(role)}") from None
