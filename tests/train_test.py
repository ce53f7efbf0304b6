"""End to end: train.py then eval.py as a user runs them; resume equals an uninterrupted run; bad input fails
before anything in the workdir is replaced."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from tiny import TINY_OVERRIDES, load_script, make_tiny_config, metric_records, rescored_bleu, tree_digest
from transformer import decode, sharding, throughput, trainer
from transformer.checkpoint import CheckpointMismatchError
from transformer.sources import DataError
from transformer.tokenizer import VocabularyError
from transformer.evaluation import SAMPLE_TRANSLATIONS
from transformer.restore import restore
from transformer.settings import Settings
from transformer.workdir import REPORTS_FILE, use_compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script, *args):
    command = [sys.executable, os.path.join(ROOT, script), *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)


# The module's run: the tiny config, keeping the best checkpoint by dev BLEU, with a profile of two steps.
RUN_OVERRIDES = {"train.keep_best_checkpoint": True, "train.bleu_every_steps": 3, "train.profile_steps": "4-5"}


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run") / "demo"
    overrides = [f"--config.{key}={value}" for key, value in {**TINY_OVERRIDES, **RUN_OVERRIDES}.items()]
    result = run_script("train.py", f"--workdir={workdir}", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result.stdout, result.stderr  # the results, and the log


def test_train_writes_checkpoints_scores_logs_and_prints_bleu(trained_workdir):
    workdir, stdout, log = trained_workdir
    assert "test BLEU" in stdout and "nrefs:1|case:mixed|eff:no|tok:13a" in stdout
    assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]
    scores = json.loads((workdir / "scores.json").read_text())
    assert scores["step"] == 6
    for split, score in scores["bleu"].items():  # the scores of the translations written, as printed
        rescored = rescored_bleu(workdir, workdir / f"translations_{split}_step6.txt", split)
        assert {key: score[key] for key in rescored} == pytest.approx(rescored), split
        assert f"step 6: {split} BLEU {score['bleu']:.2f} ({score['signature']})" in log  # the progress line
    records = metric_records(workdir)
    assert [r["step"] for r in records if r["split"] == "train"] == [2, 3, 4, 6]  # log and checkpoint steps
    vocab_size = int(re.search(r"; vocab (\d+);", log).group(1))  # the tokenizer's, logged at the start
    assert_throughput_is_the_windows_count_over_its_seconds([r for r in records if r["split"] == "train"], vocab_size)
    assert os.listdir(workdir / "tensorboard")
    # config.json is the whole resolved config of the command line, with the vocabulary size the tokenizer has.
    expected = json.loads(make_tiny_config(**RUN_OVERRIDES).to_json())
    expected["data"]["vocab_size"] = vocab_size
    assert json.loads((workdir / "config.json").read_text()) == expected
    assert len((workdir / "translations_test_step6.txt").read_text().splitlines()) == 64


def tensorboard_events(directory):
    """Every event in the TensorBoard files under `directory` (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2
    events = []
    for root, _, names in os.walk(directory):
        for name in sorted(n for n in names if n.startswith("events.")):
            raw, offset = open(os.path.join(root, name), "rb").read(), 0
            while offset < len(raw):
                length = int.from_bytes(raw[offset:offset + 8], "little")
                events.append(event_pb2.Event.FromString(raw[offset + 12:offset + 12 + length]))
                offset += 12 + length + 4
    return events


def test_the_run_writes_sample_translations_hparams_and_a_profile(trained_workdir):
    workdir, _, log = trained_workdir
    values = [(value.tag, value) for event in tensorboard_events(workdir / "tensorboard") for value in event.summary.value]
    samples = [value.tensor.string_val[0].decode() for tag, value in values if tag == "valid_bleu/samples/text_summary"]
    assert len(samples) == 2  # the BLEU evaluations at steps 3 and 6 (the end's are of the final parameters)
    table = samples[0].splitlines()
    assert table[0] == "| source | reference | translation |" and len(table) == 2 + SAMPLE_TRANSLATIONS
    assert any(tag == "_hparams_/session_start_info" for tag, _ in values)
    final = {tag: value.simple_value for tag, value in values if tag.startswith("final/")}
    scores = json.loads((workdir / "scores.json").read_text())
    assert final == pytest.approx({f"final/{split}_bleu": score["bleu"] for split, score in scores["bleu"].items()})
    traces = [name for _, _, names in os.walk(workdir / "profile") for name in names if name.endswith(".xplane.pb")]
    assert len(traces) == 1 and "profiled steps 4-5" in log


def assert_throughput_is_the_windows_count_over_its_seconds(records, vocab_size):
    """Each train record covers the steps since the one before: its tokens/s and model FLOP/s are that window's
    real tokens and analytic FLOPs over its training seconds, and its MFU is the FLOP/s over one peak."""
    model = Settings.from_config(make_tiny_config()).model_config(vocab_size)
    previous_step, previous_seconds, peaks = 0, 0.0, []
    for record in records:
        seconds = record["train_seconds"] - previous_seconds
        flops = throughput.model_flops(model, **{key: record[key] for key in (
            "source_tokens", "target_tokens", "encoder_pairs", "decoder_pairs", "cross_pairs")})
        assert record["target_tokens"] > 0 and record["encoder_pairs"] > record["source_tokens"]
        np.testing.assert_allclose(record["tokens_per_second"], record["target_tokens"] / seconds, rtol=1e-6)
        np.testing.assert_allclose(record["all_tokens_per_second"],
                                   (record["target_tokens"] + record["source_tokens"]) / seconds, rtol=1e-6)
        np.testing.assert_allclose(record["steps_per_second"], (record["step"] - previous_step) / seconds, rtol=1e-6)
        np.testing.assert_allclose(record["model_flops_per_second"], flops / seconds, rtol=1e-6)
        peaks.append(record["model_flops_per_second"] / record["mfu"])
        previous_step, previous_seconds = record["step"], record["train_seconds"]
    np.testing.assert_allclose(peaks, peaks[0], rtol=1e-6)  # one peak for the run: the CPU's measured matmul rate
    assert 1e9 < peaks[0] < 1e13


def test_eval_restores_the_checkpoint_and_scores_a_split_and_a_file(trained_workdir, tmp_path):
    workdir, *_ = trained_workdir
    (tmp_path / "in.txt").write_text("The black cat sleeps in the garden.\n\nTwo wolves are sad.\n")
    (tmp_path / "ref.txt").write_text("El gato negro duerme en el jardín.\nX\nDos lobos están tristes.\n")
    result = run_script("eval.py", f"--workdir={workdir}", "--step=3", "--split=test")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test BLEU" in result.stdout
    scores = json.loads((workdir / "eval" / "scores.test.step3.greedy-extra4.json").read_text())
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


def final_params(workdir):
    return jax.device_get(restore(str(workdir)).params)


def recorder(monkeypatch):
    """Records a digest of every batch the trainer places on the devices (prefetch reads up to 2 ahead)."""
    seen = []
    place = sharding.place_local_batch

    def record(batch, batch_sharding):
        seen.append(tree_digest_of(batch))
        return place(batch, batch_sharding)
    monkeypatch.setattr(sharding, "place_local_batch", record)
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
    records = metric_records(tmp_path / "resumed")
    assert [r["step"] for r in records if r["split"] == "train"] == [2, 3, 4, 6]  # each step once
    straight, resumed = final_params(tmp_path / "straight"), final_params(tmp_path / "resumed")
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()  # bitwise: the same computation, resumed


def test_resuming_with_another_config_is_refused_and_the_workdir_left_untouched(trained_workdir):
    workdir, *_ = trained_workdir
    before = tree_digest(workdir)
    with pytest.raises(ValueError, match=r"model.mlp_dim: 64 -> 48.*seed: 0 -> 1"):
        trainer.Run(make_tiny_config(**{"model.mlp_dim": 48, "seed": 1}), str(workdir))
    assert tree_digest(workdir) == before


def test_a_checkpoint_of_another_model_shape_is_refused_and_left_untouched(trained_workdir, tmp_path):
    """A workdir whose config.json was lost or replaced still cannot load a mismatched checkpoint."""
    workdir, *_ = trained_workdir
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


def test_eval_averages_checkpoints_with_beam_search_and_writes_all_scores(trained_workdir, tmp_path):
    workdir, *_ = trained_workdir
    # No --average_last: eval.py averages as many as the run's decode.average_last says (5 in configs/base.py, the
    # paper's method), here set to 2 in a copy of the workdir.
    run = tmp_path / "run"
    shutil.copytree(workdir, run)
    config = json.loads((run / "config.json").read_text())
    config["decode"]["average_last"] = 2
    (run / "config.json").write_text(json.dumps(config))
    result = run_script("eval.py", f"--workdir={run}", "--split=valid", "--beam_size=2", "--alpha=0.6")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "averaged the parameters of steps [3, 6]" in result.stdout and "paper BLEU" in result.stdout
    scores = json.loads((run / "eval" / "scores.valid.avg2_step6.beam2-gnmt0.6-extra4.json").read_text())[0]
    assert scores["averaged_steps"] == [3, 6] and scores["beam_size"] == 2 and scores["sentences"] == 64
    assert scores["chrf_signature"].startswith("nrefs:1") and "lang es" in scores["paper_bleu_method"]
    assert scores["tokens_per_second"] > 0 and scores["sentences_per_second"] > 0
    assert len((run / "eval" / "valid.avg2_step6.beam2-gnmt0.6-extra4.txt").read_text().splitlines()) == 64
    expected = [(a + b) / 2 for a, b in zip(jax.tree.leaves(restore(str(workdir), 3).params),
                                            jax.tree.leaves(restore(str(workdir), 6).params))]
    averaged = restore(str(workdir), average_last=2)
    for a, b in zip(jax.tree.leaves(averaged.params), expected):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_averaging_more_checkpoints_than_kept_or_an_empty_workdir_fails_clearly(trained_workdir, tmp_path):
    workdir, *_ = trained_workdir
    with pytest.raises(ValueError, match=r"average the last 3 checkpoints up to step 6, but .* holds only 2 "
                                         r"\(steps \[3, 6\]\)"):
        restore(str(workdir), average_last=3)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((workdir / "config.json").read_text())
    (empty / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        restore(str(empty))
    with pytest.raises(FileNotFoundError, match="best_checkpoint does not exist"):
        restore(str(empty), best=True)


def test_the_averaging_script_writes_a_workdir_that_restores_to_the_average(trained_workdir, tmp_path):
    workdir, *_ = trained_workdir
    script = load_script("average_checkpoints")
    assert script.write_averaged_workdir(str(workdir), str(tmp_path / "avg"), 2) == [3, 6]
    restored, expected = restore(str(tmp_path / "avg")), restore(str(workdir), average_last=2)
    assert restored.step == 6
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(expected.params)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileExistsError, match="not empty"):
        script.write_averaged_workdir(str(workdir), str(tmp_path / "avg"), 2)


def test_translate_cli_round_trip(trained_workdir, tmp_path):
    workdir, *_ = trained_workdir
    lines = ["The black cat sleeps in the garden.", "", "Two wolves are sad.", "The cat sleeps."]
    command = [sys.executable, "-m", "transformer.translate", f"--workdir={workdir}", "--batch_size=3",
               "--beam_size=2"]
    result = subprocess.run(command, input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=ROOT,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout.split("\n")
    assert len(output) == 5 and output[1] == "" and output[4] == ""  # aligned; the empty line stays empty
    restored = restore(str(workdir), decode_overrides={"beam_size": 2})
    search = restored.settings.decode.search_fn(restored.graphdef, restored.settings.seed)
    expected = decode.search_sentences(search, restored.params, restored.tokenizer, lines, 3).translations(
        restored.tokenizer)
    assert output[:4] == expected


def test_the_best_checkpoint_is_chosen_by_dev_bleu(trained_workdir):
    workdir, *_ = trained_workdir
    records = metric_records(workdir)
    valid = {r["step"]: r["bleu"] for r in records if r["split"] == "valid_bleu"}
    assert sorted(valid) == [3, 6]  # test BLEU is logged too, but never chooses
    assert len(os.listdir(workdir / "best_checkpoint")) == 1
    restored = restore(str(workdir), best=True)
    assert restored.best and restored.name == f"best_step{restored.step}" and valid[restored.step] == max(valid.values())
    # eval.py --best picks one checkpoint: with a step or an average as well, it is a usage error.
    for extra in ("--step=3", "--average_last=2"):
        result = run_script("eval.py", f"--workdir={workdir}", "--best", extra)
        assert result.returncode != 0 and "--best chooses one checkpoint" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow  # matplotlib and a decode of its own: ~10 s
def test_the_plot_script_writes_pngs_of_attention_rows_that_sum_to_one(trained_workdir, tmp_path):
    workdir, *_ = trained_workdir
    script = load_script("plot_attention")
    maps = script.plot_attention(restore(str(workdir)), "The black cat sleeps.", str(tmp_path))
    for name in ("cross_attention.png", "decoder_self_attention.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = np.load(tmp_path / "attention.npz")
    source, target = len(saved["source_tokens"]), len(saved["target_tokens"])
    assert saved["cross"].shape == (1, 2, target, source) and saved["decoder_self"].shape == (1, 2, target, target)
    np.testing.assert_allclose(saved["cross"].sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(saved["decoder_self"].sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(saved["decoder_self"], k=1) == 0)  # causal: no target token sees a later one
    assert maps["source_tokens"][-1] == "</s>"


def test_a_time_budget_stops_the_run_then_the_last_checkpoints_are_averaged_and_scored(tmp_path):
    """train.max_train_minutes: stop at the first log step past the budget (counting the training time of
    the run before a resume), save, average the last checkpoints, decode; the time-to-BLEU curve script reads
    the workdir."""
    workdir = tmp_path / "budget"
    config = make_tiny_config(**{"train.num_train_steps": 1000, "train.max_train_minutes": 1e-4,
                                 "train.checkpoint_every_steps": 1, "train.keep_checkpoints": 3,
                                 "decode.average_last": 2, "decode.bleu_splits": "valid"})
    first = trainer.Run(config, str(workdir)).train()
    assert first["step"] == 1 and "averaged_steps" not in first  # 6 ms of budget are spent by the first log
    assert first["end"]["reason"].startswith("the time budget of train.max_train_minutes=0.0001 is spent")
    again = trainer.Run(config, str(workdir)).train()  # the same command: evaluated again, trained no further
    assert again["step"] == 1 and again["end"]["reason"].endswith("was spent")
    assert [r["step"] for r in metric_records(workdir) if r["split"] == "train"] == [1]
    config.train.num_train_steps, config.train.max_train_minutes = 2, 10.0  # a larger budget: one more step
    second = trainer.Run(config, str(workdir)).train()
    assert second["step"] == 2 and second["averaged_steps"] == [1, 2]
    assert second["end"] == {"reason": "train.num_train_steps", "num_train_steps": 2, "max_train_minutes": 10.0}
    assert first["train_seconds"] >= 60e-4
    # The resumed run counts on from the first run's seconds: its total is those plus its one step's window.
    records = metric_records(workdir)
    (resumed,) = [r for r in records if r["split"] == "train" and r["step"] == 2]
    window = resumed["target_tokens"] / resumed["tokens_per_second"]
    np.testing.assert_allclose(second["train_seconds"], first["train_seconds"] + window, rtol=1e-6)
    params = {step: restore(str(workdir), step).params for step in (1, 2)}
    averaged = restore(str(workdir), 2, average_last=2).params
    leaf = lambda tree: np.asarray(jax.tree.leaves(tree)[0])  # noqa: E731
    np.testing.assert_allclose(leaf(averaged), (leaf(params[1]) + leaf(params[2])) / 2, atol=1e-7)
    assert (workdir / "translations_valid_avg_step2.txt").exists()
    png = tmp_path / "curve.png"
    plotted = run_script("scripts/plot_bleu_curve.py", f"--workdirs={workdir}", f"--output={png}")
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert "step 2" in plotted.stdout and png.stat().st_size > 1000


def test_a_report_mark_scores_the_averaged_checkpoints_then_training_goes_on(tmp_path):
    """train.report_minutes: at the first log step past a mark, what a run with that budget would end with
    (the last checkpoints averaged, decoded, scored); then training carries on to its end."""
    workdir = tmp_path / "marks"
    config = make_tiny_config(**{"train.num_train_steps": 4, "train.report_minutes": "1e-5",
                                 "train.checkpoint_every_steps": 1, "train.keep_checkpoints": 3,
                                 "train.eval_every_steps": 0, "decode.average_last": 2, "decode.bleu_splits": "valid"})
    result = trainer.Run(config, str(workdir)).train()
    # The first check is at step 1 (a checkpoint step), with one checkpoint: nothing to average yet.
    (mark,) = result["reports"].values()
    assert mark["step"] == 1 and mark["averaged_steps"] == [] and 0 < mark["train_seconds"] < result["train_seconds"]
    assert result["step"] == 4 and result["averaged_steps"] == [3, 4]
    assert (workdir / "translations_valid_step1.txt").exists() and (workdir / "translations_valid_avg_step4.txt").exists()
    records = metric_records(workdir)
    assert [r["step"] for r in records if r["split"] == "valid_bleu"] == [1]
    assert [r["step"] for r in records if r["split"] == "avg_valid_bleu"] == [4]
    reports = json.loads(json.dumps(result["reports"]))
    assert json.loads((workdir / "scores.json").read_text())["reports"] == reports
    assert json.loads((workdir / REPORTS_FILE).read_text()) == reports
    # A resumed run keeps the mark's scores (in reports.json) and does not score the mark again.
    config.train.num_train_steps = 6
    resumed = trainer.Run(config, str(workdir)).train()
    assert resumed["step"] == 6 and json.loads(json.dumps(resumed["reports"])) == reports
    records = metric_records(workdir)
    assert [r["step"] for r in records if r["split"] == "valid_bleu"] == [1]


def test_run_json_records_the_batch_and_each_starts_provenance(trained_workdir):
    workdir, *_ = trained_workdir
    record = json.loads((workdir / "run.json").read_text())
    assert record["batch"] == {"rows": 8, "row_length": 48}  # 384 tokens of 48
    start = record["starts"][0]
    assert (start["devices"], start["processes"], start["tokens_per_step"]) == (1, 1, 384)
    assert start["packages"]["jax"] == jax.__version__ and start["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert start["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", start["commit"])
    fractions = [r["input_wait_fraction"] for r in metric_records(workdir) if r["split"] == "train"]
    assert fractions and all(0.0 <= f < 1.0 for f in fractions)


def test_the_compilation_cache_defaults_to_the_workdir_unless_the_environment_chose_one(tmp_path, monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        use_compilation_cache("none", str(tmp_path))
        assert jax.config.jax_compilation_cache_dir is None
        use_compilation_cache("", str(tmp_path))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "compilation_cache")
        use_compilation_cache(str(tmp_path / "elsewhere"), str(tmp_path))  # already chosen: kept
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "compilation_cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
