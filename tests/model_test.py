import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiny import decode_incrementally
from transformer.model import ModelConfig, build
from transformer.model.attention import to_cache_layout
from transformer.model.masks import attention_mask, sinusoidal_positions
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.plan import create_train_state, model_graphdef
from transformer.steps import train_step

TINY = dict(vocab_size=40, emb_dim=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, mlp_dim=64)
INPUTS = jnp.array([[5, 6, 7, 8, 1, 0, 0], [9, 10, 1, 0, 0, 0, 0]])
DECODER_INPUTS = jnp.array([[0, 11, 12, 13, 14, 1], [0, 15, 16, 1, 0, 0]])


@nnx.jit
def apply(model, inputs, decoder_inputs, packing=None):
    """One compiled forward pass (op-by-op eager dispatch costs seconds per new shape on CPU)."""
    return model(inputs, decoder_inputs, **(packing or {}))


@pytest.fixture(scope="module", params=["post", "pre"])
def model(request):
    return build(ModelConfig(**TINY, layer_norm=request.param), rngs=nnx.Rngs(0))


def test_logits_are_float32_with_expected_shape(model):
    logits = apply(model, INPUTS, DECODER_INPUTS)
    assert logits.shape == (2, 6, 40) and logits.dtype == jnp.float32


def test_changing_future_targets_leaves_earlier_logits_unchanged(model):
    logits = apply(model, INPUTS, DECODER_INPUTS)
    changed = apply(model, INPUTS, DECODER_INPUTS.at[:, 3:].set(20))
    np.testing.assert_allclose(changed[:, :3], logits[:, :3], atol=1e-5)
    assert np.abs(changed[:, 3:] - logits[:, 3:]).max() > 1e-3  # and the future positions do see the change


def test_extra_source_padding_changes_nothing(model):
    logits = apply(model, INPUTS, DECODER_INPUTS)
    padded = apply(model, jnp.pad(INPUTS, ((0, 0), (0, 5))), DECODER_INPUTS)
    np.testing.assert_allclose(padded, logits, atol=1e-5)


def test_packed_rows_equal_separate_sentences(model):
    """Two pairs packed into one row (segments 1, 2 with their own positions) give each pair's own logits."""
    source_a, source_b = jnp.array([5, 6, 7, 1]), jnp.array([9, 10, 1])
    target_a, target_b = jnp.array([0, 11, 12]), jnp.array([0, 15, 16, 17])
    separate_a = apply(model, source_a[None], target_a[None])[0]
    separate_b = apply(model, source_b[None], target_b[None])[0]
    packing = dict(inputs_segmentation=jnp.array([[1, 1, 1, 1, 2, 2, 2]]),
                   inputs_position=jnp.array([[0, 1, 2, 3, 0, 1, 2]]),
                   targets_segmentation=jnp.array([[1, 1, 1, 2, 2, 2, 2]]),
                   targets_position=jnp.array([[0, 1, 2, 0, 1, 2, 3]]))
    packed = apply(model, jnp.concatenate([source_a, source_b])[None], jnp.concatenate([target_a, target_b])[None],
                   packing)[0]
    np.testing.assert_allclose(packed[:3], separate_a, atol=1e-4)
    np.testing.assert_allclose(packed[3:], separate_b, atol=1e-4)


def test_cached_decoding_equals_teacher_forced_pass(model):
    logits = apply(model, INPUTS, DECODER_INPUTS)

    incremental = nnx.jit(decode_incrementally)(model, INPUTS, DECODER_INPUTS[:, None])[:, 0]
    np.testing.assert_allclose(incremental, logits, atol=1e-4)


def test_caches_are_head_major_in_blocks():
    model = build(ModelConfig(**TINY), rngs=nnx.Rngs(0))
    inputs = jnp.array([[5, 6, 7, 1, 0, 0, 0], [9, 10, 1, 0, 0, 0, 0]])
    cache = model.init_cache(jnp.ones((2, 7, 32)), inputs, 5, hypotheses=3, blocks=2)
    layer_cache = cache["layers"][0]["self_attention"]
    # keys [batch, heads, head_dim, rows], values [batch, heads, rows, head_dim]; 5 positions rounded up to 6, of
    # 3 hypotheses each: 18 rows in 2 blocks of 9
    assert [x.shape for x in layer_cache["key"]] == [(2, 4, 8, 9)] * 2
    assert [x.shape for x in layer_cache["value"]] == [(2, 4, 9, 8)] * 2
    with pytest.raises(ValueError, match="blocks=0 must be >= 1"):
        model.init_cache(jnp.ones((2, 7, 32)), inputs, 6, blocks=0)
    cross = cache["layers"][0]["cross_attention"]
    assert cross["key"].shape == (2, 4, 8, 7) and cross["value"].shape == (2, 4, 7, 8)
    np.testing.assert_array_equal(cache["source_mask"][:, 0, 0], inputs != 0)
    keys, values = (jax.random.normal(jax.random.key(i), (2, 7, 4, 8)) for i in (1, 2))
    head_major_keys, head_major_values = to_cache_layout(keys, values)
    assert head_major_keys[1, 2, 3, 5] == keys[1, 5, 2, 3] and head_major_values[1, 2, 5, 3] == values[1, 5, 2, 3]


