"""A trained encoder as a feature extractor: the encoder's outputs for sentences, from a workdir.

    from transformer.features import FeatureExtractor
    extractor = FeatureExtractor("runs/encoder_only")           # the latest checkpoint (or step=, average_last=)
    features, mask = extractor(["A black dog runs.", "Hi."])    # [2, tokens, d_model] float32, [2, tokens] bool

The features are the last encoder layer's outputs (after the final LayerNorm of a pre-LN stack), one vector per
sentencepiece token and the EOS; `mask` is False at padding. Each sentence is read alone, numbered from position
0 as a source is (a model trained with model.masked_side='both' saw targets numbered on from their sources).
Works for encoder_only and encoder_decoder workdirs; a decoder_only model has no encoder and is refused.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from transformer import batching
from transformer.restore import restore, workdir_family


class FeatureExtractor:
    def __init__(self, workdir: str, step: int | None = None, *, average_last: int = 0):
        if workdir_family(workdir) == "decoder_only":  # said before any checkpoint is read
            raise ValueError(f"{workdir} holds a decoder_only model, which has no encoder to extract features from")
        self.restored = restore(workdir, step, average_last=average_last)
        self._encode = jax.jit(functools.partial(encode, graphdef=self.restored.graphdef))

    def __call__(self, sentences: list[str], *, max_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """sentences -> (features [sentences, tokens, d_model] float32, mask [sentences, tokens] bool). Each is cut
        to max_length tokens (default: the run's data.max_length, or the positions the model has)."""
        bound = max_length or self.restored.input_bound
        ids, _ = batching.cut_to_bound(self.restored.tokenizer.encode(sentences), bound)
        length = max((len(x) for x in ids), default=1)
        inputs = np.zeros((len(ids), length), np.int32)
        for row, x in enumerate(ids):
            inputs[row, :len(x)] = x
        features = self._encode(self.restored.params, inputs)
        return np.asarray(jax.device_get(features), np.float32), inputs != 0


def encode(params: dict, inputs: jax.Array, *, graphdef: nnx.GraphDef) -> jax.Array:
    """inputs [batch, length] int -> the encoder's outputs [batch, length, d_model]."""
    return nnx.merge(graphdef, params).encode(inputs)
