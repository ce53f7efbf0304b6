"""The attention kinds against the dense reference (model.encoder_attention, decoder_attention, cross_attention).

local: a window of r positions (the paper's restricted self-attention), computed in blocks; equal to dense when
the window covers the row, to dense under a band mask otherwise, and to jax's own local_window_size; in a model,
cached decoding (a ring of r + 1 positions) equals the teacher-forced pass, padding changes no real position,
packed rows equal separate sentences, and beam search's scores are the teacher-forced log-probabilities.

linformer: keys and values projected along the length (encoder self-attention, one sentence per row); equal to
softmax(Q (E^T K)^T / sqrt(d)) (F^T V) computed by hand and unlike dense on the same projections; padding
changes no real position, cached decoding equals the teacher-forced pass, and what it cannot do is refused at
config time, by name.

performer: softmax estimated by positive orthogonal random features (every sublayer, one sentence per row); its
error against softmax falls as the features grow, the causal form in blocks equals the whole masked product, and
in a model cached decoding over running sums equals the teacher-forced pass, beam search's reordering carries
each hypothesis's sums, padding changes no real position, and the features come from the run's seed alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from tiny import assert_beam_scores_are_teacher_forced_log_probs, decode_incrementally
from transformer.model import ModelConfig, build
from transformer.model.attention import DenseSelfAttention, attention
from transformer.model.blocks import Inputs
from transformer.model.local import local_attention, windowed_attention
from transformer.model.masks import SelfMask
from transformer.model.performer import (causal_sums, feature_exponents, key_exponents, performer_attention,
                                         random_features)
from transformer.settings import Settings

# Rows of 11: two sentences then padding; one filling the row; three short ones (lengths not a multiple of r).
SEGMENTS = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0], [1] * 11, [1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 0]])


def operands(seed=0, shape=(3, 11, 2, 8)):
    return [jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(seed), 3)]


def dense(query, key, value, mask):
    return attention("reference", query, key, value, mask, None, deterministic=True, rngs=None)


def real(x):
    return np.asarray(x)[np.asarray(SEGMENTS != 0)]  # padding queries see nothing: their output is unused


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [11, 40])
def test_local_with_a_window_past_the_length_equals_dense(causal, window):
    query, key, value = operands()
    mask = SelfMask(SEGMENTS, causal=causal)
    local = jax.jit(local_attention, static_argnums=4)(query, key, value, mask, window)
    np.testing.assert_allclose(real(local), real(dense(query, key, value, mask.dense())), atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_local_equals_dense_under_a_band_mask(causal, window):
    """Blocks of r queries over their neighbours' keys give what the whole matrix gives under |i - j| <= r
    (causal: 0 <= i - j <= r), within each sentence of a packed row; and a window this short does change the
    output, so the band is really applied."""
    query, key, value = operands(1)
    mask = SelfMask(SEGMENTS, causal=causal)
    distance = jnp.arange(11)[:, None] - jnp.arange(11)[None, :]
    band = (distance <= window) & (distance >= (0 if causal else -window))
    local = jax.jit(local_attention, static_argnums=4)(query, key, value, mask, window)
    np.testing.assert_allclose(real(local), real(dense(query, key, value, mask.dense() & band)), atol=1e-5)
    assert np.abs(real(local) - real(dense(query, key, value, mask.dense()))).max() > 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_local_agrees_with_jaxs_local_window_size(causal):
    """jax.nn.dot_product_attention's local_window_size (the xla kernel here, cuDNN's on a GPU) has the same
    window: the left and right sizes are not swapped, and the segment mask still applies."""
    query, key, value = operands(2)
    mask = SelfMask(SEGMENTS, causal=causal)
    kw = dict(deterministic=True, rngs=None)
    ours = windowed_attention("reference", query, key, value, mask, 2, None, **kw)
    jaxs = windowed_attention("xla", query, key, value, mask, 2, None, **kw)
    np.testing.assert_allclose(real(jaxs), real(ours), atol=1e-5)


def test_a_kind_where_it_has_no_meaning_is_refused_at_config_time():
    with pytest.raises(ValueError, match=r"cross_attention='local' is not one of \('dense', 'performer'\)"):
        ModelConfig(vocab_size=40, cross_attention="local")
    with pytest.raises(ValueError, match="local_window=0 must be >= 1"):
        ModelConfig(vocab_size=40, encoder_attention="local", local_window=0)


LOCAL = ModelConfig(vocab_size=40, emb_dim=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, mlp_dim=64,
                    encoder_attention="local", decoder_attention="local", local_window=2)
INPUTS = jnp.array([[5, 6, 7, 8, 9, 10, 11, 1, 0], [9, 10, 1, 0, 0, 0, 0, 0, 0]])
DECODER_INPUTS = jnp.array([[0, 11, 12, 13, 14, 15, 16, 17, 1], [0, 15, 16, 1, 0, 0, 0, 0, 0]])


@pytest.fixture(scope="module")
def local_model():
    return build(LOCAL, rngs=nnx.Rngs(0))


@nnx.jit
def apply(model, inputs, decoder_inputs, packing=None):
    return model(inputs, decoder_inputs, **(packing or {}))


def test_a_local_model_differs_from_the_dense_one_with_the_same_parameters(local_model):
    dense_model = build(dataclasses.replace(LOCAL, encoder_attention="dense", decoder_attention="dense"),
                        rngs=nnx.Rngs(0))
    difference = np.abs(apply(local_model, INPUTS, DECODER_INPUTS) - apply(dense_model, INPUTS, DECODER_INPUTS))
    assert difference.max() > 1e-2  # the windows are in force (2 positions of 9)


@pytest.mark.parametrize("hypotheses", [pytest.param(1, marks=pytest.mark.slow), 3])  # 3 covers 1's path
def test_local_cached_decoding_in_a_ring_equals_the_teacher_forced_pass(local_model, hypotheses):
    """9 positions through a cache of r + 1 = 3: each step overwrites the oldest position, which no query of the
    window still sees; hypotheses decoded together keep their own rows."""
    targets = jnp.stack([DECODER_INPUTS, DECODER_INPUTS[::-1], DECODER_INPUTS.at[:, 4:].set(7)][:hypotheses], axis=1)

    cache = nnx.eval_shape(lambda: local_model.init_cache(local_model.encode(INPUTS), INPUTS, targets.shape[-1],
                                                          hypotheses=hypotheses))
    assert cache["layers"][0]["self_attention"]["key"][0].shape[-1] == 3 * hypotheses  # the ring, not the 9 positions
    together = nnx.jit(decode_incrementally)(local_model, INPUTS, targets)
    for hypothesis in range(hypotheses):
        np.testing.assert_allclose(together[:, hypothesis], apply(local_model, INPUTS, targets[:, hypothesis]),
                                   atol=1e-4)


def test_local_padding_changes_no_real_position(local_model):
    logits = apply(local_model, INPUTS, DECODER_INPUTS)
    padded = apply(local_model, jnp.pad(INPUTS, ((0, 0), (0, 5))), jnp.pad(DECODER_INPUTS, ((0, 0), (0, 4))))
    np.testing.assert_allclose(padded[:, :9], logits, atol=1e-5)


def test_local_packed_rows_equal_separate_sentences(local_model):
    source_a, source_b = jnp.array([5, 6, 7, 8, 9, 1]), jnp.array([9, 10, 11, 1])
    target_a, target_b = jnp.array([0, 11, 12, 13, 14]), jnp.array([0, 15, 16, 17, 18])
    packing = dict(inputs_segmentation=jnp.array([[1] * 6 + [2] * 4]),
                   inputs_position=jnp.array([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]]),
                   targets_segmentation=jnp.array([[1] * 5 + [2] * 5]),
                   targets_position=jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]))
    packed = apply(local_model, jnp.concatenate([source_a, source_b])[None],
                   jnp.concatenate([target_a, target_b])[None], packing)[0]
    np.testing.assert_allclose(packed[:5], apply(local_model, source_a[None], target_a[None])[0], atol=1e-4)
    np.testing.assert_allclose(packed[5:], apply(local_model, source_b[None], target_b[None])[0], atol=1e-4)


def test_local_beam_scores_equal_teacher_forced_log_probs(local_model):
    """Beam search reorders its beams through the ancestor table; with a ring cache the table still names, for
    each position of the window, the beam slot whose rows hold it."""
    assert_beam_scores_are_teacher_forced_log_probs(local_model, INPUTS)


LINFORMER = dataclasses.replace(LOCAL, encoder_attention="linformer", decoder_attention="dense", linformer_length=4,
                                max_length=16)


@pytest.fixture(scope="module")
def linformer_model():
    return build(LINFORMER, rngs=nnx.Rngs(0))


def test_linformer_attends_over_e_k_and_f_v_by_hand_and_differs_from_dense(linformer_model):
    """The model's encoder self-attention is softmax(Q (E^T K)^T / sqrt(d)) (F^T V), heads apart, then the output
    projection, with E and F the module's key_projection and value_projection tables cut to the row's length and
    the padding positions' keys and values zeroed first; the same projections under dense attention give another
    output, so the kind is in force."""
    attention_module = linformer_model.encoder_layers[0].self_attention
    x = jax.random.normal(jax.random.key(7), (2, 9, LINFORMER.emb_dim))
    segmentation = (INPUTS != 0).astype(jnp.int32)

    @nnx.jit
    def attend(module, x, mask):
        return module(x, Inputs(self_mask=mask), deterministic=True, rngs=None)[0]
    linformer = np.asarray(attend(attention_module, x, SelfMask(segmentation)))

    dense_module = DenseSelfAttention(dataclasses.replace(LINFORMER, encoder_attention="dense"), "encoder_attention",
                                      rngs=nnx.Rngs(0))
    for name in ("query", "key", "value", "output"):
        getattr(dense_module, name).kernel[...] = getattr(attention_module, name).kernel[...]
    dense_output = np.asarray(attend(dense_module, x, SelfMask(segmentation)))
    assert np.abs(dense_output - linformer)[np.asarray(segmentation != 0)].max() > 1e-2

    def kernel(linear):
        return np.asarray(linear.kernel[...], np.float64)
    heads, head_dim = LINFORMER.num_heads, LINFORMER.head_dim
    x64 = np.asarray(x, np.float64)
    query, key, value = (np.reshape(x64 @ kernel(linear), (2, 9, heads, head_dim))
                         for linear in (attention_module.query, attention_module.key, attention_module.value))
    real_tokens = np.asarray(segmentation != 0, np.float64)[:, :, None, None]
    e = np.asarray(attention_module.key_projection[...], np.float64)[:9]  # [length, linformer_length]
    f = np.asarray(attention_module.value_projection[...], np.float64)[:9]
    projected_keys = np.einsum("lk,blhd->bkhd", e, key * real_tokens)  # E^T K per row and head
    projected_values = np.einsum("lk,blhd->bkhd", f, value * real_tokens)
    logits = np.einsum("bqhd,bkhd->bhqk", query, projected_keys) / np.sqrt(head_dim)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attended = np.einsum("bhqk,bkhd->bqhd", weights, projected_values).reshape(2, 9, LINFORMER.emb_dim)
    np.testing.assert_allclose(linformer, attended @ kernel(attention_module.output), atol=1e-5)


def test_linformer_padding_changes_no_real_position(linformer_model):
    """Padding keys and values are zeroed before the projection: a row padded to the longest input the
    projection takes gives the same logits."""
    logits = apply(linformer_model, INPUTS, DECODER_INPUTS)
    padded = apply(linformer_model, jnp.pad(INPUTS, ((0, 0), (0, 7))), DECODER_INPUTS)
    np.testing.assert_allclose(padded, logits, atol=1e-5)


def test_linformer_cached_decoding_equals_the_teacher_forced_pass(linformer_model):
    incremental = nnx.jit(decode_incrementally)(linformer_model, INPUTS, DECODER_INPUTS[:, None])[:, 0]
    np.testing.assert_allclose(incremental, apply(linformer_model, INPUTS, DECODER_INPUTS), atol=1e-4)


def test_linformer_is_refused_where_it_cannot_work_naming_why():
    with pytest.raises(ValueError, match="decoder_attention='linformer' is not one of"):
        ModelConfig(vocab_size=40, decoder_attention="linformer")
    assert LINFORMER.position_limit == 16  # longer inputs are cut to it, like any over-long input
    config = default.get_config()
    config.model.encoder_attention = "linformer"
    with pytest.raises(ValueError, match="one sentence per row: set data.pack=false"):
        Settings.from_config(config)
    config.data.pack = False
    config.model.max_length = 32
    with pytest.raises(ValueError, match=r"model.max_length=32 \(linformer's projection\) is shorter than "
                                         "data.max_length=64"):
        Settings.from_config(config)
    config.model.max_length = 64
    assert Settings.from_config(config).model["encoder_attention"] == "linformer"


def softmax_error(features: int, causal: bool, seeds=range(6)) -> float:
    """Performer's mean absolute error against softmax attention on fixed inputs, averaged over feature seeds."""
    query, key, value = [x * 0.5 for x in operands(3, (2, 64, 2, 16))]
    segmentation = jnp.ones((2, 64), jnp.int32).at[1, 40:].set(0)
    mask = SelfMask(segmentation, causal=causal)
    exact = dense(query, key, value, mask.dense())
    estimate = jax.jit(lambda f: performer_attention(query, key, value, mask, f))  # one compile, not op by op
    errors = [jnp.abs(estimate(random_features(jax.random.key(seed), features, 16)) - exact)[segmentation != 0].mean()
              for seed in seeds]
    return float(np.mean(errors))


