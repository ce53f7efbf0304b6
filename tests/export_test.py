"""scripts/export.py: a trained workdir as a Hugging Face MarianMTModel that computes our function (greedy
translations token for token, teacher-forced logits to float32 rounding), and the models and outputs it refuses
before writing anything. The tests that load the export need torch and transformers (pip install -e
".[export]"), and are skipped without them; the refusals need neither."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import load_script, make_tiny_config, tree_digest
from transformer import data, decode, trainer
from transformer.model import ModelConfig, unstack_layer_params
from transformer.model.masks import sinusoidal_positions
from transformer.tokenizer import EOS_ID, PAD_ID, UNK_ID
from transformer.plan import init_params, model_graphdef
from transformer.restore import restore
from transformer.workdir import CONFIG_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
export = load_script("export")

# Long enough that greedy search ends its translations with EOS before the length limit (so HF's one limit per
# batch and our limit per sentence do not matter), deep and wide enough that a layer, head or feature out of
# place would show: 2 + 2 layers, 4 heads.
TRAINED = {"model.num_encoder_layers": 2, "model.num_decoder_layers": 2, "model.emb_dim": 64, "model.num_heads": 4,
           "model.mlp_dim": 128, "model.layer_norm_epsilon": 1e-5, "optimizer.warmup_steps": 50,
           "train.num_train_steps": 600, "train.eval_every_steps": 600, "train.checkpoint_every_steps": 300,
           "train.log_every_steps": 100, "decode.average_last": 2, "decode.beam_size": 1,
           "decode.max_extra_length": 10}
SENTENCES = 16  # of the dev split


def hf_modules():
    """torch and transformers, or a clean skip without them."""
    return pytest.importorskip("torch"), pytest.importorskip("transformers")


def run_export(*args):
    command = [sys.executable, os.path.join(ROOT, "scripts", "export.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)


def write_workdir_config(workdir, **overrides):
    """A workdir with config.json alone: enough for every refusal, which comes before any restore."""
    config = make_tiny_config(**{"model.layer_norm_epsilon": 1e-5, **overrides})
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, CONFIG_FILE), "w", encoding="utf-8") as handle:
        handle.write(config.to_json(indent=2))
    return str(workdir)


# ----------------------------------------------------------------------------------------------------
# Refusals: no torch needed


@pytest.mark.parametrize("key, value, reason", [
    ("model.layer_norm", "pre", "post-LN"),
    ("model.positional_encoding", "learned", "fixed sinusoids"),
    ("model.layer_norm_epsilon", 1e-6, "--allow_layer_norm_epsilon_change"),
])
def test_a_model_marian_cannot_express_is_refused_with_the_reason_before_anything_is_written(tmp_path, key, value,
                                                                                            reason):
    workdir = write_workdir_config(tmp_path / "run", **{key: value})
    before = tree_digest(workdir)
    with pytest.raises(export.ExportError, match=f"{key}=.*{reason}"):
        export.export(workdir, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists() and tree_digest(workdir) == before
    default_output = os.path.join(workdir, "export")
    with pytest.raises(export.ExportError, match=key):
        export.export(workdir)
    assert not os.path.exists(default_output)


def test_a_model_setting_the_mapping_does_not_know_is_refused_unless_at_its_default(monkeypatch):
    monkeypatch.setattr(export, "MAPPED_FIELDS", export.MAPPED_FIELDS - {"mlp_dim"})  # as if mlp_dim were new
    export.check_exportable(ModelConfig(vocab_size=8, layer_norm_epsilon=1e-5))
    with pytest.raises(export.ExportError, match="model.mlp_dim=64: the export does not know"):
        export.check_exportable(ModelConfig(vocab_size=8, layer_norm_epsilon=1e-5, mlp_dim=64))


def test_settings_of_features_the_model_does_not_use_and_the_seed_are_no_reason_to_refuse():
    """A run with seed 3, a capacity factor but no experts, a local window but no local attention exports; the same
    settings are refused where the model uses them (performer draws its features from the seed)."""
    export.check_exportable(ModelConfig(vocab_size=8, layer_norm_epsilon=1e-5, seed=3, capacity_factor=2.0,
                                        local_window=5, ssm_state=8, prefix_lm=False))
    with pytest.raises(export.ExportError, match="model.num_experts=4"):
        export.check_exportable(ModelConfig(vocab_size=8, layer_norm_epsilon=1e-5, num_experts=4, capacity_factor=2.0))
    with pytest.raises(export.ExportError, match="model.seed=3.*model.decoder_attention='performer'|"
                                                 "model.decoder_attention='performer'.*model.seed=3"):
        export.check_exportable(ModelConfig(vocab_size=8, layer_norm_epsilon=1e-5, seed=3,
                                            decoder_attention="performer"))


def test_an_existing_non_empty_output_is_refused_naming_it_and_left_as_it_was(tmp_path):
    workdir = write_workdir_config(tmp_path / "run")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "mine.txt").write_text("keep me")
    with pytest.raises(export.ExportError, match=f"--output={tmp_path / 'hf'} exists and is not empty"):
        export.export(workdir, str(tmp_path / "hf"))
    (tmp_path / "file").write_text("a file")
    with pytest.raises(export.ExportError, match="file exists and is not empty"):
        export.export(workdir, str(tmp_path / "file"))
    result = run_export(f"--workdir={workdir}", "--format=hf", f"--output={tmp_path / 'hf'}")
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        f"error: --output={tmp_path / 'hf'} exists and is not empty: an export never overwrites; choose a new "
        "directory")
    assert os.listdir(tmp_path / "hf") == ["mine.txt"] and (tmp_path / "hf" / "mine.txt").read_text() == "keep me"


def test_our_sinusoids_permuted_are_marians():
    """The permutation export applies to every weight, checked against Marian's own table's layout: sin of each
    frequency in the first half, cos in the second (MarianSinusoidalPositionalEmbedding.create_weight)."""
    emb_dim, positions = 16, np.arange(12)
    ours = np.asarray(sinusoidal_positions(jnp.asarray(positions)[None], emb_dim))[0]
    angles = positions[:, None] / np.power(10000, 2 * np.arange(emb_dim // 2) / emb_dim)
    marian = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    np.testing.assert_allclose(ours[:, export.model_dimension_order(emb_dim)], marian, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# The mapping on random parameters: every tie and layout Marian can express


def shifted(targets) -> np.ndarray:
    """Teacher-forced decoder inputs [batch, length]: each target (EOS included) shifted right after pad, the
    start symbol of both models."""
    decoder_inputs = np.zeros((len(targets), max(map(len, targets))), np.int64)
    for row, target in zip(decoder_inputs, targets):
        row[1:len(target)] = target[:-1]
    return decoder_inputs


def our_logits(model_config, params, inputs, decoder_inputs):
    model = nnx.merge(model_graphdef(model_config), params)
    return np.asarray(model(jnp.asarray(inputs), jnp.asarray(decoder_inputs)))


def hf_logits(hf_model, inputs, decoder_inputs):
    torch, _ = hf_modules()
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor(inputs), attention_mask=torch.tensor(inputs != PAD_ID),
                        decoder_input_ids=torch.tensor(decoder_inputs)).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{}, {"share_embeddings": False}, {"tie_output_embedding": False},
                                    {"share_embeddings": False, "tie_output_embedding": False},
                                    {"scan_layers": True}])
def test_marian_computes_our_logits_for_every_embedding_tie_and_scanned_layers(layout):
    hf_modules()
    model_config = ModelConfig(vocab_size=40, emb_dim=16, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                               mlp_dim=32, layer_norm_epsilon=1e-5, **layout)
    params = init_params(model_config, jax.random.key(1))
    # Not the initial ones and zeros: LayerNorm's and the feed-forward's biases and scales must land in place too.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    inputs = np.random.default_rng(0).integers(3, 40, (3, 7))
    inputs[1, 5:], inputs[2, 3:] = PAD_ID, PAD_ID  # padded rows: the source mask must agree
    decoder_inputs = np.random.default_rng(1).integers(1, 40, (3, 6))
    decoder_inputs[:, 0] = PAD_ID
    hf_model = export.marian_model(params, model_config, longest=20)
    np.testing.assert_allclose(hf_logits(hf_model, inputs, decoder_inputs),
                               our_logits(model_config, params, inputs, decoder_inputs), atol=1e-4, rtol=0)
    if model_config.scan_layers:  # unstacked into the same weights as the per-layer model's
        unscanned = dataclasses.replace(model_config, scan_layers=False)
        np.testing.assert_equal(export.marian_state_dict(params, model_config),
                                export.marian_state_dict(unstack_layer_params(params), unscanned))


# ----------------------------------------------------------------------------------------------------
# A trained workdir, exported


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    hf_modules()  # skipped before the training when the export cannot be loaded
    workdir = str(tmp_path_factory.mktemp("export") / "run")
    trainer.Run(make_tiny_config(**TRAINED), workdir).train()  # the real train path: vocabulary, data, checkpoints
    return workdir


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """(output, restored, hf tokenizer, hf model): exported as eval.py restores by default (the average of the
    config's decode.average_last = 2 checkpoints), read back by from_pretrained."""
    _, transformers = hf_modules()
    output, restored = export.export(trained, str(tmp_path_factory.mktemp("hf") / "model"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(output)
    model = transformers.MarianMTModel.from_pretrained(output).eval()
    return output, restored, tokenizer, model


def our_greedy(restored, sentences, max_extra_length):
    """Our greedy translations (ids, EOS included) and each one's limit: up to the (cut) source's length +
    max_extra_length tokens, EOS forced at the last."""
    search = decode.make_search(restored.graphdef, max_extra_length=max_extra_length, beam_size=1)
    ours = decode.search_sentences(search, restored.params, restored.tokenizer, sentences, 8,
                                   restored.input_bound).best_ids()
    limits = [min(len(x), restored.input_bound) + max_extra_length for x in restored.tokenizer.encode(sentences)]
    return ours, limits


@pytest.fixture(scope="module")
def dev(exported):
    """Real dev sentences, their ids, our greedy translations of them and their limits."""
    _, restored, _, _ = exported
    sentences = [source for source, _ in data.read_split(restored.settings.data, "valid")[:SENTENCES]]
    return (sentences, restored.tokenizer.encode(sentences),
            *our_greedy(restored, sentences, restored.settings.decode.max_extra_length))


def assert_generate_gives(model, tokenizer, sentences, ours, limits):
    """HF's greedy search, one sentence at a time to its own limit, gives our ids."""
    torch, _ = hf_modules()
    for sentence, expected, limit in zip(sentences, ours, limits):
        with torch.no_grad():
            generated = model.generate(**tokenizer([sentence], return_tensors="pt", truncation=True), num_beams=1,
                                       do_sample=False, max_new_tokens=limit)[0].tolist()
        assert generated[0] == PAD_ID and generated[1:] == expected.tolist(), sentence


@pytest.mark.slow
def test_the_export_is_a_marian_directory_with_our_ids(exported, dev):
    output, restored, tokenizer, model = exported
    sentences, ids, _, _ = dev
    assert restored.name == "avg2_step600" and restored.averaged_steps == [300, 600]
    assert {"config.json", "generation_config.json", "model.safetensors", "source.spm", "target.spm", "vocab.json",
            "tokenizer_config.json"} <= set(os.listdir(output))
    assert not [name for name in os.listdir(os.path.dirname(output)) if ".partial-" in name]
    config = json.loads(open(os.path.join(output, "config.json"), encoding="utf-8").read())
    assert config["architectures"] == ["MarianMTModel"] and config["activation_function"] == "relu"
    assert (config["pad_token_id"], config["eos_token_id"], config["decoder_start_token_id"]) == (PAD_ID, EOS_ID,
                                                                                                  PAD_ID)
    assert config["scale_embedding"] and config["vocab_size"] == restored.tokenizer.vocab_size
    assert type(tokenizer).__name__ == "MarianTokenizer"
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (PAD_ID, EOS_ID, UNK_ID)
    vocab = json.loads(open(os.path.join(output, "vocab.json"), encoding="utf-8").read())
    assert vocab == {restored.tokenizer.processor.id_to_piece(i): i for i in range(restored.tokenizer.vocab_size)}
    assert tokenizer(sentences)["input_ids"] == [list(x) for x in ids]  # our ids, EOS appended
    assert tokenizer.decode(ids[0], skip_special_tokens=True) == restored.tokenizer.decode(ids[0])


@pytest.mark.slow
def test_greedy_generate_gives_our_greedy_translations_token_for_token(exported, dev):
    torch, _ = hf_modules()
    _, restored, tokenizer, model = exported
    sentences, ids, ours, limits = dev
    assert max(map(len, ids)) > restored.input_bound  # a source cut to the bound: truncation=True cuts it alike
    assert_generate_gives(model, tokenizer, sentences, ours, limits)
    # Padded into one batch, with the export's generation config as is (greedy; one limit for the batch).
    with torch.no_grad():
        batched = model.generate(**tokenizer(sentences, return_tensors="pt", padding=True, truncation=True)).tolist()
    before_limit = [i for i, x in enumerate(ours) if len(x) < limits[i]]
    print(f"{len(before_limit)} of {len(ours)} translations end before their limit")
    assert len(before_limit) >= SENTENCES // 2  # the trained model ends most translations itself
    for i in before_limit:
        assert batched[i][1:len(ours[i]) + 1] == ours[i].tolist() and set(batched[i][len(ours[i]) + 1:]) <= {PAD_ID}
    translations = tokenizer.batch_decode(batched, skip_special_tokens=True)
    assert [translations[i] for i in before_limit] == [restored.tokenizer.decode(ours[i]) for i in before_limit]


@pytest.mark.slow
def test_at_the_length_limit_both_searches_end_with_eos(exported, dev):
    """With no extra length, some translations reach their limit: ours allows only EOS there, and so does HF's
    forced_eos_token_id at max_new_tokens."""
    _, restored, tokenizer, model = exported
    sentences = dev[0]
    ours, limits = our_greedy(restored, sentences, 0)
    assert any(len(x) == limit for x, limit in zip(ours, limits))
    assert_generate_gives(model, tokenizer, sentences, ours, limits)


@pytest.mark.slow
def test_teacher_forced_logits_agree_with_ours(exported, dev):
    _, restored, tokenizer, model = exported
    sentences, _, ours, _ = dev
    inputs = tokenizer(sentences, return_tensors="np", padding=True, truncation=True)["input_ids"]
    decoder_inputs = shifted(ours)
    theirs = hf_logits(model, inputs, decoder_inputs)
    mine = our_logits(restored.model_config, restored.params, inputs, decoder_inputs)
    print(f"max |HF - our| logit difference {np.abs(theirs - mine).max():.2e} (logits up to {np.abs(mine).max():.1f})")
    np.testing.assert_allclose(theirs, mine, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_the_command_line_exports_the_named_step_and_says_what_it_wrote(trained, exported, tmp_path):
    _, transformers = hf_modules()
    output = tmp_path / "hf300"
    output.mkdir()  # an empty directory is no refusal: the export replaces it
    result = run_export(f"--workdir={trained}", "--format=hf", f"--output={output}", "--step=300",
                        "--average_last=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == (f"wrote a Hugging Face MarianMTModel of step300 to {output}: config.json, "
                                     "generation_config.json, model.safetensors, source.spm, target.spm, vocab.json "
                                     f"({exported[1].tokenizer.vocab_size} pieces)")
    restored = restore(trained, 300)
    expected = export.marian_state_dict(restored.params, restored.model_config)
    loaded = transformers.MarianMTModel.from_pretrained(str(output)).state_dict()
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded[name].numpy(), value, err_msg=name)
    default = run_export(f"--workdir={trained}", "--format=hf")
    assert default.returncode == 0, default.stderr[-3000:]
    default_output = os.path.join(trained, "export", "hf.avg2_step600")
    assert default.stdout.strip().startswith(f"wrote a Hugging Face MarianMTModel of avg2_step600 (the average of "
                                             f"steps [300, 600]) to {default_output}: ")
    assert os.path.exists(os.path.join(default_output, "model.safetensors"))


@pytest.mark.slow
def test_the_epsilon_flag_exports_a_model_within_that_epsilon_of_ours(trained, exported, dev, tmp_path):
    """A model trained with another LayerNorm epsilon is refused, unless the flag accepts Marian's 1e-5: its logits
    then differ from ours by the epsilon's effect only (well under 1e-4 here)."""
    _, restored, tokenizer, _ = exported
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir, ignore=shutil.ignore_patterns("tokens", "compilation_cache", "tensorboard",
                                                                    "export"))
    config = json.loads((workdir / CONFIG_FILE).read_text())
    config["model"]["layer_norm_epsilon"] = 1e-6
    (workdir / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(export.ExportError, match="layer_norm_epsilon=1e-06"):
        export.export(str(workdir), str(tmp_path / "refused"))
    output, other = export.export(str(workdir), str(tmp_path / "hf"), allow_epsilon_change=True)
    _, transformers = hf_modules()
    model = transformers.MarianMTModel.from_pretrained(output).eval()
    sentences, _, ours, _ = dev
    inputs = tokenizer(sentences, return_tensors="np", padding=True, truncation=True)["input_ids"]
    decoder_inputs = shifted(ours)
    difference = np.abs(hf_logits(model, inputs, decoder_inputs)
                        - our_logits(other.model_config, other.params, inputs, decoder_inputs)).max()
    print(f"max logit difference from layer_norm_epsilon 1e-6 -> 1e-5: {difference:.2e}")
    assert 0 < difference < 1e-4


@pytest.mark.slow
def test_the_ctranslate2_export_decodes_our_greedy_and_beam_tokens(trained, exported, dev, tmp_path):
    """CTranslate2's Marian converter refuses our vocabulary (pad first) and starts from a zero embedding; the
    export fills its spec itself, and its Translator then finds our greedy and beam-4 translations."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from import_test import assert_ctranslate2_gives_ours
    output, restored = export.export(trained, str(tmp_path / "ct2"), output_format="ctranslate2")
    assert {"model.bin", "config.json", "shared_vocabulary.json", "source.spm", "target.spm"} <= set(os.listdir(output))
    translator = ctranslate2.Translator(output, device="cpu")
    ended = assert_ctranslate2_gives_ours(translator, restored, dev[0], restored.settings.decode.max_extra_length)
    print(f"translations ended before their limit, of {len(dev[0])}: {ended}")
    assert min(ended.values()) >= 1  # compared exactly, EOS included, in both searches
    result = run_export(f"--workdir={trained}", "--format=ctranslate2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith("wrote a CTranslate2 model of avg2_step600")
