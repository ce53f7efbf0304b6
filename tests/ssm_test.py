"""The Mamba-2 mixer (model/ssm.py, decoder_attention="ssm" or a pattern with it).

The chunked form equals the recurrence run token by token in float64 (outputs, final states, gradients), at chunk
sizes that do and do not divide the length, over packed segments and padding; in a hybrid model cached decoding
(a fixed-size state per hypothesis) equals the teacher-forced pass in both families that have a decoder, beam
search's scores are the teacher-forced log-probabilities, packed rows equal separate sentences, padding changes
nothing real, and what it cannot be is refused by name; configs/hybrid.py's decoder trains from the command line's
path, learns above chance and decodes with beam search. The sharded step is in multidevice_test.py."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import assert_beam_scores_are_teacher_forced_log_probs, decode_incrementally, make_tiny_config

from configs import hybrid as hybrid_config
from transformer import trainer
from transformer.model import ModelConfig, build
from transformer.model.ssm import causal_conv, segment_order, ssd

# Rows of 11: two sentences then padding; one filling the row; three short ones.
SEGMENTS = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0], [1] * 11, [1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 0]])


def operands(seed=0, heads=3, state=4, head_dim=5):
    batch, length = SEGMENTS.shape
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (batch, length, heads, head_dim))
    dt = jax.nn.softplus(jax.random.normal(keys[1], (batch, length, heads))) * (SEGMENTS != 0)[..., None]
    a = -jnp.exp(jax.random.uniform(keys[2], (heads,), minval=-1.0, maxval=1.0))
    b = jax.random.normal(keys[3], (batch, length, state))
    c = jax.random.normal(keys[4], (batch, length, state))
    return x, dt, a, b, c


def recurrence(x, dt, a, b, c, segmentation):
    """The state-space recurrence token by token in float64: the state restarts where the segment changes."""
    x, dt, a, b, c = (np.asarray(v, np.float64) for v in (x, dt, a, b, c))
    batch, length, heads, head_dim = x.shape
    y, finals = np.zeros_like(x), []
    for row in range(batch):
        state = np.zeros((heads, b.shape[-1], head_dim))
        for t in range(length):
            if t and segmentation[row, t] != segmentation[row, t - 1]:
                state = np.zeros_like(state)
            state = (np.exp(dt[row, t] * a)[:, None, None] * state
                     + dt[row, t][:, None, None] * b[row, t][None, :, None] * x[row, t][:, None, :])
            y[row, t] = np.einsum("n,hnp->hp", c[row, t], state)
        finals.append(state)
    return y, np.stack(finals)


@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 16])
def test_the_chunked_form_equals_the_recurrence_token_by_token(chunk):
    """Chunks of 1 (a scan over tokens), 3 and 4 (segments crossing chunk borders, a padded last chunk), 11 and 16
    (one chunk): within a chunk the masked quadratic form, between chunks the scanned states."""
    operand = operands()
    y, final = jax.jit(ssd, static_argnums=6)(*operand, jnp.asarray(SEGMENTS), chunk)
    expected_y, expected_final = recurrence(*operand, SEGMENTS)
    np.testing.assert_allclose(y, expected_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final, expected_final, rtol=1e-4, atol=1e-4)


def test_the_chunked_forms_gradients_equal_the_scanned_recurrences():
    """The gradients of every input, through the masked exponentials of the chunked form, are those of a plain scan
    over tokens (finite where a segment or the padding cuts a chunk)."""
    operand = operands(1)
    weights = jax.random.normal(jax.random.key(2), operand[0].shape)

    def scanned(x, dt, a, b, c):
        def step(state, inputs):
            x_t, dt_t, b_t, c_t, restart = inputs
            state = jnp.where(restart, 0.0, state)
            state = (jnp.exp(dt_t * a)[..., None, None] * state
                     + jnp.einsum("bh,bn,bhp->bhnp", dt_t, b_t, x_t))
            return state, jnp.einsum("bn,bhnp->bhp", c_t, state)
        restart = np.concatenate([np.zeros((3, 1), bool), SEGMENTS[:, 1:] != SEGMENTS[:, :-1]], axis=1)
        start = jnp.zeros((3, x.shape[2], b.shape[-1], x.shape[-1]))
        _, y = jax.lax.scan(step, start, [jnp.moveaxis(v, 1, 0) for v in (x, dt, b, c)]
                            + [jnp.asarray(restart.T)[:, :, None, None, None]])
        return jnp.sum(jnp.moveaxis(y, 0, 1) * weights)

    def chunked(x, dt, a, b, c):
        return jnp.sum(ssd(x, dt, a, b, c, jnp.asarray(SEGMENTS), 4)[0] * weights)

    grads = jax.jit(jax.grad(chunked, argnums=range(5)))(*operand)
    expected = jax.jit(jax.grad(scanned, argnums=range(5)))(*operand)
    for name, got, want in zip("x dt a b c".split(), grads, expected):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3, err_msg=name)


def test_the_convolution_reads_only_earlier_positions_of_its_own_segment():
    u = jax.random.normal(jax.random.key(3), (3, 11, 2))
    weight, bias = jax.random.normal(jax.random.key(4), (4, 2)), jnp.array([0.5, -0.5])
    out = np.asarray(causal_conv(u, weight, bias, jnp.asarray(SEGMENTS)))
    u, weight = np.asarray(u), np.asarray(weight)
    for row in range(3):
        for t in range(11):
            expected = bias + sum(weight[3 - back] * u[row, t - back] for back in range(4)
                                  if t - back >= 0 and SEGMENTS[row, t - back] == SEGMENTS[row, t])
            np.testing.assert_allclose(out[row, t], expected, rtol=1e-5, atol=1e-5)


def test_segment_order_reads_each_source_then_its_target():
    # decoder_only's joined stream: sources 1 and 2 (and padding), then targets 1 and 2.
    segmentation = jnp.array([[1, 1, 2, 0, 1, 1, 1, 2, 2, 0]])
    order = np.asarray(segment_order(segmentation))[0]
    np.testing.assert_array_equal(order, [0, 1, 4, 5, 6, 2, 7, 8, 3, 9])


SHAPE = dict(vocab_size=40, emb_dim=32, num_heads=4, mlp_dim=64, ssm_state=8, ssm_head_dim=16, ssm_chunk=4)
HYBRID = ModelConfig(**SHAPE, num_encoder_layers=1, num_decoder_layers=3, decoder_attention="ssm,ssm,dense")
INPUTS = jnp.array([[5, 6, 7, 8, 9, 10, 11, 1, 0], [9, 10, 1, 0, 0, 0, 0, 0, 0]])
DECODER_INPUTS = jnp.array([[0, 11, 12, 13, 14, 15, 16, 17, 1], [0, 15, 16, 1, 0, 0, 0, 0, 0]])


@pytest.fixture(scope="module", params=["encoder_decoder", "decoder_only-prefix_lm", "decoder_only-causal"])
def hybrid(request):
    if request.param == "encoder_decoder":
        return build(HYBRID, rngs=nnx.Rngs(0))
    return build(dataclasses.replace(HYBRID, family="decoder_only", num_encoder_layers=0, share_embeddings=True,
                                     prefix_lm=request.param.endswith("prefix_lm")), rngs=nnx.Rngs(0))


@nnx.jit
def apply(model, inputs, decoder_inputs, packing=None):
    return model(inputs, decoder_inputs, **(packing or {}))


def test_the_hybrid_builds_its_pattern_and_differs_from_the_dense_model():
    model = build(HYBRID, rngs=nnx.Rngs(0))
    kinds = [layer.self_attention.kind for layer in model.decoder_layers]
    assert kinds == ["ssm", "ssm", "dense"]
    dense = build(dataclasses.replace(HYBRID, decoder_attention="dense"), rngs=nnx.Rngs(0))
    assert np.abs(apply(model, INPUTS, DECODER_INPUTS) - apply(dense, INPUTS, DECODER_INPUTS)).max() > 1e-2


def test_cached_decoding_with_a_fixed_state_equals_the_teacher_forced_pass(hybrid):
    """Three hypotheses per sentence, each its own target: the state of each ssm layer is [heads, N, P] per
    hypothesis, whatever the length, and the steps give the teacher-forced logits (decoder_only: after the prefix
    ran once, prefill, its padding inert)."""
    targets = jnp.stack([DECODER_INPUTS, DECODER_INPUTS[::-1], DECODER_INPUTS.at[:, 4:].set(7)], axis=1)
    cache = nnx.eval_shape(lambda: hybrid.init_cache(hybrid.encode(INPUTS), INPUTS, 9, hypotheses=3))
    assert cache["layers"][0]["self_attention"]["state"].shape == (2, 3, 4, 8, 16)
    assert cache["layers"][0]["self_attention"]["u"].shape == (2, 3, 3, 64)  # ssm_conv - 1 inputs of the convolution
    together = nnx.jit(decode_incrementally)(hybrid, INPUTS, targets)
    for hypothesis in range(3):
        np.testing.assert_allclose(together[:, hypothesis], apply(hybrid, INPUTS, targets[:, hypothesis]), atol=1e-4)


def test_beam_scores_equal_teacher_forced_log_probs(hybrid):
    """A reordered beam takes its parent's state and convolution window (Mamba2.reorder)."""
    assert_beam_scores_are_teacher_forced_log_probs(hybrid, INPUTS)