@pytest.mark.parametrize("causal", [False, True])
def test_performer_error_against_softmax_falls_as_the_features_grow(causal):
    errors = [softmax_error(m, causal) for m in (8, 32, 128, 512)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0] / 3, errors  # roughly 1/sqrt(m): 8 -> 512 is 8x


def performer_estimate(query, key, value, segmentation, features, causal):
    """What performer_attention estimates, in float64 and in the log domain, so that nothing under- or overflows:
    weights sum_m exp(a_m(q) + b_m(k)) over feature_exponents a, b, normalised over the keys a query reads."""
    a, b = (np.asarray(feature_exponents(x, features), np.float64) for x in (query, key))
    logits = np.logaddexp.reduce(a[:, :, None] + b[:, None], axis=-1)  # [batch, q, k, heads]
    allowed = (np.asarray(segmentation) != 0)[:, None, :, None]
    if causal:
        allowed = allowed & np.tri(query.shape[1], dtype=bool)[None, :, :, None]
    logits = np.where(allowed, logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=2, keepdims=True))
    return np.einsum("bqkh,bkhd->bqhd", weights / weights.sum(axis=2, keepdims=True), np.asarray(value, np.float64))


@pytest.mark.parametrize("causal", [False, True])
def test_performer_in_blocks_equals_its_whole_estimate(causal):
    """The prefix-sum form (blocks of 4 over 11 positions, so a part-filled last block) and the non-causal sums
    give what the [length, length] weights of the features give, padding left out."""
    query, key, value = operands(4)
    features, segmentation = random_features(jax.random.key(0), 32, 8), jnp.ones((3, 11), int).at[0, 8:].set(0)
    if causal:
        numerator, normalizer = causal_sums(feature_exponents(query, features),
                                            key_exponents(key, features, segmentation), value, block=4)
        output = numerator / normalizer[..., None]
    else:
        output = performer_attention(query, key, value, SelfMask(segmentation), features)
    np.testing.assert_allclose(real(output)[:30], real(performer_estimate(query, key, value, segmentation,
                                                                           features, causal))[:30], atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_performer_keeps_large_keys_finite_and_exact(causal):
    """Queries and keys of large norm, whose unshifted features underflowed (0 / 0: NaN gradients in training),
    later keys larger still (the causal shift grows along the row): the shifted sums still give the estimate, and
    their gradients stay finite at norms where a block's keys outgrow each other past float32's range."""
    query, key, value = operands(5, (2, 96, 2, 16))
    features, segmentation = random_features(jax.random.key(1), 64, 16), jnp.ones((2, 96), int)
    query, key = query * 6, key * 6 * jnp.linspace(1, 1.5, 96)[None, :, None, None]
    mask = SelfMask(segmentation, causal=causal)
    np.testing.assert_allclose(performer_attention(query, key, value, mask, features),
                               performer_estimate(query, key, value, segmentation, features, causal), atol=1e-4)
    gradient = jax.jit(jax.grad(lambda q, k, scale: jnp.sum(performer_attention(q * scale, k * scale, value, mask,
                                                                               features) ** 2), (0, 1)))
    for scale in (1.5, 4.0):
        gradients = gradient(query, key, scale)
        assert all(bool(jnp.isfinite(g).all()) for g in gradients), scale


@pytest.mark.parametrize("scale", [1.5, 4.0])
def test_causal_performer_is_exact_when_keys_jump_inside_a_block(scale):
    """The finiteness test's operands at its scales, and one key inside the first 64-position block made far
    larger in one feature (its exponent rises by more than the cap of 60 within the block), and one in the second
    block, which also reads the first's sums: the causal sums still equal the float64 estimate at every query,
    before and after the jumps, and their gradients stay finite."""
    query, key, value = operands(5, (2, 96, 2, 16))
    features, segmentation = random_features(jax.random.key(1), 64, 16), jnp.ones((2, 96), int)
    query, key = query * 6 * scale, key * 6 * scale * jnp.linspace(1, 1.5, 96)[None, :, None, None]
    widest = int(jnp.argmax(jnp.linalg.norm(features, axis=-1)))  # key 20 along a feature: its exponent |w|^2 / 2
    key = key.at[:, (20, 80)].set(features[widest] * 16 ** 0.25)  # in the first block, and in the second
    exponents = np.asarray(key_exponents(key, features, segmentation))
    assert (exponents[:, 20] - exponents[:, :20].max(axis=1)).max() > 60  # the setup: a jump past the cap
    mask = SelfMask(segmentation, causal=True)
    got = np.asarray(jax.jit(performer_attention)(query, key, value, mask, features))
    np.testing.assert_allclose(got, performer_estimate(query, key, value, segmentation, features, True),
                               atol=1e-4)
    gradients = jax.jit(jax.grad(lambda q, k: jnp.sum(performer_attention(q, k, value, mask, features) ** 2),
                                 (0, 1)))(query, key)
    assert all(bool(jnp.isfinite(g).all()) and bool(jnp.any(g != 0)) for g in gradients)


def test_random_features_are_orthogonal_within_a_block():
    features = random_features(jax.random.key(0), 20, 8)  # blocks of 8, 8 and 4 rows
    directions = features / jnp.linalg.norm(features, axis=-1, keepdims=True)
    for block in (directions[:8], directions[8:16], directions[16:]):
        np.testing.assert_allclose(block @ block.T, np.eye(len(block)), atol=1e-5)
    assert np.abs(directions[:8] @ directions[8:16].T).max() > 1e-2  # blocks are independent draws


PERFORMER = dataclasses.replace(LOCAL, encoder_attention="performer", decoder_attention="performer",
                                cross_attention="performer", performer_features=16)


@pytest.fixture(scope="module")
def performer_model():
    return build(PERFORMER, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("hypotheses", [pytest.param(1, marks=pytest.mark.slow), 3])  # 3 covers 1's path
def test_performer_cached_decoding_over_running_sums_equals_the_teacher_forced_pass(performer_model, hypotheses):
    targets = jnp.stack([DECODER_INPUTS, DECODER_INPUTS[::-1], DECODER_INPUTS.at[:, 4:].set(7)][:hypotheses], axis=1)
    cache = nnx.eval_shape(lambda: performer_model.init_cache(performer_model.encode(INPUTS), INPUTS, 9,
                                                              hypotheses=hypotheses))
    state = cache["layers"][0]["self_attention"]["state"]
    assert state.shape == (2, hypotheses, 4, 16, 8)  # m x d per head, whatever the length
    together = nnx.jit(decode_incrementally)(performer_model, INPUTS, targets)
    for hypothesis in range(hypotheses):
        np.testing.assert_allclose(together[:, hypothesis], apply(performer_model, INPUTS, targets[:, hypothesis]),
                                   atol=1e-4)


def test_performer_beam_scores_equal_teacher_forced_log_probs(performer_model):
    """A reordered beam takes its parent's running sums (decode_step reads the parent from the ancestor table):
    otherwise a hypothesis's score would mix another's prefix."""
    assert_beam_scores_are_teacher_forced_log_probs(performer_model, INPUTS)


def test_performer_padding_changes_no_real_position(performer_model):
    logits = apply(performer_model, INPUTS, DECODER_INPUTS)
    padded = apply(performer_model, jnp.pad(INPUTS, ((0, 0), (0, 5))), jnp.pad(DECODER_INPUTS, ((0, 0), (0, 4))))
    np.testing.assert_allclose(padded[:, :9], logits, atol=1e-5)


def test_performer_features_come_from_the_runs_seed_and_nothing_else(performer_model):
    """The same parameters give the same logits in a model rebuilt from the same config, other logits under
    another seed; the features are no parameter, so a checkpoint holds the dense model's tree."""
    params = nnx.state(performer_model, nnx.Param)
    def rebuilt(seed):
        model = build(dataclasses.replace(PERFORMER, seed=seed), rngs=nnx.Rngs(1))
        nnx.update(model, params)
        return apply(model, INPUTS, DECODER_INPUTS)
    np.testing.assert_array_equal(rebuilt(0), apply(performer_model, INPUTS, DECODER_INPUTS))
    assert np.abs(rebuilt(1) - rebuilt(0)).max() > 1e-3
    dense_params = nnx.state(build(dataclasses.replace(PERFORMER, encoder_attention="dense",
                                                       decoder_attention="dense", cross_attention="dense"),
                                   rngs=nnx.Rngs(0)), nnx.Param)
    assert jax.tree.structure(params) == jax.tree.structure(dense_params)


def test_performer_is_refused_with_packing_and_attention_dropout_naming_why():
    config = default.get_config()
    config.seed = 5
    config.model.decoder_attention = "performer"
    with pytest.raises(ValueError, match="model.decoder_attention='performer' mixes the positions of a row .* set "
                                         "data.pack=false"):
        Settings.from_config(config)
    config.data.pack = False
    assert Settings.from_config(config).model_config(40).seed == 5  # the run's seed draws the features
    with pytest.raises(ValueError, match="cross_attention='performer' forms no attention weights"):
        ModelConfig(vocab_size=40, cross_attention="performer", attention_dropout_rate=0.1)
