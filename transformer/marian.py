"""The correspondence between our model and Hugging Face's MarianMTModel (OPUS-MT's), read by scripts/export.py
(ours -> Marian, CTranslate2) and scripts/import_hf.py (Marian -> ours): the one place each convention is written."""

from __future__ import annotations

import numpy as np

LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default: Marian's layers take no epsilon from the config
# Hugging Face's activation_function -> our model.activation ("silu" is swish's other name there), and back.
ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}
HF_ACTIVATIONS = {"relu": "relu", "swish": "swish", "gelu": "gelu"}


def model_dimension_order(emb_dim: int) -> np.ndarray:
    """Marian's feature m is our feature order[m]: our (sin, cos) pairs at (2i, 2i + 1) go to Marian's (i,
    emb_dim / 2 + i), where MarianSinusoidalPositionalEmbedding puts each frequency's sine and cosine. Exact,
    since LayerNorm, residuals and the tied output layer are indifferent to the order of the features."""
    return np.concatenate([np.arange(0, emb_dim, 2), np.arange(1, emb_dim, 2)])
