"""model.attention: the reference implementation (the one attention body, also cached decoding's) and
jax.nn.dot_product_attention (xla) agree under padding, causal masks and packed segments, for a few queries too;
the whole model agrees too. cudnn (flash attention) needs a GPU: on a CPU only
its error is tested; on a GPU (scripts/gpu_checks.sh) it is compared with the reference in bfloat16. model.remat
changes memory, not results."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.model import ModelConfig, build
from transformer.model.attention import attention, head_major_attention, to_cache_layout
from transformer.model.masks import attention_mask
from transformer.steps import dropout_rngs


def packed_segments():
    # row 0: two sentences then padding; row 1: one sentence filling the row; row 2: three short ones
    return jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 2, 2, 2, 3, 3, 0]])


@pytest.mark.parametrize("causal", [False, True])
def test_xla_attention_equals_the_reference_with_padding_causal_and_packed_masks(causal):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    query, key, value = (jax.random.normal(k, (3, 8, 2, 16)) for k in keys)
    segmentation = packed_segments()
    mask = attention_mask(segmentation, segmentation, causal=causal)
    dropout = nnx.Dropout(0.0)
    kw = dict(deterministic=True, rngs=None)
    reference = attention("reference", query, key, value, mask, dropout, **kw)
    xla = attention("xla", query, key, value, mask, dropout, **kw)
    real = np.asarray(segmentation != 0)  # padding queries attend to nothing: their output is unused
    np.testing.assert_allclose(np.asarray(xla)[real], np.asarray(reference)[real], atol=1e-5)


@pytest.mark.parametrize("queries", [1, 4])
def test_the_attention_body_equals_xla_for_a_few_queries_over_head_major_keys(queries):
    """Cached decoding runs head_major_attention with a few queries (one per sentence, or its beams) over keys in
    the caches' layout: the same attention as jax's over the same rows."""
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    query, key, value = (jax.random.normal(k, (3, n, 2, 16)) for k, n in zip(keys, (queries, 8, 8)))
    mask = jnp.broadcast_to((packed_segments() != 0)[:, None, None, :], (3, 1, queries, 8))
    expected = jax.nn.dot_product_attention(query, key, value, mask=mask, implementation="xla")
    got = jax.jit(head_major_attention)(jnp.transpose(query, (0, 2, 1, 3)), *to_cache_layout(key, value), mask)
    np.testing.assert_allclose(np.asarray(jnp.transpose(got, (0, 2, 1, 3))), np.asarray(expected), atol=1e-5)


def test_the_model_gives_the_same_logits_with_either_implementation():
    config = ModelConfig(vocab_size=40, emb_dim=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                         mlp_dim=64)
    inputs = jnp.array([[5, 6, 7, 1, 0, 0], [8, 9, 10, 11, 12, 1]])
    decoder_inputs = jnp.array([[0, 13, 14, 15, 0, 0], [0, 16, 17, 18, 19, 20]])
    logits = {}
    for implementation in ("reference", "xla"):
        model = build(dataclasses.replace(config, attention=implementation), rngs=nnx.Rngs(0))
        logits[implementation] = model(inputs, decoder_inputs)
    np.testing.assert_allclose(logits["xla"], logits["reference"], atol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cudnn flash attention needs a GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_attention_equals_the_reference_on_a_gpu(causal):
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    query, key, value = (jax.random.normal(k, (3, 8, 2, 64)).astype(jnp.bfloat16) for k in keys)
    segmentation = packed_segments()
    mask = attention_mask(segmentation, segmentation, causal=causal)
    kw = dict(deterministic=True, rngs=None)
    reference, cudnn = (attention(name, query, key, value, mask, nnx.Dropout(0.0), **kw)
                        for name in ("reference", "cudnn"))
    real = np.asarray(segmentation != 0)
    np.testing.assert_allclose(np.asarray(cudnn, np.float32)[real], np.asarray(reference, np.float32)[real], atol=3e-2)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cudnn flash attention needs a GPU")
def test_the_model_in_bfloat16_gives_the_same_logits_with_cudnn_on_a_gpu():
    config = ModelConfig(vocab_size=40, emb_dim=128, num_heads=2, num_encoder_layers=2, num_decoder_layers=2,
                         mlp_dim=256, dtype="bfloat16")
    inputs = jnp.array([[5, 6, 7, 1, 0, 0], [8, 9, 10, 11, 12, 1]])
    decoder_inputs = jnp.array([[0, 13, 14, 15, 0, 0], [0, 16, 17, 18, 19, 20]])
    logits = {name: build(dataclasses.replace(config, attention=name), rngs=nnx.Rngs(0))(inputs, decoder_inputs)
              for name in ("reference", "cudnn")}
    real = np.asarray(decoder_inputs != 0) | (np.arange(6) == 0)  # position 0 holds the start symbol
    np.testing.assert_allclose(np.asarray(logits["cudnn"])[real], np.asarray(logits["reference"])[real], atol=5e-2)


def test_cudnn_on_cpu_and_attention_dropout_outside_the_reference_fail_clearly():
    config = ModelConfig(vocab_size=40, emb_dim=32, num_heads=4, attention="cudnn")
    if jax.default_backend() != "gpu":
        x = jnp.ones((1, 4, 4, 8))
        with pytest.raises(ValueError, match="needs a GPU"):
            attention(config.attention, x, x, x, jnp.ones((1, 1, 4, 4), bool), nnx.Dropout(0.0),
                      deterministic=True, rngs=None)
    with pytest.raises(ValueError, match="no dropout on the attention weights"):
        ModelConfig(vocab_size=40, attention="xla", attention_dropout_rate=0.1)


@pytest.mark.parametrize("rng_impl", [pytest.param("threefry2x32", marks=pytest.mark.slow), "counter_hash"])
def test_remat_gives_the_same_loss_and_gradients(rng_impl):
    config = ModelConfig(vocab_size=40, emb_dim=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                         mlp_dim=64, dropout_rate=0.1)
    inputs = jnp.array([[5, 6, 7, 1, 0, 0], [8, 9, 10, 11, 12, 1]])
    decoder_inputs = jnp.array([[0, 13, 14, 15, 0, 0], [0, 16, 17, 18, 19, 20]])
    results = []
    for remat in (False, True):
        graphdef, params = nnx.split(build(dataclasses.replace(config, remat=remat), rngs=nnx.Rngs(0)))

        def loss(params):
            model = nnx.merge(graphdef, params)
            # the recomputed forward pass must draw the same dropout masks as the first
            logits = model(inputs, decoder_inputs, deterministic=False,
                           rngs=dropout_rngs(jax.random.PRNGKey(1), rng_impl))
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 3])
        results.append(jax.value_and_grad(loss)(params))
    (plain_loss, plain_grads), (remat_loss, remat_grads) = results
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(plain_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5)
