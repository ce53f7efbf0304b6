import json

import pytest
import sacrebleu

from transformer.metrics import MetricWriter, bleu

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
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
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
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(10, 10.0), (20, 20.0), (30, 3.0)]
