"""The three model families from the same layers: decoder_only (a language model over `source <sep> target`) and
encoder_only (a masked language model) beside the paper's encoder-decoder: masks, cached decoding, masking
rates, FLOPs, and a run of each from the command line that learns well above chance."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import TINY_OVERRIDES, decode_incrementally, make_tiny_config, rescored_bleu
from transformer import steps, throughput, trainer
from transformer.features import FeatureExtractor
from transformer.model import ModelConfig, Transformer, build, join_pair
from transformer.model.masks import prefix_lm_mask
from transformer.tokenizer import EOS_ID
from transformer.settings import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(vocab_size=40, emb_dim=32, num_heads=4, mlp_dim=64)
DECODER_ONLY = dict(SHAPE, family="decoder_only", num_encoder_layers=0, num_decoder_layers=2)
ENCODER_ONLY = dict(SHAPE, family="encoder_only", num_encoder_layers=2, num_decoder_layers=0)
INPUTS = jnp.array([[5, 6, 7, 8, 1, 0, 0], [9, 10, 1, 0, 0, 0, 0]])
DECODER_INPUTS = jnp.array([[0, 11, 12, 13, 14, 1], [0, 15, 16, 1, 0, 0]])
# Two pairs packed in one row: sources of 4 and 3 tokens, targets of 3 and 4.
PACKING = dict(inputs_segmentation=jnp.array([[1, 1, 1, 1, 2, 2, 2]]), inputs_position=jnp.array([[0, 1, 2, 3, 0, 1, 2]]),
               targets_segmentation=jnp.array([[1, 1, 1, 2, 2, 2, 2]]),
               targets_position=jnp.array([[0, 1, 2, 0, 1, 2, 3]]))


@nnx.jit
def apply(model, inputs, decoder_inputs, packing=None):
    return model(inputs, decoder_inputs, **(packing or {}))


@pytest.fixture(scope="module", params=[("post", True), ("pre", True), ("post", False)],
                ids=["post-prefix_lm", "pre-prefix_lm", "post-causal"])
def decoder_only(request):
    layer_norm, prefix_lm = request.param
    return build(ModelConfig(**DECODER_ONLY, layer_norm=layer_norm, prefix_lm=prefix_lm), rngs=nnx.Rngs(0))


def test_the_prefix_mask_lets_no_target_see_a_later_one_nor_a_source_see_a_target():
    source_segmentation, target_segmentation = PACKING["inputs_segmentation"], PACKING["targets_segmentation"]
    _, segmentation, positions = join_pair(jnp.ones((1, 7), jnp.int32), source_segmentation,
                                           PACKING["inputs_position"], jnp.ones((1, 7), jnp.int32),
                                           target_segmentation, PACKING["targets_position"])
    # Each target is numbered on from its own source: pair 1's source has 4 tokens, pair 2's 3.
    np.testing.assert_array_equal(positions[0, 7:], [4, 5, 6, 3, 4, 5, 6])
    for prefix_lm in (True, False):
        mask = np.asarray(prefix_lm_mask(segmentation, 7, prefix_lm))[0, 0]
        segment = np.asarray(segmentation[0])
        target = np.arange(14) >= 7
        for query in range(14):
            for key in range(14):
                same = segment[query] == segment[key]
                if target[query] and target[key]:
                    expected = same and key <= query  # causal over the targets
                elif target[query]:
                    expected = same  # a target reads its whole source
                elif target[key]:
                    expected = False  # a source never reads a target
                else:
                    expected = same and (prefix_lm or key <= query)
                assert mask[query, key] == expected, (prefix_lm, query, key)


def test_changing_later_targets_leaves_earlier_logits_unchanged(decoder_only):
    logits = apply(decoder_only, INPUTS, DECODER_INPUTS)
    changed = apply(decoder_only, INPUTS, DECODER_INPUTS.at[:, 3:].set(20))
    np.testing.assert_allclose(changed[:, :3], logits[:, :3], atol=1e-5)
    assert np.abs(changed[:, 3:] - logits[:, 3:]).max() > 1e-3
    changed_source = apply(decoder_only, INPUTS.at[0, 1].set(21), DECODER_INPUTS)  # every target reads the source
    assert np.abs(changed_source[0] - logits[0]).min(axis=-1).max() > 1e-4


def test_packed_pairs_equal_each_pair_alone(decoder_only):
    source_a, source_b = jnp.array([5, 6, 7, 1]), jnp.array([9, 10, 1])
    target_a, target_b = jnp.array([0, 11, 12]), jnp.array([0, 15, 16, 17])
    packed = apply(decoder_only, jnp.concatenate([source_a, source_b])[None],
                   jnp.concatenate([target_a, target_b])[None], PACKING)[0]
    np.testing.assert_allclose(packed[:3], apply(decoder_only, source_a[None], target_a[None])[0], atol=1e-4)
    np.testing.assert_allclose(packed[3:], apply(decoder_only, source_b[None], target_b[None])[0], atol=1e-4)


def test_cached_decoding_equals_the_teacher_forced_pass(decoder_only):
    """The prefix is run once (init_cache), each step reads it and the cache in blocks: three hypotheses per
    sentence, each its own target, equal the teacher-forced pass of each."""
    targets = jnp.stack([DECODER_INPUTS, DECODER_INPUTS[::-1], DECODER_INPUTS.at[:, 2:].set(7)], axis=1)
    together = nnx.jit(decode_incrementally, static_argnames="blocks")(decoder_only, INPUTS, targets, blocks=2)
    for hypothesis in range(3):
        np.testing.assert_allclose(together[:, hypothesis], apply(decoder_only, INPUTS, targets[:, hypothesis]),
                                   atol=1e-4)


def test_the_families_build_only_their_stacks_and_refuse_what_they_cannot_be():
    params = nnx.to_pure_dict(nnx.state(build(ModelConfig(**DECODER_ONLY), rngs=nnx.Rngs(0)), nnx.Param))
    assert set(params) == {"decoder_layers", "source_embedder"}  # one table: the source's name, as encoder_decoder
    assert "cross_attention" not in params["decoder_layers"][0]
    params = nnx.to_pure_dict(nnx.state(build(ModelConfig(**ENCODER_ONLY), rngs=nnx.Rngs(0)), nnx.Param))
    assert set(params) == {"encoder_layers", "source_embedder"}
    refused = [
        (dict(DECODER_ONLY, num_encoder_layers=2), "set num_encoder_layers=0"),
        (dict(ENCODER_ONLY, num_decoder_layers=1), "set num_decoder_layers=0"),
        (dict(DECODER_ONLY, decoder_attention="local"), "decoder_attention='local' must be 'dense'"),
        (dict(DECODER_ONLY, share_embeddings=False), "set share_embeddings=True"),
        (dict(ENCODER_ONLY, masked_side="both", encoder_attention="local"), "encoder_attention='local' must be"),
        (dict(ENCODER_ONLY, masked_side="left"), "masked_side='left' is not one of"),
        (dict(SHAPE, family="encoder", num_encoder_layers=1, num_decoder_layers=1), "family='encoder' is not one"),
    ]
    for fields, message in refused:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ModelConfig(**fields)
    with pytest.raises(ValueError, match="builds family='encoder_decoder', not model.family='decoder_only'"):
        Transformer(ModelConfig(**DECODER_ONLY), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="train.bleu_every_steps=3 needs BLEU"):
        Settings.from_config(make_tiny_config(**{"model.family": "encoder_only",
                                                         "model.num_decoder_layers": 0, "train.bleu_every_steps": 3}))


def test_bert_masking_rates_on_a_large_sample():
    """15% of the real tokens but EOS chosen; of those 80% masked (token 0), 10% a random ordinary piece, 10%
    kept; padding and EOS never chosen; the labels are the chosen tokens. 4 standard deviations of slack."""
    rng = np.random.default_rng(0)
    vocab_size, rows, length = 1000, 400, 500
    tokens = rng.integers(3, vocab_size, size=(rows, length)).astype(np.int32)
    lengths = rng.integers(length // 2, length, size=rows)
    tokens[np.arange(length)[None] >= lengths[:, None]] = 0
    tokens[np.arange(rows), lengths - 1] = EOS_ID
    segmentation = (tokens != 0).astype(np.int32)
    masked, labels = jax.jit(steps.mask_tokens, static_argnums=(3, 4))(jax.random.key(1), jnp.asarray(tokens),
                                                                        jnp.asarray(segmentation), 0.15, vocab_size)
    masked, labels = np.asarray(masked), np.asarray(labels)
    candidates = (tokens != 0) & (tokens != EOS_ID)
    chosen = labels != 0
    assert not chosen[~candidates].any() and (masked[~candidates] == tokens[~candidates]).all()
    np.testing.assert_array_equal(labels[chosen], tokens[chosen])

    def near(count, total, rate):
        assert abs(count / total - rate) < 4 * np.sqrt(rate * (1 - rate) / total), (count / total, rate)
    near(chosen.sum(), candidates.sum(), 0.15)
    as_mask = chosen & (masked == steps.MASK_ID)
    kept = chosen & (masked == tokens)
    replaced = chosen & ~as_mask & ~kept
    near(as_mask.sum(), chosen.sum(), 0.8)
    near(replaced.sum(), chosen.sum(), 0.1 * (1 - 1 / (vocab_size - 3)))  # a random piece may be the token itself
    near(kept.sum(), chosen.sum(), 0.1 + 0.1 / (vocab_size - 3))
    assert masked[replaced].min() >= steps.FIRST_PIECE and masked[replaced].max() < vocab_size


def test_the_masked_language_model_scores_the_masked_tokens_the_same_way_each_evaluation():
    model = build(ModelConfig(**ENCODER_ONLY, masked_side="both"), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    batch = {"inputs": jnp.tile(INPUTS, (4, 1)), "targets": jnp.tile(jnp.roll(DECODER_INPUTS, -1, axis=1), (4, 1))}
    evaluate = jax.jit(lambda params, batch: steps.eval_step(params, batch, graphdef=graphdef, label_smoothing=0.0))
    first, again = evaluate(params, batch), evaluate(params, batch)
    assert float(first["nll"]) == float(again["nll"]) and first["denominator"] > 0  # the same tokens masked
    other = evaluate(params, {**batch, "inputs": batch["inputs"].at[0, 0].set(7)})
    masked = steps.masked_batch(batch, steps.eval_mask_key(batch), model.config)
    assert float(first["denominator"]) == float(jnp.sum(masked["targets"] != 0))
    assert float(first["source_tokens"]) == float(jnp.sum(masked["stream"] != 0))  # both sides read
    assert masked["stream"].shape[1] == INPUTS.shape[1] + DECODER_INPUTS.shape[1]
    # another batch is masked by another key
    assert not np.array_equal(steps.eval_mask_key(batch), steps.eval_mask_key({**batch, "inputs": batch["inputs"]
                                                                                .at[0, 0].set(7)}))
    assert float(other["denominator"]) > 0


def test_flops_count_what_each_family_runs():
    """decoder_only: every kernel on source and target tokens, the joined stream's (s + t)^2 pairs; encoder_only:
    every kernel and the output on the stream it reads."""
    d, ff, vocab, layers, rows, s, t = 64, 256, 500, 3, 8, 20, 12
    config = ModelConfig(vocab_size=vocab, emb_dim=d, num_heads=4, mlp_dim=ff, family="decoder_only",
                         num_encoder_layers=0, num_decoder_layers=layers)
    model = nnx.eval_shape(lambda: build(config, rngs=nnx.Rngs(0)))
    kernels = sum(int(np.prod(x.shape)) for path, x in jax.tree_util.tree_flatten_with_path(
        nnx.state(model, nnx.Param))[0] if "kernel" in str(path))
    expected = (6 * kernels * rows * (s + t) + 12 * d * layers * rows * (s + t) ** 2 + 6 * vocab * d * rows * t)
    assert throughput.model_flops_of_shape(config, rows, s, t) == pytest.approx(expected, rel=1e-12)
    config = ModelConfig(vocab_size=vocab, emb_dim=d, num_heads=4, mlp_dim=ff, family="encoder_only",
                         num_encoder_layers=layers, num_decoder_layers=0)
    model = nnx.eval_shape(lambda: build(config, rngs=nnx.Rngs(0)))
    kernels = sum(int(np.prod(x.shape)) for path, x in jax.tree_util.tree_flatten_with_path(
        nnx.state(model, nnx.Param))[0] if "kernel" in str(path))
    expected = 6 * kernels * rows * s + 12 * d * layers * rows * s**2 + 6 * vocab * d * rows * s
    assert throughput.model_flops(config, source_tokens=rows * s, target_tokens=rows * 2, encoder_pairs=rows * s**2,
                                  decoder_pairs=0, cross_pairs=0) == pytest.approx(expected, rel=1e-12)


def run_script(script, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


# The family runs train a few dozen steps, so that what they learn is measured against chance: 1 / vocab, and a
# loss of log(vocab) (the initial loss is higher still). Training is a few seconds of each run, most of which is
# compiling and decoding.
LEARNING = {"train.num_train_steps": 40, "train.log_every_steps": 10, "train.eval_every_steps": 20,
            "train.checkpoint_every_steps": 20}


def vocab_size_of(workdir) -> int:
    return json.loads((workdir / "config.json").read_text())["data"]["vocab_size"]  # the tokenizer's


@pytest.mark.slow  # a whole run that learns: ~25 s on 2 cores
def test_a_decoder_only_run_learns_decodes_with_beam_search_and_scores_bleu(tmp_path):
    workdir = tmp_path / "decoder_only"
    config = make_tiny_config(**{"model.family": "decoder_only", "model.num_encoder_layers": 0,
                                 "model.num_decoder_layers": 2, "decode.beam_size": 2, **LEARNING})
    result = trainer.Run(config, str(workdir)).train()
    # Measured at step 40: valid accuracy 0.095 (chance: 1 / 300), perplexity 81 (log 4.39; log 300 = 5.70): the
    # target's piece frequencies learnt (the commonest piece is 9.4% of the valid targets), not yet the source's
    # words, which take ~150 steps here. Untrained (every update zeroed), accuracy 0.
    vocab_size, valid = vocab_size_of(workdir), result["valid"]
    assert valid["accuracy"] > 20 / vocab_size and np.log(valid["perplexity"]) < np.log(vocab_size) - 1.0
    assert set(result["bleu"]) == {"valid", "test"}
    translations = workdir / "translations_test_step40.txt"
    assert len(translations.read_text().splitlines()) == 64
    rescored = rescored_bleu(workdir, translations, "test")
    assert {key: result["bleu"]["test"][key] for key in rescored} == pytest.approx(rescored)
    scores = run_script("eval.py", f"--workdir={workdir}", "--split=test")
    assert scores.returncode == 0, scores.stderr[-3000:]
    assert f"test BLEU {result['bleu']['test']['bleu']:.2f}" in scores.stdout  # eval.py decodes as the run did


@pytest.mark.slow  # a whole run that learns: ~25 s on 2 cores
def test_an_encoder_only_run_learns_reports_masked_accuracy_and_loads_as_a_feature_extractor(tmp_path):
    workdir = tmp_path / "encoder_only"
    overrides = {**TINY_OVERRIDES, "model.family": "encoder_only", "model.num_decoder_layers": 0,
                 "model.masked_side": "both", **LEARNING}
    result = run_script("train.py", f"--workdir={workdir}", *[f"--config.{k}={v}" for k, v in overrides.items()])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BLEU" not in result.stdout + result.stderr and "test masked accuracy" in result.stdout
    scores = json.loads((workdir / "scores.json").read_text())
    assert "bleu" not in scores and set(scores["masked"]) == {"valid", "test"}
    test, vocab_size = scores["masked"]["test"], vocab_size_of(workdir)
    # Measured at step 40: test masked accuracy 0.188, perplexity 70 (log 4.25; log 300 = 5.70). Untrained (every
    # update zeroed), 0.063 and 391: the tied embedding reads the 10% of chosen tokens kept as themselves, so chance
    # is above 1 / 300 here; with random pieces for labels, 0.077 and 257.
    assert test["accuracy"] > 0.12 and np.log(test["perplexity"]) < np.log(vocab_size) - 1.0
    assert test["target_tokens"] > 0
    evaluated = run_script("eval.py", f"--workdir={workdir}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert f"test masked accuracy {test['accuracy']:.4f}  perplexity {test['perplexity']:.3f}" in evaluated.stdout
    refused = run_script("eval.py", f"--workdir={workdir}", "--input=README.md")
    assert refused.returncode == 1 and "encoder_only (no decoder)" in refused.stderr
    extractor = FeatureExtractor(str(workdir))
    features, mask = extractor(["The black cat sleeps.", "Hi."])
    assert features.shape[:2] == mask.shape and features.shape[2] == 32 and mask[1].sum() < mask[0].sum()
    alone, _ = extractor(["Hi."])  # a sentence's features do not depend on its batch's padding
    np.testing.assert_allclose(features[1, :mask[1].sum()], alone[0], atol=1e-5)
