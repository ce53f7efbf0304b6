"""The parts every family is made of: the embedder, the residual around each block, a layer (a list of blocks) and
the stacks of layers, as a list or as one scanned LayerStack."""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model import blocks
from transformer.model.blocks import Cache, CacheSetup, Inputs, Stats, Step
from transformer.model.config import ModelConfig, partitioned
from transformer.model.masks import sinusoidal_positions

Array = jax.Array


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

    def __call__(self, tokens: Array, positions: Array | None, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> Array:
        """tokens, positions: [batch, length] int -> [batch, length, embed] in the compute dtype (positions None:
        no positional term, model.decoder_positions=False)."""
        x = self.embedding(tokens) * math.sqrt(self.config.emb_dim)
        if positions is not None:
            x = x + self.positional_term(positions)
        x = self.dropout(x, deterministic=deterministic, rngs=rngs)
        return x.astype(self.config.compute_dtype)

    def positional_term(self, positions: Array) -> Array:
        if self.config.positional_encoding == "learned":
            # Clamped: jnp.take would return NaN past the table, and padding positions of a long decode batch
            # can pass it. Real tokens never do: Settings and the input bound keep sources within the table, and
            # decode.output_limits ends every output within it.
            return self.position_embedding(jnp.minimum(positions, self.config.max_length - 1))
        return sinusoidal_positions(positions, self.config.emb_dim)

    def logits(self, x: Array) -> Array:
        """[batch, length, embed] -> [batch, length, vocab] float32, through the transposed embedding."""
        table = self.embedding.embedding[...].astype(x.dtype)
        return jnp.einsum("ble,ve->blv", x, table, preferred_element_type=jnp.float32)


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


def add_stats(total: Stats, stats: Stats) -> Stats:
    """Stats by group, summed."""
    return {**total, **{name: total[name] + value if name in total else value for name, value in stats.items()}}


class Layer(nnx.Module):
    """One layer of a stack: its blocks (ModelConfig.layer_kinds) in order, each in its Residual, as attributes
    named by role: self_attention, self_attention_residual, (cross_attention, cross_attention_residual,)
    feed_forward, feed_forward_residual. Built in that order, so that the parameters' paths (which checkpoints
    and scripts/export.py read) and their initial values do not depend on the kinds' code."""

    def __init__(self, config: ModelConfig, stack: str, index: int = 0, *, rngs: nnx.Rngs):
        roles = []
        for role, kind, field in config.layer_kinds(stack, index):
            setattr(self, role, blocks.lookup(role, kind)(config, field, rngs=rngs))
            setattr(self, f"{role}_residual", Residual(config, rngs=rngs))
            roles.append(role)
        self.roles = tuple(roles)

    def sublayers(self) -> list[blocks.Block]:
        """The layer's blocks, in order."""
        return [getattr(self, role) for role in self.roles]

    def _through(self, x: Array, apply, *, deterministic: bool = True, rngs: nnx.Rngs | None = None) -> Array:
        """x through each block in its residual: apply(role, block, y) -> the block's output of y."""
        for role in self.roles:
            x = getattr(self, f"{role}_residual")(x, functools.partial(apply, role, getattr(self, role)),
                                                  deterministic=deterministic, rngs=rngs)
        return x

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, Stats]:
        """x [batch, length, embed] -> (x [batch, length, embed], the stats its blocks report)."""
        stats = {}
        def call(role, block, y):
            y, block_stats = block(y, inputs, deterministic=deterministic, rngs=rngs)
            stats.update(add_stats(stats, block_stats))
            return y
        return self._through(x, call, deterministic=deterministic, rngs=rngs), stats

    def init_cache(self, setup: CacheSetup) -> dict[str, Cache]:
        return {role: block.init_cache(setup) for role, block in zip(self.roles, self.sublayers())}

    def decode_step(self, x: Array, cache: dict[str, Cache], step: Step) -> tuple[Array, dict[str, Cache]]:
        """x [batch, hypotheses, embed] at step.position -> (x, each block's cache after it). A block whose cache
        is per-hypothesis state first takes each hypothesis's from its parent (Block.reorder)."""
        new = {}
        def call(role, block, y):
            block_cache = cache[role]
            if step.history is not None and blocks.reorders(block):
                block_cache = block.reorder(block_cache, step.parents)
            y, new[role] = block.decode_step(y, block_cache, step)
            return y
        return self._through(x, call), new

    def prefill(self, x: Array, inputs: Inputs, cache: dict[str, Cache]) -> tuple[Array, dict[str, Cache]]:
        """decoder_only's source prefix through the layer -> (x, each block's cache with what it keeps of it)."""
        new = {}
        def call(role, block, y):
            y, new[role] = block.prefill(y, inputs, cache[role])
            return y
        return self._through(x, call), new


# The leading axis of a LayerStack's parameters: the logical name sharding.py's rules keep whole.
LAYER_AXIS = "layers"
_LAYER_METADATA = {nnx.PARTITION_NAME: LAYER_AXIS}