def test_later_targets_leave_earlier_logits_unchanged(hybrid):
    logits = apply(hybrid, INPUTS, DECODER_INPUTS)
    changed = apply(hybrid, INPUTS, DECODER_INPUTS.at[:, 3:].set(20))
    np.testing.assert_allclose(changed[:, :3], logits[:, :3], atol=1e-5)
    assert np.abs(changed[:, 3:] - logits[:, 3:]).max() > 1e-3


def test_padding_changes_no_real_position(hybrid):
    logits = apply(hybrid, INPUTS, DECODER_INPUTS)
    padded = apply(hybrid, jnp.pad(INPUTS, ((0, 0), (0, 5))), jnp.pad(DECODER_INPUTS, ((0, 0), (0, 4))))
    np.testing.assert_allclose(padded[:, :9], logits, atol=1e-5)


def test_packed_rows_equal_separate_sentences(hybrid):
    """No state or convolution crosses from one sentence to the next (decoder_only: each target reads on from its
    own source, which its stream holds apart from it)."""
    source_a, source_b = jnp.array([5, 6, 7, 8, 9, 1]), jnp.array([9, 10, 11, 1])
    target_a, target_b = jnp.array([0, 11, 12, 13, 14]), jnp.array([0, 15, 16, 17, 18])
    packing = dict(inputs_segmentation=jnp.array([[1] * 6 + [2] * 4]),
                   inputs_position=jnp.array([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]]),
                   targets_segmentation=jnp.array([[1] * 5 + [2] * 5]),
                   targets_position=jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]))
    packed = apply(hybrid, jnp.concatenate([source_a, source_b])[None],
                   jnp.concatenate([target_a, target_b])[None], packing)[0]
    np.testing.assert_allclose(packed[:5], apply(hybrid, source_a[None], target_a[None])[0], atol=1e-4)
    np.testing.assert_allclose(packed[5:], apply(hybrid, source_b[None], target_b[None])[0], atol=1e-4)


