"""Linformer self-attention (Wang et al. 2020): keys and values projected along the length to
model.linformer_length rows, so that every query reads a fixed number of rows however long the input. The
projection mixes every position of a row: encoder only (it has no causal form), one sentence per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer.model import blocks
from transformer.model.attention import MultiHeadAttention
from transformer.model.blocks import Inputs
from transformer.model.config import ModelConfig
from transformer.model.masks import SelfMask

Array = jax.Array


@blocks.register("self_attention", "linformer")
class LinformerAttention(MultiHeadAttention):
    stacks = ("encoder",)
    mixes_row = "linformer projects keys and values along the length"

    def __init__(self, config: ModelConfig, field: str, *, rngs: nnx.Rngs):
        super().__init__(config, field, rngs=rngs)
        # E and F, shared by the heads: [max_length, linformer_length]
        shape, init = (config.max_length, config.linformer_length), config.kernel_init(None, None)
        self.key_projection = nnx.Param(init(rngs.params(), shape, jnp.float32))
        self.value_projection = nnx.Param(init(rngs.params(), shape, jnp.float32))

    @classmethod
    def checks(cls, config, field):
        return [(config.linformer_length >= 1, f"linformer_length={config.linformer_length} must be >= 1")]

    @classmethod
    def position_limit(cls, config) -> int:
        return config.max_length  # the projections' rows

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, blocks.Stats]:
        keys, values, mask = self.project(*self.keys_values(x), inputs.self_mask)
        return self.attend(x, keys, values, mask, deterministic=deterministic, rngs=rngs), {}

    def project(self, keys: Array, values: Array, mask: SelfMask) -> tuple[Array, Array, Array]:
        """Keys and values [batch, length, heads, head_dim] projected along the length to linformer_length rows,
        padding positions zeroed first so that they add nothing -> (keys, values, mask [batch, 1, 1,
        linformer_length]): every query sees every projected row."""
        length, dtype = keys.shape[1], keys.dtype
        real = (mask.segmentation != 0)[:, :, None, None].astype(dtype)
        def projected(x, table):
            return jnp.einsum("blhd,lk->bkhd", x * real, table[:length].astype(dtype))
        keys, values = projected(keys, self.key_projection[...]), projected(values, self.value_projection[...])
        return keys, values, jnp.ones((keys.shape[0], 1, 1, keys.shape[1]), bool)
