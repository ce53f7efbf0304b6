"""End to end: train.py then eval.py as a user runs them; resume equals an uninterrupted run; bad input fails
before anything in the workdir is replaced."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from tiny import TINY_OVERRIDES, make_tiny_config, tree_digest
from transformer import trainer
from transformer.checkpoint import CheckpointMismatchError
from transformer.sources import DataError
from transformer.tokenizer import VocabularyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script, *args):
    command = [sys.executable, os.path.join(ROOT, script), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run") / "demo"
    overrides = [f"--config.{key}={value}" for key, value in TINY_OVERRIDES.items()]
    result = run_script("train.py", f"--workdir={workdir}", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result.stdout


def test_train_writes_checkpoints_scores_logs_and_prints_bleu(trained_workdir):
    workdir, stdout = trained_workdir
    assert "test BLEU" in stdout and "nrefs:1|case:mixed|eff:no|tok:13a" in stdout
    assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]
    scores = json.loads((workdir / "scores.json").read_text())
    assert scores["step"] == 6 and 0.0 <= scores["bleu"]["test"]["bleu"] <= 100.0
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [2, 3, 4, 6]  # log and checkpoint steps
    assert os.listdir(workdir / "tensorboard")
    assert json.loads((workdir / "config.json").read_text())["model"]["emb_dim"] == 32
    assert len((workdir / "translations_test_step6.txt").read_text().splitlines()) == 64


def test_eval_restores_the_checkpoint_and_scores_a_split_and_a_file(trained_workdir, tmp_path):
    workdir, _ = trained_workdir
    (tmp_path / "in.txt").write_text("The black cat sleeps in the garden.\n\nTwo wolves are sad.\n")
    (tmp_path / "ref.txt").write_text("El gato negro duerme en el jardín.\nX\nDos lobos están tristes.\n")
    result = run_script("eval.py", f"--workdir={workdir}", "--step=3", "--split=test")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test BLEU" in result.stdout
    scores = json.loads((workdir / "eval" / "scores.step3.json").read_text())
    assert scores[0]["step"] == 3 and scores[0]["sentences"] == 64 and "signature" in scores[0]
    result = run_script("eval.py", f"--workdir={workdir}", f"--input={tmp_path / 'in.txt'}",
                        f"--reference={tmp_path / 'ref.txt'}", f"--output={tmp_path / 'out.txt'}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "out.txt").read_text().split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # line-aligned: the empty line stays empty
    (tmp_path / "ref.txt").write_text("only one line\n")
    result = run_script("eval.py", f"--workdir={workdir}", f"--input={tmp_path / 'in.txt'}",
                        f"--reference={tmp_path / 'ref.txt'}")
    assert result.returncode != 0
    assert "3 lines in --input" in result.stderr and "1 lines in --reference" in result.stderr


def test_an_unknown_config_key_fails_at_once_naming_it(tmp_path):
    result = run_script("train.py", f"--workdir={tmp_path / 'w'}", "--config.model.num_layers=2")
    assert result.returncode != 0 and "num_layers" in result.stderr
    assert not (tmp_path / "w").exists()


def final_params(workdir):
    return jax.device_get(trainer.restore(str(workdir)).params)


def recorder(monkeypatch):
    """Records a digest of every batch the trainer places on the devices (prefetch reads up to 2 ahead)."""
    seen = []
    place = trainer.place_batch

    def record(batch, batch_sharding):
        seen.append(tree_digest_of(batch))
        return place(batch, batch_sharding)
    monkeypatch.setattr(trainer, "place_batch", record)
    return seen


def tree_digest_of(batch):
    return tuple(np.asarray(batch[key]).tobytes().hex()[:4096] + str(np.asarray(batch[key]).sum()) for key in sorted(batch))


def test_a_stopped_and_resumed_run_sees_the_same_batches_and_ends_with_the_same_parameters(tmp_path, monkeypatch):
    straight_batches = recorder(monkeypatch)
    trainer.Run(make_tiny_config(**{"decode.bleu_splits": ""}), str(tmp_path / "straight")).train()
    stopped_batches = recorder(monkeypatch)
    trainer.Run(make_tiny_config(**{"decode.bleu_splits": "", "train.num_train_steps": 3}),
                str(tmp_path / "resumed")).train()
    resumed_batches = recorder(monkeypatch)
    run = trainer.Run(make_tiny_config(**{"decode.bleu_splits": ""}), str(tmp_path / "resumed"))
    assert int(run.state.step) == 3
    run.train()
    assert len(set(straight_batches[:6])) == 6  # distinct batches, so the comparison below means something
    assert stopped_batches[:3] == straight_batches[:3]
    assert (tmp_path / "resumed" / "checkpoints" / "3" / "data" / "process_0-of-1.json").exists()
    assert resumed_batches[:3] == straight_batches[3:6]
    records = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [2, 3, 4, 6]  # each step once
    straight, resumed = final_params(tmp_path / "straight"), final_params(tmp_path / "resumed")
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_resuming_with_another_config_is_refused_and_the_workdir_left_untouched(trained_workdir):
    workdir, _ = trained_workdir
    before = tree_digest(workdir)
    with pytest.raises(ValueError, match=r"model.mlp_dim: 64 -> 48.*seed: 0 -> 1"):
        trainer.Run(make_tiny_config(**{"model.mlp_dim": 48, "seed": 1}), str(workdir))
    assert tree_digest(workdir) == before


def test_a_checkpoint_of_another_model_shape_is_refused_and_left_untouched(trained_workdir, tmp_path):
    """A workdir whose config.json was lost or replaced still cannot load a mismatched checkpoint."""
    workdir, _ = trained_workdir
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(workdir), str(copy)], check=True)
    config = make_tiny_config(**{"model.mlp_dim": 48})
    (copy / "config.json").write_text(config.to_json())
    before = tree_digest(copy)
    expected = r"params/.*has shape \(64,\) but the model built from this config expects \(48,\)"
    with pytest.raises(CheckpointMismatchError, match=expected):
        trainer.Run(config, str(copy))
    assert tree_digest(copy) == before


@pytest.mark.parametrize("overrides, error, message", [
    ({"data.vocab_size": 100_000}, VocabularyError, "vocab_size"),
    ({"data.source": "tfds", "data.tfds_name": "no_such_dataset/xx"}, DataError, "no_such_dataset"),
    ({"data.source": "text", "data.text_dir": "/nonexistent/corpus"}, DataError, "/nonexistent/corpus"),
    ({"model.num_heads": 3}, ValueError, "num_heads=3 must divide emb_dim=32"),
    ({"model.positional_encoding": "learned", "model.max_length": 16}, ValueError, "model.max_length=16"),
    ({"decode.batch_size": 0}, ValueError, "decode.batch_size=0"),
    ({"data.builtin_valid_size": 0}, DataError, "the valid split has no sentence pairs"),
    ({"seed": -1}, ValueError, "config.seed=-1"),
])
def test_bad_input_fails_before_training_and_writes_nothing(tmp_path, overrides, error, message):
    workdir = tmp_path / "w"
    with pytest.raises(error, match=message):
        trainer.Run(make_tiny_config(**overrides), str(workdir))
    assert not workdir.exists() or not os.listdir(workdir)


def test_misaligned_and_empty_text_files_are_named(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.en").write_text("a b\nc d\n")
        (corpus / f"{split}.es").write_text("a b\nc d\n")
    (corpus / "valid.es").write_text("only one line\n")
    config = make_tiny_config(**{"data.source": "text", "data.text_dir": str(corpus)})
    with pytest.raises(DataError, match=r"2 lines.*1 line"):
        trainer.Run(config, str(tmp_path / "w"))
    (corpus / "valid.es").write_text("")
    (corpus / "valid.en").write_text("")
    with pytest.raises(DataError, match="empty"):
        trainer.Run(config, str(tmp_path / "w"))