NOPE = dataclasses.replace(HYBRID, decoder_positions=False)


@pytest.mark.slow
def test_a_decoder_without_positions_reads_no_position_and_decodes_as_it_teacher_forces():
    """model.decoder_positions=False (NoPE): shifting the decoder's positions changes no logit, where with
    positions it does; the encoder keeps its own; cached decoding still equals the teacher-forced pass."""
    positions = jnp.arange(9)[None].repeat(2, axis=0)
    segmentation = (DECODER_INPUTS != 0).astype(jnp.int32).at[:, 0].set(1)
    plain = dict(targets_position=positions, targets_segmentation=segmentation)
    shifted = dict(targets_position=positions + 7, targets_segmentation=segmentation)
    for config, moves in ((NOPE, False), (HYBRID, True)):
        model = build(config, rngs=nnx.Rngs(0))
        change = np.abs(apply(model, INPUTS, DECODER_INPUTS, shifted) - apply(model, INPUTS, DECODER_INPUTS, plain))
        assert (change.max() > 1e-3) == moves, (config.decoder_positions, change.max())
    model = build(NOPE, rngs=nnx.Rngs(0))
    moved_source = dict(inputs_position=positions + 3,
                        inputs_segmentation=(INPUTS != 0).astype(jnp.int32))
    assert np.abs(apply(model, INPUTS, DECODER_INPUTS, moved_source) - apply(model, INPUTS, DECODER_INPUTS)).max() > 1e-3
    targets = jnp.stack([DECODER_INPUTS, DECODER_INPUTS[::-1]], axis=1)
    together = nnx.jit(decode_incrementally)(model, INPUTS, targets)
    for hypothesis in range(2):
        np.testing.assert_allclose(together[:, hypothesis], apply(model, INPUTS, targets[:, hypothesis]), atol=1e-4)