def test_hypotheses_decoded_together_equal_each_decoded_alone(model):
    """decode_step with 3 hypotheses per sentence (each its own history by default) gives each one's logits of a
    cache of its own: the hypotheses share the sentence's cross-attention keys/values and nothing else."""
    targets = jnp.stack([DECODER_INPUTS, DECODER_INPUTS[::-1], DECODER_INPUTS.at[:, 2:].set(7)], axis=1)  # [2, 3, 6]

    together = nnx.jit(decode_incrementally, static_argnames="blocks")(model, INPUTS, targets, blocks=2)
    for hypothesis in range(3):
        alone = apply(model, INPUTS, targets[:, hypothesis])
        np.testing.assert_allclose(together[:, hypothesis], alone, atol=1e-4)


@pytest.mark.parametrize("rate", ["dropout_rate", "attention_dropout_rate", "relu_dropout_rate"])
def test_dropout_is_active_only_when_not_deterministic(rate):
    """Each of the three dropouts (residual, attention weights, after the ReLU), set alone, takes effect."""
    model = build(ModelConfig(**TINY, **{"dropout_rate": 0.0, rate: 0.3}), rngs=nnx.Rngs(0))

    @nnx.jit(static_argnames="deterministic")
    def run(model, key, deterministic):
        return model(INPUTS, DECODER_INPUTS, deterministic=deterministic, rngs=nnx.Rngs(dropout=key))
    key_1, key_2 = jax.random.key(1), jax.random.key(2)
    eval_logits = run(model, key_1, True)
    np.testing.assert_allclose(run(model, key_2, True), eval_logits, atol=1e-6)
    train_a, train_b, train_c = run(model, key_1, False), run(model, key_1, False), run(model, key_2, False)
    np.testing.assert_allclose(train_a, train_b, atol=1e-6)  # same key, same masks
    assert np.abs(train_a - eval_logits).max() > 1e-2 and np.abs(train_a - train_c).max() > 1e-2


def test_the_embedding_is_scaled_by_sqrt_d_model_and_the_positions_added():
    model = build(ModelConfig(**TINY), rngs=nnx.Rngs(0))
    tokens, positions = jnp.array([[5, 6, 7, 1]]), jnp.array([[0, 1, 2, 3]])
    embedded = model.source_embedder(tokens, positions, deterministic=True, rngs=None)
    table = np.asarray(model.source_embedder.embedding.embedding[...])
    expected = table[np.asarray(tokens)] * np.sqrt(TINY["emb_dim"]) + sinusoidal_positions(positions, TINY["emb_dim"])
    np.testing.assert_allclose(embedded, expected, atol=1e-5)


def test_sinusoids_match_the_paper_formula():
    encoding = np.asarray(sinusoidal_positions(jnp.arange(50)[None], 16))[0]
    position, i = 37, 3
    np.testing.assert_allclose(encoding[position, 2 * i], np.sin(position / 10000 ** (2 * i / 16)), atol=1e-5)
    np.testing.assert_allclose(encoding[position, 2 * i + 1], np.cos(position / 10000 ** (2 * i / 16)), atol=1e-5)


def test_attention_mask_blocks_padding_other_segments_and_future():
    mask = np.asarray(attention_mask(jnp.array([[1, 1, 2, 0]]), jnp.array([[1, 1, 2, 0]]), causal=True))[0, 0]
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(mask, expected)


def test_embedding_sharing_options_change_the_parameter_count():
    def count(**options):
        model = nnx.eval_shape(lambda: build(ModelConfig(**TINY, **options), rngs=nnx.Rngs(0)))
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    shared = count()
    assert count(share_embeddings=False) == shared + 40 * 32
    assert count(share_embeddings=False, tie_output_embedding=False) == shared + 2 * 40 * 32
    assert count(positional_encoding="learned", max_length=64) == shared + 64 * 32


