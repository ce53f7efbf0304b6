"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017): the encoder-decoder, top to bottom.

Embed the source, run it through the encoder's layers; embed the target shifted right, run it through the
decoder's layers, each reading the encoder's outputs; project to the vocabulary. A layer is a list of blocks
(layers.Layer; blocks.py has the interface and the kinds' registry), chosen per layer by the config.

Conventions:
  * token id 0 is padding (and the decoder's start symbol, as in tensor2tensor and flax's wmt example);
  * every call takes optional `*_segmentation` / `*_position` arrays so that several sentences can be
    packed into one row: attention never crosses a segment boundary, and segment 0 is padding;
  * parameters are float32; matmuls run in `config.dtype`; logits come out in float32;
  * every parameter carries logical axis names (`vocab`, `embed`, `mlp`, `heads`); transformer/sharding.py
    alone maps them onto mesh axes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model.blocks import CacheSetup, Inputs, Stats, Step
from transformer.model.config import ModelConfig, partitioned
from transformer.model.layers import (Embedder, build_stack, decode_layers, layer_norm, mean_stats, run_layers)
from transformer.model.masks import SelfMask, positions_of, segmentation_of, target_segments

Array = jax.Array
Cache = dict[str, Any]  # init_cache: the source mask and, per decoder layer, each block's cache by role


class Transformer(nnx.Module):
    """Encoder-decoder with shared embeddings: `encode`, `decode` (teacher-forced), and for incremental decoding
    `init_cache` and `decode_step`, which every search uses. families.py builds the other families from the same
    parts (model.build chooses by config.family)."""

    family = "encoder_decoder"  # the config.family this class builds

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.family != self.family:
            raise ValueError(f"{type(self).__name__} builds family={self.family!r}, not model.family="
                             f"{config.family!r}: build models with transformer.model.build")
        self.config = config
        self.target_embedder = Embedder(config, rngs=rngs)
        self.source_embedder = self.target_embedder if config.share_embeddings else Embedder(config, rngs=rngs)
        if not config.tie_output_embedding:
            self.output_projection = nnx.Linear(
                config.emb_dim, config.vocab_size, use_bias=False, dtype=config.compute_dtype,
                preferred_element_type=jnp.float32,
                kernel_init=config.kernel_init("embed", "vocab"), rngs=rngs)
        if config.output_bias:  # Marian's final_logits_bias (trained here; a fixed buffer in Hugging Face's)
            self.output_bias = nnx.Param(partitioned(nnx.initializers.zeros_init(), "vocab")(
                rngs.params(), (config.vocab_size,), jnp.float32))
        # The family's stacks only (ModelConfig.stack_depths): decoder_only has no encoder, encoder_only no decoder.
        for stack, depth in config.stack_depths.items():
            setattr(self, f"{stack}_layers", build_stack(config, stack, depth, rngs=rngs))
            if config.layer_norm == "pre":  # pre-LN leaves the residual stream unnormalised: close each stack
                setattr(self, f"{stack}_norm", layer_norm(config, rngs))

    def encode(self, inputs: Array, *, inputs_segmentation: Array | None = None, inputs_position: Array | None = None,
               deterministic: bool = True, rngs: nnx.Rngs | None = None) -> Array:
        """inputs [batch, src_length] int -> encoded [batch, src_length, embed]: the encoder's outputs."""
        return self._encode(inputs, inputs_segmentation, inputs_position, deterministic, rngs)[0]

    def _encode(self, inputs, inputs_segmentation, inputs_position, deterministic, rngs) -> tuple[Array, dict]:
        segmentation = segmentation_of(inputs, inputs_segmentation)
        x = self.source_embedder(inputs, positions_of(inputs, inputs_position), deterministic=deterministic, rngs=rngs)
        x, stats = run_layers(self.encoder_layers, x, Inputs(self_mask=SelfMask(segmentation), real=segmentation != 0),
                              deterministic=deterministic, rngs=rngs, remat=self.config.remat)
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
                deterministic, rngs) -> tuple[Array, dict]:
        targets_segmentation, real = target_segments(decoder_inputs, targets_segmentation)
        layer_inputs = Inputs(self_mask=SelfMask(targets_segmentation, causal=True), real=real, encoded=encoded,
                              source_segmentation=segmentation_of(inputs, inputs_segmentation))
        positions = positions_of(decoder_inputs, targets_position)
        x = self.target_embedder(decoder_inputs, positions if self.config.decoder_positions else None,
                                 deterministic=deterministic, rngs=rngs)
        x, stats = run_layers(self.decoder_layers, x, layer_inputs, deterministic=deterministic, rngs=rngs,
                              remat=self.config.remat)
        return self.logits(x), stats

    def __call__(self, inputs: Array, decoder_inputs: Array | None = None, *, inputs_segmentation: Array | None = None,
                 inputs_position: Array | None = None, targets_segmentation: Array | None = None,
                 targets_position: Array | None = None, deterministic: bool = True,
                 rngs: nnx.Rngs | None = None, with_router_stats: bool = False) -> Array | tuple[Array, Stats]:
        """The training pass: logits [batch, tgt_length, vocab] float32 of the targets; with_router_stats: (logits,
        the stats the blocks report, each averaged over the blocks reporting it: the experts' ROUTER_STATS, {}
        without experts)."""
        encoded, stats = self._encode(inputs, inputs_segmentation, inputs_position, deterministic, rngs)
        logits, decoder_stats = self._decode(decoder_inputs, encoded, inputs, inputs_segmentation,
                                             targets_segmentation, targets_position, deterministic, rngs)
        return (logits, mean_stats(stats, decoder_stats)) if with_router_stats else logits

    def logits(self, x: Array) -> Array:
        """The decoder's outputs [batch, length, embed] -> float32 logits [batch, length, vocab]."""
        return self.output(self.decoder_norm(x) if self.config.layer_norm == "pre" else x)

    def output(self, x: Array) -> Array:
        """The pre-softmax projection of normalised outputs: the tied embedding, or its own matrix."""
        if self.config.tie_output_embedding:
            logits = self.target_embedder.logits(x)
        else:
            logits = self.output_projection(x)  # accumulated in float32 (preferred_element_type)
        return logits + self.output_bias[...] if self.config.output_bias else logits

    def init_cache(self, encoded: Array, inputs: Array, max_decode_length: int, *, hypotheses: int = 1,
                   blocks: int = 1, dtype: Any = None) -> Cache:
        """The decoding cache of `hypotheses` hypotheses per source sentence (inputs [batch, src_length], encoded
        its `encode`), each of up to max_decode_length positions: the source mask, and per decoder layer each
        block's cache (Block.init_cache) by role: dense self-attention's empty rows of keys/values held in
        `blocks` arrays (a step reads only those written so far), cross-attention's keys/values of the source,
        computed once for the whole decode. dtype: the caches' (CacheSetup.dtype)."""
        if blocks < 1:
            raise ValueError(f"blocks={blocks} must be >= 1")
        setup = CacheSetup(encoded=encoded, source_segmentation=inputs != 0, max_length=max_decode_length,
                           hypotheses=hypotheses, blocks=blocks, dtype=dtype)
        return {"source_mask": (inputs != 0)[:, None, None, :],
                "layers": [layer.init_cache(setup) for layer in self.decoder_layers]}

    def decode_step(self, tokens: Array, position: Array, cache: Cache, *,
                    history: Array | None = None) -> tuple[Array, Cache]:
        """One decoding position of every hypothesis: tokens [batch, hypotheses] (each one's previous output, 0 at
        the start), position a scalar -> (logits [batch, hypotheses, vocab] float32, the cache with this
        position's keys/values written).

        history [batch, hypotheses, <= max_decode_length] int says, for each hypothesis and earlier position, which
        hypothesis's rows hold it (default: its own), so a search that reorders its hypotheses (beam search) moves
        this table rather than every layer's cache; a block whose cache is per-hypothesis state takes its parent's
        (Block.reorder).
        """
        positions = jnp.full(tokens.shape, position, jnp.int32)
        if "prefix_length" in cache:  # decoder_only: the target is numbered on from its source prefix (join_pair)
            positions = positions + cache["prefix_length"][:, None]
        x = self.target_embedder(tokens, positions if self.config.decoder_positions else None, deterministic=True,
                                 rngs=None)
        step = Step(position, batch=tokens.shape[0], hypotheses=tokens.shape[1], source_mask=cache["source_mask"],
                    history=history)
        x, layers = decode_layers(self.decoder_layers, x, cache["layers"], step)
        return self.logits(x), {**cache, "layers": layers}
