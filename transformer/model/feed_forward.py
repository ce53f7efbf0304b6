"""The position-wise feed-forward (paper section 3.3): the "dense" feed_forward kind."""

from __future__ import annotations

import jax
from flax import nnx

from transformer.model import blocks
from transformer.model.blocks import Inputs
from transformer.model.config import ModelConfig, accumulated_dot, partitioned

Array = jax.Array
# gelu exact (erf), as torch's and Hugging Face's "gelu"; swish = SiLU, x sigmoid(x).
ACTIVATION_FUNCTIONS = {"relu": jax.nn.relu, "swish": jax.nn.silu,
                        "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


@blocks.register("feed_forward", "dense")
class FeedForward(blocks.PositionwiseBlock):
    """FFN(x) = act(x W1 + b1) W2 + b2, act = max(0, .) in the paper (model.activation), with dropout between."""

    def __init__(self, config: ModelConfig, field: str = "num_experts", *, rngs: nnx.Rngs):
        dtype, bias = config.compute_dtype, nnx.initializers.zeros_init()
        self.hidden = nnx.Linear(config.emb_dim, config.mlp_dim, dtype=dtype, rngs=rngs, dot_general=accumulated_dot,
                                 kernel_init=config.kernel_init("embed", "mlp"), bias_init=partitioned(bias, "mlp"))
        self.output = nnx.Linear(config.mlp_dim, config.emb_dim, dtype=dtype, rngs=rngs, dot_general=accumulated_dot,
                                 kernel_init=config.kernel_init("mlp", "embed"), bias_init=partitioned(bias, "embed"))
        self.dropout = nnx.Dropout(config.relu_dropout_rate)
        self.activation = config.activation

    def __call__(self, x: Array, inputs: Inputs, *, deterministic: bool, rngs: nnx.Rngs | None
                 ) -> tuple[Array, blocks.Stats]:
        hidden = self.dropout(ACTIVATION_FUNCTIONS[self.activation](self.hidden(x)), deterministic=deterministic, rngs=rngs)
        return self.output(hidden), {}
