import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.decode import greedy_search
from transformer.model import ModelConfig, Transformer
from transformer.tokenizer import EOS_ID


@pytest.fixture(scope="module")
def model_and_search():
    config = ModelConfig(vocab_size=20, emb_dim=32, num_heads=4, num_encoder_layers=1, num_decoder_layers=2,
                         mlp_dim=64)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(3)))
    params = nnx.to_pure_dict(params)
    search = jax.jit(functools.partial(greedy_search, graphdef=graphdef, max_extra_length=6))
    return graphdef, params, search


INPUTS = jnp.array([[4, 5, 6, 1, 0, 0, 0, 0], [7, 8, 9, 10, 11, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]])


def test_greedy_output_is_the_argmax_of_the_teacher_forced_pass(model_and_search):
    graphdef, params, search = model_and_search
    outputs = np.asarray(search(params, INPUTS))
    assert outputs.shape == (3, 14)
    assert not outputs[2].any()  # an all-padding row is finished from the start
    model = nnx.merge(graphdef, params)
    for row in range(2):
        tokens = outputs[row]
        length = int(np.argmax(tokens == EOS_ID)) + 1 if EOS_ID in tokens else len(tokens)
        assert not tokens[length:].any()  # nothing after EOS
        decoder_inputs = jnp.asarray(np.concatenate([[0], tokens[:length - 1]]))[None]
        logits = model(INPUTS[row:row + 1], decoder_inputs)
        np.testing.assert_array_equal(np.argmax(logits[0], axis=-1), tokens[:length])


def test_greedy_search_does_not_depend_on_batch_neighbours(model_and_search):
    _, params, search = model_and_search
    together = np.asarray(search(params, INPUTS))
    alone = np.asarray(search(params, jnp.concatenate([INPUTS[1:2], jnp.zeros_like(INPUTS[:2])])))
    np.testing.assert_array_equal(alone[0], together[1])