def test_bfloat16_compute_keeps_float32_params_and_logits():
    model = build(ModelConfig(**TINY, dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    reference = build(ModelConfig(**TINY), rngs=nnx.Rngs(0))
    logits = apply(model, INPUTS, DECODER_INPUTS)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, reference(INPUTS, DECODER_INPUTS), atol=0.1)  # bf16 has ~3 digits


def dot_operand_dtypes(jaxpr, outputs: list | None = None) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in a jaxpr, the jaxprs nested in its equations (jit, scan, remat,
    custom gradients) included; `outputs`, when given, gets each one's result dtype."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(operand.aval.dtype) for operand in eqn.invars))
            if outputs is not None:
                outputs.append(str(eqn.outvars[0].aval.dtype))
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's own jaxpr
                if hasattr(inner, "eqns"):
                    found += dot_operand_dtypes(inner, outputs)
    return found


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_compute_dtype_is_the_dtype_of_every_matmul_of_a_forward_pass_and_a_train_step(dtype):
    """With dtype="bfloat16" every matrix product of the forward pass takes bfloat16 operands, and in the train
    step none takes two float32 ones (the backward passes of the products accumulated in float32, the attention
    logits and the output logits, take their float32 cotangent and a bfloat16 operand); parameters stay float32
    before and after the step, logits come out float32, and every forward product accumulates in float32. With
    float32, no product sees a bfloat16 operand."""
    config = ModelConfig(**{**TINY, "num_encoder_layers": 1, "num_decoder_layers": 1}, dtype=dtype)
    optimizer, schedule = make_optimizer(OptimizerConfig(learning_rate_scale=1.0, warmup_steps=10), TINY["emb_dim"])
    state = jax.eval_shape(lambda: create_train_state(config, optimizer, seed=0))  # traced, never run
    graphdef = model_graphdef(config)
    forward = jax.make_jaxpr(lambda params: nnx.merge(graphdef, params)(INPUTS, DECODER_INPUTS))(state.params)
    step = functools.partial(train_step, graphdef=graphdef, optimizer=optimizer, schedule=schedule,
                             label_smoothing=0.1)
    batch = {"inputs": INPUTS, "targets": DECODER_INPUTS}
    train = jax.make_jaxpr(step)(state, batch)
    results = []
    forward_dots, train_dots = dot_operand_dtypes(forward.jaxpr, results), dot_operand_dtypes(train.jaxpr)
    # Every product: per attention 4 projections and 2 products (3 attentions), 2 per feed-forward, the output's.
    assert len(forward_dots) == 3 * 6 + 2 * 2 + 1 and len(train_dots) > 2 * len(forward_dots)  # and the gradients'
    if dtype == "bfloat16":
        assert all(operands == ("bfloat16", "bfloat16") for operands in forward_dots), forward_dots
        # Accumulated in float32 (XLA's CPU backend runs a bfloat16-out product as a float32 one), then rounded.
        assert set(results) == {"float32"}, results
        assert all("bfloat16" in operands for operands in train_dots), train_dots
    else:
        assert all(operands == ("float32", "float32") for operands in forward_dots + train_dots)
    assert [x.dtype for x in forward.out_avals] == [jnp.float32]  # the logits
    updated, _ = jax.eval_shape(step, state, batch)
    assert {x.dtype for x in jax.tree.leaves((state.params, updated.params))} == {jnp.dtype(jnp.float32)}


def test_init_std_draws_every_kernel_and_embedding_from_one_normal():
    def stds(**kw):
        params = nnx.to_pure_dict(nnx.state(build(ModelConfig(**{**TINY, "vocab_size": 400}, **kw),
                                                  rngs=nnx.Rngs(0)), nnx.Param))
        flat = {"/".join(map(str, k)): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        return {k: v.std() for k, v in flat.items() if k.endswith(("kernel']", "embedding']"))}
    default, marian = stds(), stds(init_std=0.02)
    assert len(marian) == len(default) > 10
    for name, std in marian.items():
        assert 0.017 < std < 0.023, name
    mlp_out = [k for k in default if "feed_forward" in k and "output" in k][0]
    assert abs(default[mlp_out] - 64**-0.5) < 0.02  # lecun normal: fan_in^-0.5 (mlp_dim 64)
    assert abs(default[[k for k in default if "embedding']" in k][0]] - 32**-0.5) < 0.02


@pytest.mark.parametrize("bad, message", [
    (dict(num_heads=5), "num_heads=5 must divide emb_dim=32"),
    (dict(layer_norm="middle"), "layer_norm='middle'"),
    (dict(dtype="float16"), "dtype='float16'"),
    (dict(dropout_rate=1.5), "dropout_rate=1.5"),
    (dict(init_std=-0.02), "init_std=-0.02"),
])
def test_bad_model_configs_fail_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**TINY, **bad})


def test_untied_output_projection_gives_float32_logits_under_bfloat16():
    model = build(ModelConfig(**TINY, dtype="bfloat16", tie_output_embedding=False), rngs=nnx.Rngs(0))
    assert apply(model, INPUTS, DECODER_INPUTS).dtype == jnp.float32
