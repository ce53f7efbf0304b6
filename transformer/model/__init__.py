"""The model: the Transformer of "Attention Is All You Need" built from registered blocks.

Reading order: transformer.py (the encoder-decoder, top to bottom) -> layers.py (embedder, residual, a layer as a
list of blocks, the stacks) -> blocks.py (the block interface and the registry of kinds) -> the kinds:
attention.py (dense), local.py, linformer.py, performer.py, ssm.py (Mamba-2), feed_forward.py, experts.py; families.py (decoder-only,
encoder-only); config.py (ModelConfig and its checks); masks.py (masks and positions).

    model = build(ModelConfig(vocab_size=..., ...), rngs=nnx.Rngs(0))

A new kind is a blocks.Block subclass decorated with `register(role, name)`; a config field then names it.
"""

from flax import nnx

# The kinds register themselves on import, so every kind is known before any config is checked; in this order,
# the order config messages list them in.
from transformer.model import attention, local, linformer, performer, ssm  # noqa: F401  isort: skip
from transformer.model import feed_forward, experts  # noqa: F401  isort: skip
from transformer.model.blocks import Block, register
from transformer.model.config import ModelConfig
from transformer.model.experts import ROUTER_STATS
from transformer.model.families import DecoderOnly, EncoderOnly
from transformer.model.layers import stack_layer_params, unstack_layer_params
from transformer.model.masks import join_pair, positions_of, segmentation_of
from transformer.model.transformer import Transformer

FAMILY_MODELS = {model.family: model for model in (Transformer, DecoderOnly, EncoderOnly)}


def build(config: ModelConfig, *, rngs: nnx.Rngs) -> Transformer:
    """The model of config.family: the one way to construct one."""
    return FAMILY_MODELS[config.family](config, rngs=rngs)


__all__ = ["Block", "ModelConfig", "ROUTER_STATS", "Transformer", "build", "join_pair", "positions_of", "register",
           "segmentation_of", "stack_layer_params", "unstack_layer_params"]
