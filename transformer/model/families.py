"""The other families built from the paper's parts (docs/families.md): a decoder-only language model over
`source <sep> target` (loss on the target part) and an encoder-only masked language model."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model.blocks import Inputs, Stats
from transformer.model.layers import mean_stats, prefill_layers, run_layers
from transformer.model.masks import (SelfMask, join_pair, positions_of, prefix_lm_mask, segmentation_of,
                                     target_segments)
from transformer.model.transformer import Cache, Transformer

Array = jax.Array


class DecoderOnly(Transformer):
    """The decoder's layers without cross-attention over one stream, the source then the target (join_pair),
    under prefix_lm_mask. The same four calls as the encoder-decoder: `encode` embeds the source prefix, which
    init_cache runs through the layers once (prefill)."""

    family = "decoder_only"

    def encode(self, inputs: Array, *, inputs_segmentation: Array | None = None, inputs_position: Array | None = None,
               deterministic: bool = True, rngs: nnx.Rngs | None = None) -> Array:
        """inputs [batch, src_length] -> the embedded source prefix [batch, src_length, embed]."""
        return self.target_embedder(inputs, positions_of(inputs, inputs_position), deterministic=deterministic,
                                    rngs=rngs)

    def decode(self, *args, **kwargs):
        raise NotImplementedError("family='decoder_only' reads source and target as one stream: call the model "
                                  "(teacher forcing) or init_cache and decode_step")

    def __call__(self, inputs: Array, decoder_inputs: Array | None = None, *, inputs_segmentation: Array | None = None,
                 inputs_position: Array | None = None, targets_segmentation: Array | None = None,
                 targets_position: Array | None = None, deterministic: bool = True,
                 rngs: nnx.Rngs | None = None, with_router_stats: bool = False) -> Array | tuple[Array, Stats]:
        """The teacher-forced pass: the sources and the shifted targets (whose start symbol 0 is the `<sep>`)
        joined into one stream -> logits of the target part [batch, tgt_length, vocab] (and the blocks' stats)."""
        source_segmentation = segmentation_of(inputs, inputs_segmentation)
        targets_segmentation, target_real = target_segments(decoder_inputs, targets_segmentation)
        tokens, segmentation, positions = join_pair(
            inputs, source_segmentation, positions_of(inputs, inputs_position), decoder_inputs, targets_segmentation,
            positions_of(decoder_inputs, targets_position))
        mask = SelfMask(segmentation, causal=True,
                        matrix=prefix_lm_mask(segmentation, inputs.shape[1], self.config.prefix_lm))
        real = jnp.concatenate([source_segmentation != 0, target_real], axis=1)
        x = self.target_embedder(tokens, positions, deterministic=deterministic, rngs=rngs)
        x, stats = run_layers(self.decoder_layers, x, Inputs(self_mask=mask, real=real), deterministic=deterministic,
                              rngs=rngs, remat=self.config.remat)
        logits = self.logits(x[:, inputs.shape[1]:])
        return (logits, mean_stats(stats)) if with_router_stats else logits

    def init_cache(self, encoded: Array, inputs: Array, max_decode_length: int, *, hypotheses: int = 1,
                   blocks: int = 1, dtype: Any = None) -> Cache:
        """Transformer.init_cache's, after the source prefix (encoded: `encode`) has run through the layers once, as
        the teacher-forced pass runs it (a source never sees a target, so its states are the same), each block
        keeping what its steps read of it (Block.prefill), and each row's prefix length, which numbers the steps'
        positions on from it."""
        cache = super().init_cache(encoded, inputs, max_decode_length, hypotheses=hypotheses, blocks=blocks,
                                   dtype=dtype)
        segmentation = (inputs != 0).astype(jnp.int32)
        prefix = Inputs(self_mask=SelfMask(segmentation, causal=not self.config.prefix_lm), real=segmentation != 0)
        _, layers = prefill_layers(self.decoder_layers, encoded, prefix, cache["layers"])
        return {**cache, "layers": layers, "prefix_length": jnp.sum(segmentation, axis=1)}


class EncoderOnly(Transformer):
    """The encoder's layers over one stream (the source, the target or the pair joined: steps.masked_batch), with
    the tied embedding as the masked language model's head: `__call__` and `encode`."""

    family = "encoder_only"

    def __call__(self, inputs: Array, decoder_inputs: Array | None = None, *, inputs_segmentation: Array | None = None,
                 inputs_position: Array | None = None, targets_segmentation: Array | None = None,
                 targets_position: Array | None = None, deterministic: bool = True,
                 rngs: nnx.Rngs | None = None, with_router_stats: bool = False) -> Array | tuple[Array, Stats]:
        """inputs [batch, length] (its masked stream) -> logits [batch, length, vocab] of every position."""
        encoded, stats = self._encode(inputs, inputs_segmentation, inputs_position, deterministic, rngs)
        logits = self.output(encoded)
        return (logits, mean_stats(stats)) if with_router_stats else logits

    def decode(self, *args, **kwargs):
        raise NotImplementedError("family='encoder_only' has no decoder")

    init_cache = decode_step = decode
