import pytest
import sacrebleu
from tiny import metric_records

from transformer.metrics import MetricWriter, all_scores, bleu, paper_bleu, paper_tokenize, read_jsonl

HYPOTHESES = ["The cat sat on the mat.", "A quick brown fox jumps over the dog.", "Hello there, world!"]
REFERENCES = ["The cat sat on the mat.", "The quick brown fox jumped over the lazy dog.", "Hello, world!"]


def test_bleu_equals_sacrebleu_on_known_strings():
    ours = bleu(HYPOTHESES, REFERENCES)
    theirs = sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES])
    assert ours["bleu"] == pytest.approx(theirs.score)
    assert ours["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")


def test_bleu_by_hand_on_a_tiny_corpus():
    # 13a splits the final period: hypothesis "a b c d ." vs reference "a b c e .":
    # 1-grams 4/5, 2-grams 2/4, 3-grams 1/3, 4-grams 0/2 -> exp smoothing gives the 4-gram 1/(2*2).
    score = bleu(["a b c d."], ["a b c e."])
    precisions = [4 / 5, 2 / 4, 1 / 3, 1 / (2 * 2)]
    expected = 100 * (precisions[0] * precisions[1] * precisions[2] * precisions[3]) ** 0.25
    assert score["bleu"] == pytest.approx(expected, rel=1e-6)
    assert bleu(["w x y z."], ["w x y z."])["bleu"] == pytest.approx(100.0)


def test_bleu_refuses_misaligned_lists():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        bleu(["a", "b"], ["a"])


def test_metric_writer_appends_json_lines(tmp_path):
    writer = MetricWriter(str(tmp_path))
    writer.write(10, {"loss": 1.5, "note": "text is kept in JSON only"}, "train")
    writer.write(20, {"loss": 1.0}, "train")
    writer.close()
    records = metric_records(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [(10, 1.5), (20, 1.0)]
    assert (tmp_path / "tensorboard").is_dir()


def test_a_resumed_writer_drops_records_after_the_checkpoint(tmp_path):
    writer = MetricWriter(str(tmp_path))
    for step in (10, 20, 30):
        writer.write(step, {"loss": float(step)}, "train")
    writer.close()
    writer = MetricWriter(str(tmp_path), resume_step=20)  # the run stopped after 30, resumes from step 20
    writer.write(30, {"loss": 3.0}, "train")
    writer.close()
    records = metric_records(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [(10, 10.0), (20, 20.0), (30, 3.0)]


def test_a_torn_metrics_jsonl_is_repaired_with_one_warning(tmp_path, warnings):
    writer = MetricWriter(str(tmp_path))
    for step in (10, 20, 30):
        writer.write(step, {"loss": float(step)}, "train")
    writer.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1] + b"\x00\xff\xfe junk\n" + lines[2] + b'{"step": 40, "split": "tr')
    assert [r["step"] for r in read_jsonl(str(path))] == [10, 20, 30]
    assert "skipped unreadable line(s) 3, 5" in warnings.text
    warnings.clear()
    writer = MetricWriter(str(tmp_path))  # no resume step: still, nothing is appended to the torn line
    writer.write(40, {"loss": 4.0}, "train")
    writer.close()
    assert [r["step"] for r in read_jsonl(str(path))] == [10, 20, 30, 40]
    assert f"{path}: dropped unreadable line(s) 3, 5" in warnings.text and warnings.text.count("unreadable") == 1
    path.write_bytes(path.read_bytes() + b'{"step": 50, "sp')
    MetricWriter(str(tmp_path), resume_step=20).close()
    assert [r["step"] for r in read_jsonl(str(path))] == [10, 20]


def test_paper_tokenization_is_moses_then_compound_splitting():
    assert paper_tokenize("the well-known cat sat.", "de") == "the well ##AT##-##AT## known cat sat ."
    # perl's s{(\S)-(\S)}{...}g does not overlap matches: "a-b-c" splits once; Moses escapes & and ".
    assert paper_tokenize('a-b-c & "x"', "de") == 'a ##AT##-##AT## b-c &amp; &quot; x &quot;'
    # The compound split is German's (the paper's en-fr BLEU is tokenized alone): French hyphens stay.
    assert paper_tokenize("Est-ce un arc-en-ciel ?", "fr") == "Est-ce un arc-en-ciel ?"


def test_paper_bleu_by_hand_on_known_strings():
    # "the well ##AT##-##AT## known cat sat ." vs "... dog sat .": 1-grams 6/7, 2-grams 4/6, 3-grams 2/5,
    # 4-grams 1/4, equal lengths; 13a keeps "well-known" whole and scores it differently.
    score = paper_bleu(["the well-known cat sat."], ["the well-known dog sat."], target_lang="de")
    assert score["paper_bleu"] == pytest.approx(100 * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25, rel=1e-9)
    assert "##AT##" in score["paper_bleu_method"] and "lang de" in score["paper_bleu_method"]
    # No smoothing (multi-bleu.perl): no matching 4-gram gives 0.
    assert paper_bleu(["a b c d"], ["a b c e"], target_lang="de")["paper_bleu"] == 0.0


def test_all_scores_has_bleu_chrf_and_paper_bleu_with_signatures():
    scores = all_scores(HYPOTHESES, REFERENCES, target_lang="en")
    assert scores["chrf"] == pytest.approx(sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score)
    assert scores["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:")
    assert scores["bleu"] == pytest.approx(bleu(HYPOTHESES, REFERENCES)["bleu"]) and 0 < scores["paper_bleu"] < 100


def test_weights_and_biases_gets_the_scalars_samples_and_final_scores_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # the optional wandb extra
    import json
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricWriter(str(tmp_path / "run"), wandb_project="transformer-test",
                          hparams={"model.emb_dim": 32, "mesh.rules": "batch=data"})
    writer.write(10, {"loss": 2.5, "note": "text is not a scalar"}, "train")
    writer.write_samples(10, "valid_bleu", [("a cat", "un gato", "un gato")])
    writer.write_final({"valid_bleu": 12.5})
    run = writer.wandb  # the real offline run
    assert run.summary["final/valid_bleu"] == 12.5 and run.config["model.emb_dim"] == 32
    writer.close()
    wandb.teardown()  # the wandb service writes the run's records out by then
    log = next((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()  # its records, to sync
    assert b"train/loss" in log and b"2.5" in log and b"train/note" not in log  # scalars only
    tables = list((tmp_path / "run" / "wandb").glob("offline-run-*/files/media/table/valid_bleu/samples_10_*.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["source", "reference", "translation"] and table["data"] == [["a cat", "un gato",
                                                                                             "un gato"]]