class LayerStack(nnx.Module):
    """`count` identical layers held as one module whose parameters have a leading `layers` axis (built with
    nnx.vmap over split rngs, as flax's scan-over-layers guide does), for ModelConfig.scan_layers.

    `scan` applies the layers in turn under one jax.lax.scan, so a step traces and compiles a single layer however
    deep the stack. Indexing and iterating give each layer as its own module, a view of its slice of the
    parameters, so cached decoding (init_cache, decode_step) reads a stack as it reads a list.
    """

    def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], count: int, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=count)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYER_METADATA)
        def create(rngs):
            return make_layer(rngs)
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

    def scan(self, call, x: Array, totals: Stats, *, rngs: nnx.Rngs | None) -> tuple[Array, Stats]:
        """x, stats = call(layer, x, layer_rngs) through each layer in turn, in one jax.lax.scan -> (x, totals plus
        the layers' stats). Layer i draws its dropout from its own key, the i-th of a split of one draw from
        `rngs` (None: no randomness)."""
        graphdef, state = nnx.split(self.stacked)
        keys = None if rngs is None else jax.random.split(rngs.dropout(), self.count)

        def body(carry, inputs):
            (x, total), (layer_state, key) = carry, inputs
            layer_rngs = None if key is None else nnx.Rngs(dropout=key)
            x, stats = call(self._view(graphdef, layer_state), x, layer_rngs)
            return (x, add_stats(total, stats)), None
        return jax.lax.scan(body, (x, totals), (state, keys))[0]


def build_stack(config: ModelConfig, stack: str, depth: int, *, rngs: nnx.Rngs) -> nnx.List | LayerStack:
    """The `depth` layers of `stack`: a LayerStack under scan_layers (whose layers ModelConfig keeps identical),
    else a list."""
    if config.scan_layers:
        return LayerStack(lambda rngs: Layer(config, stack, rngs=rngs), depth, rngs=rngs)
    return nnx.List([Layer(config, stack, index, rngs=rngs) for index in range(depth)])


def _kinds_of(layers: nnx.List | LayerStack) -> list[nnx.Module]:
    """One layer per distinct layer of the stack (a LayerStack's are all alike)."""
    return [layers.stacked] if isinstance(layers, LayerStack) else list(layers)


def prepared(layers: nnx.List | LayerStack, inputs: Inputs) -> Inputs:
    """inputs with what each kind of the stack reads formed once (Block.prepare)."""
    for kind in dict.fromkeys(type(block) for layer in _kinds_of(layers) for block in layer.sublayers()):
        inputs = kind.prepare(inputs)
    return inputs


def run_layers(layers: nnx.List | LayerStack, x: Array, inputs: Inputs, *, deterministic: bool,
               rngs: nnx.Rngs | None, remat: bool = False) -> tuple[Array, dict[str, tuple[Array, int]]]:
    """A training or teacher-forced pass through a stack: x [batch, length, embed] -> (x, {stat group: (its sum
    over the layers, the count of blocks reporting it, the names of its entries)}). One lax.scan over a
    LayerStack, a loop over a list; remat: each layer under nnx.remat, its activations recomputed in the backward
    pass instead of stored (per-layer checkpointing, as in flax's wmt example)."""
    inputs = prepared(layers, inputs)
    repeats = len(layers) if isinstance(layers, LayerStack) else 1
    counts, names = {}, {}
    for layer in _kinds_of(layers):
        for block in layer.sublayers():
            for group, entries in block.stats.items():
                counts[group], names[group] = counts.get(group, 0) + repeats, entries
    totals = {group: jnp.zeros(len(names[group]), jnp.float32) for group in counts}

    def call(layer, rngs, x, inputs):  # positional only: nnx.remat resolves no keyword arguments
        return layer(x, inputs, deterministic=deterministic, rngs=rngs)
    if remat:
        call = nnx.remat(call)
    if isinstance(layers, LayerStack):
        x, totals = layers.scan(lambda layer, x, rngs: call(layer, rngs, x, inputs), x, totals, rngs=rngs)
    else:
        for layer in layers:
            x, stats = call(layer, rngs, x, inputs)
            totals = add_stats(totals, stats)
    return x, {group: (totals[group], counts[group], names[group]) for group in counts}


def mean_stats(*stacks: dict[str, tuple[Array, int, tuple[str, ...]]]) -> Stats:
    """Each stat group summed over the stacks (run_layers'), divided by the count of blocks reporting it -> its
    entries by name (the experts': ROUTER_STATS), {} when no block reports any."""
    merged = {}
    for stats in stacks:
        for group, (total, count, names) in stats.items():
            if group in merged:
                total, count = merged[group][0] + total, merged[group][1] + count
            merged[group] = (total, count, names)
    return {name: value for total, count, names in merged.values() for name, value in zip(names, total / count)}


def decode_layers(layers: nnx.List | LayerStack, x: Array, caches: list, step: Step) -> tuple[Array, list]:
    """One decoding step through a stack, each layer with its cache (a LayerStack's layers as views)."""
    new = []
    for layer, cache in zip(layers, caches, strict=True):
        x, cache = layer.decode_step(x, cache, step)
        new.append(cache)
    return x, new


def prefill_layers(layers: nnx.List | LayerStack, x: Array, inputs: Inputs, caches: list) -> tuple[Array, list]:
    """decoder_only's source prefix through a stack, each layer keeping what its steps read of it in its cache."""
    inputs, new = prepared(layers, inputs), []
    for layer, cache in zip(layers, caches, strict=True):
        x, cache = layer.prefill(x, inputs, cache)
        new.append(cache)
    return x, new


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
