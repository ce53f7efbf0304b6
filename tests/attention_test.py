"""model.attention: the reference implementation and jax.nn.dot_product_attention (xla) agree under padding,
causal masks and packed segments; the whole model agrees too. cudnn (flash attention) needs a GPU: on a CPU only
its error is tested; on a GPU (scripts/gpu_checks.sh) it is compared with the reference in bfloat16. model.remat
changes memory, not results."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer.model import ModelConfig, Transformer, attention, attention_mask, dot_product_attention
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


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_the_fused_short_query_path_equals_the_einsum_path(causal, dtype, atol):
    """The reference takes a multiply-and-sum path for up to 8 queries (decoding steps, short sentences) and
    einsum above: both compute the same sums, under padding, causal masks and packed segments."""
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    query, key, value = (jax.random.normal(k, (3, 8, 2, 16)).astype(dtype) for k in keys)
    segmentation = packed_segments()
    mask = attention_mask(segmentation, segmentation, causal=causal)
    kw = dict(deterministic=True, rngs=None)
    real = np.asarray(segmentation != 0)
    for length in (2, 5, 8):  # queries; the keys stay 8
        fused, plain = (dot_product_attention(query[:, :length], key, value, mask[:, :, :length], nnx.Dropout(0.0),
                                              fused=flag, **kw) for flag in (True, False))
        assert fused.dtype == plain.dtype == dtype
        np.testing.assert_allclose(np.asarray(fused, np.float32)[real[:, :length]],
                                   np.asarray(plain, np.float32)[real[:, :length]], atol=atol)


def test_the_model_gives_the_same_logits_with_either_implementation():
    config = ModelConfig(vocab_size=40, emb_dim=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                         mlp_dim=64)
    inputs = jnp.array([[5, 6, 7, 1, 0, 0], [8, 9, 10, 11, 12, 1]])
    decoder_inputs = jnp.array([[0, 13, 14, 15, 0, 0], [0, 16, 17, 18, 19, 20]])
    logits = {}
    for implementation in ("reference", "xla"):
        model = Transformer(dataclasses.replace(config, attention=implementation), rngs=nnx.Rngs(0))
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
    logits = {name: Transformer(dataclasses.replace(config, attention=name), rngs=nnx.Rngs(0))(inputs, decoder_inputs)
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


@pytest.mark.parametrize("rng_impl", ["threefry2x32", "counter_hash"])
def test_remat_gives_the_same_loss_and_gradients(rng_impl):
    config = ModelConfig(vocab_size=40, emb_dim=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                         mlp_dim=64, dropout_rate=0.1)
    inputs = jnp.array([[5, 6, 7, 1, 0, 0], [8, 9, 10, 11, 12, 1]])
    decoder_inputs = jnp.array([[0, 13, 14, 15, 0, 0], [0, 16, 17, 18, 19, 20]])
    results = []
    for remat in (False, True):
        graphdef, params = nnx.split(Transformer(dataclasses.replace(config, remat=remat), rngs=nnx.Rngs(0)))

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