@pytest.mark.parametrize("fields, message", [
    (dict(encoder_attention="ssm"), r"encoder_attention='ssm' is not one of \('dense', 'local', 'linformer', "),
    (dict(decoder_attention="ssm", ssm_head_dim=24), "ssm_head_dim=24 must divide ssm_expand x emb_dim = 64"),
    (dict(cross_attention="ssm"), r"cross_attention='ssm' is not one of"),
    (dict(decoder_attention="dense,ssm", ssm_chunk=0), "ssm_chunk=0 must all be >= 1"),
    (dict(decoder_attention="ssm", ssm_expand=0), "ssm_expand=0, ssm_head_dim=16, ssm_conv=4, ssm_chunk=4 must all"),
    (dict(family="decoder_only", num_encoder_layers=0, decoder_positions=False),
     "decoder_positions=False is for family='encoder_decoder'"),
    (dict(decoder_attention="ssm,dense", scan_layers=True),
     "scan_layers=True stacks identical layers, and decoder_attention='ssm,dense' cycles 2 kinds"),
])
def test_what_the_mixer_cannot_be_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**SHAPE, **fields})


@pytest.mark.slow  # a whole run that learns: ~25 s on 2 cores
def test_a_hybrid_run_learns_and_decodes_with_beam_search(tmp_path):
    """configs/hybrid.py's pattern over a tiny model's 3 decoder layers, 40 steps: above chance on valid, and both
    splits translated with beam search through the mixer's cached decoding."""
    workdir = tmp_path / "hybrid"
    config = make_tiny_config(**{"model.decoder_attention": hybrid_config.get_config().model.decoder_attention,
                                 "model.num_decoder_layers": 3, "model.ssm_state": 16, "model.ssm_head_dim": 16,
                                 "decode.beam_size": 2, "train.num_train_steps": 40, "train.log_every_steps": 10,
                                 "train.eval_every_steps": 20, "train.checkpoint_every_steps": 20})
    result = trainer.Run(config, str(workdir)).train()
    vocab_size = json.loads((workdir / "config.json").read_text())["data"]["vocab_size"]
    valid = result["valid"]
    assert valid["accuracy"] > 20 / vocab_size and np.log(valid["perplexity"]) < np.log(vocab_size) - 1.0
    assert set(result["bleu"]) == {"valid", "test"}
    assert len((workdir / "translations_test_step40.txt").read_text().splitlines()) == 64
