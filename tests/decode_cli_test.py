"""eval.py and `python -m transformer.translate` on a tiny trained workdir: the decoding flags (--nbest,
--length_penalty, --max_extra_length) reach the search, both tools take the same defaults from the workdir's
config, bad flags fail before anything is restored, inputs longer than the run's max_length are cut and counted,
and evaluations of one model, beside a save in flight, each keep their own results."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tiny import TINY_OVERRIDES, rescored_bleu, tree_digest

from transformer import data, decode
from transformer.tokenizer import Tokenizer
from transformer.restore import load_workdir_config, restore
from transformer.settings import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINES = ["The black cat sleeps in the garden.", "", "Two wolves are sad.", "The cat sleeps.",
         "A lazy farmer is cooking today.", "Ten sick fathers are without these bears every day.", "The dog."]
FLAGS = ["--nbest=2", "--beam_size=2", "--length_penalty=fairseq", "--alpha=1.0", "--max_extra_length=2"]


def eval_file(workdir, pattern):
    """The one file of workdir/eval/ matching pattern ("*": an --input file's path hash)."""
    [path] = (workdir / "eval").glob(pattern)
    return path


def run(*command, stdin=None):
    return subprocess.run([sys.executable, *command], input=stdin, capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A 6-step run (checkpoints 3 and 6) whose config asks for averaging both and batches of 5 sentences; no
    BLEU at its end (nothing here reads it)."""
    workdir = tmp_path_factory.mktemp("run") / "demo"
    overrides = {**TINY_OVERRIDES, "decode.bleu_splits": "", "decode.average_last": 2, "decode.batch_size": 5}
    result = run(os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
                 *[f"--config.{key}={value}" for key, value in overrides.items()])
    assert result.returncode == 0, result.stderr[-3000:]
    (workdir.parent / "in.txt").write_text("\n".join(LINES) + "\n")
    return workdir


def test_eval_and_translate_write_the_same_nbest_list_with_the_config_defaults(workdir, tmp_path):
    source = workdir.parent / "in.txt"
    result = run("eval.py", f"--workdir={workdir}", f"--input={source}", f"--output={tmp_path / 'hyp.txt'}", *FLAGS)
    assert result.returncode == 0, result.stderr[-3000:]
    [scores] = json.loads(eval_file(workdir, "scores.in.txt-*.avg2_step6.beam2-fairseq1-extra2.json").read_text())
    assert (scores["averaged_steps"], scores["batch_size"], scores["beam_size"]) == ([3, 6], 5, 2)
    assert (scores["length_penalty"], scores["alpha"], scores["max_extra_length"]) == ("fairseq", 1.0, 2)
    assert scores["nbest_output"] == str(tmp_path / "hyp.nbest2.txt")
    nbest = (tmp_path / "hyp.nbest2.txt").read_text().splitlines()
    best = (tmp_path / "hyp.txt").read_text().splitlines()
    # What the same settings decode in this process: the flags reached the search.
    restored = restore(str(workdir), average_last=2, decode_overrides=dict(
        beam_size=2, length_penalty="fairseq", alpha=1.0, max_extra_length=2))
    search = restored.settings.decode.search_fn(restored.graphdef, restored.settings.seed)
    found = decode.search_sentences(search, restored.params, restored.tokenizer, LINES, 5).nbest(2)
    assert nbest == decode.nbest_lines(found, restored.tokenizer)
    assert best == [restored.tokenizer.decode(h[0].ids) if h else "" for h in found] and best[1] == ""
    for ids, hypotheses in zip(restored.tokenizer.encode(LINES), found):
        assert all(len(h.ids) <= len(ids) + 2 for h in hypotheses)  # --max_extra_length=2, not the config's 4
    assert [line.split(" ||| ")[0] for line in nbest] == ["0", "0", "1", "2", "2", "3", "3", "4", "4", "5", "5", "6",
                                                          "6"]
    # translate.py: no --average_last or --batch_size either, the same rule, so the same list (scores equal up
    # to float rounding: it reads 5 lines at a time, so "The dog." is padded to another length than in eval.py).
    result = run("-m", "transformer.translate", f"--workdir={workdir}", *FLAGS, stdin=source.read_text())
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_nbest(result.stdout.splitlines(), nbest)


def assert_same_nbest(got: list[str], expected: list[str]) -> None:
    """The same indices and translations in the same order; log P and scores equal up to float rounding."""
    def fields(lines):
        return [line.split(" ||| ") for line in lines]
    assert [f[:2] for f in fields(got)] == [f[:2] for f in fields(expected)]
    for name, column in (("LogProb", 2), ("score", 3)):
        np.testing.assert_allclose([float(f[column].removeprefix("LogProb= ")) for f in fields(got)],
                                   [float(f[column].removeprefix("LogProb= ")) for f in fields(expected)],
                                   rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_eval_decodes_by_mbr_with_its_flags_as_the_search_in_this_process_does(workdir, tmp_path):
    source = workdir.parent / "in.txt"
    flags = ["--search=mbr", "--mbr_candidates=4", "--epsilon=0.02", "--mbr_utility=bleu", "--nbest=3"]
    result = run("eval.py", f"--workdir={workdir}", f"--input={source}", f"--output={tmp_path / 'hyp.txt'}", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    [scores] = json.loads(eval_file(workdir, "scores.in.txt-*.avg2_step6.mbr4-bleu-samples-t1-k0-p0-e0.02-extra4.json"
                                    ).read_text())
    assert scores["sentences"] == len(LINES)
    restored = restore(str(workdir), average_last=2, decode_overrides=dict(
        search="mbr", mbr_candidates=4, epsilon=0.02, mbr_utility="bleu"))
    search = restored.settings.decode.search_fn(restored.graphdef, restored.settings.seed)
    found = decode.search_sentences(search, restored.params, restored.tokenizer, LINES, 5, call=0)
    assert (tmp_path / "hyp.txt").read_text().splitlines() == found.translations(restored.tokenizer)
    nbest = (tmp_path / "hyp.nbest3.txt").read_text().splitlines()
    assert_same_nbest(nbest, decode.nbest_lines(found.nbest(3), restored.tokenizer))
    # The score column is the expected sentence BLEU (0-100) against the candidates, best first.
    first = [float(line.split(" ||| ")[3]) for line in nbest if line.startswith("0 |||")]
    assert first == sorted(first, reverse=True) and 0 < first[0] <= 100


@pytest.mark.slow
def test_benchmark_mbr_times_the_draw_and_the_ranking_apart(workdir):
    result = run(os.path.join(ROOT, "scripts", "benchmark_mbr.py"), f"--workdir={workdir}", "--sentences=6",
                 "--candidates=1,4", "--utilities=chrf,bleu")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["candidates"], r["utility"]) for r in rows] == [(1, "chrf"), (1, "bleu"), (4, "chrf"), (4, "bleu")]
    assert all(r["sentences"] == 6 and 0 < r["host_share"] < 1 for r in rows)
    assert [r["distinct_per_sentence"] for r in rows[:2]] == [1.0, 1.0] and 1 <= rows[2]["distinct_per_sentence"] <= 4


@pytest.mark.slow
def test_the_decode_benchmark_times_a_text_file_with_a_shrinking_batch_as_eval_translates_it(workdir, tmp_path):
    """scripts/benchmark.py --workdir --input: the workdir's model decodes the file (a compiling pass, then the timed
    ones) with --decode_shrink; the translations are eval.py's for the same flags, and the JSON line says how."""
    source = tmp_path / "source.en"
    source.write_text("A cat.\nTwo dogs run on the grass.\nA man in a red shirt reads a book in the park.\n")
    output = tmp_path / "bench.jsonl"
    result = run(os.path.join(ROOT, "scripts", "benchmark.py"), "--mode=decode", f"--workdir={workdir}",
                 f"--input={source}", "--beam_size=2", "--decode_shrink=1", "--repeats=1", f"--output={output}")
    assert result.returncode == 0, result.stderr[-3000:]
    [row] = [json.loads(line) for line in output.read_text().splitlines()]
    assert (row["mode"], row["sentences"], row["beam_size"], row["shrink"]) == ("decode_text", 3, 2, 1)
    assert row["sentences_per_second"] > 0 and len(row["seconds"]) == 1
    written = tmp_path / "eval.txt"
    assert run("eval.py", f"--workdir={workdir}", f"--input={source}", "--beam_size=2", "--shrink=1",
               f"--output={written}").returncode == 0
    assert row["translations"] == written.read_text().splitlines()


@pytest.mark.parametrize("tool, flags, message", [
    ("-m transformer.translate", ["--nbest=3", "--beam_size=2"],
     "--nbest=3 must be between 0 (off) and decode.beam_size=2"),
    ("eval.py", ["--max_extra_length=-1"], "--max_extra_length=-1 must be >= 0"),
    ("eval.py", ["--search=mbr", "--mbr_from=beam", "--temperature=0.5"],
     "--mbr_from='beam' ranks beam search's n-best list, which samples nothing"),
])
def test_bad_decoding_flags_fail_naming_them(workdir, tool, flags, message):
    shutil.rmtree(workdir / "eval", ignore_errors=True)
    result = run(*tool.split(), f"--workdir={workdir}", *flags, stdin="A cat.\n")
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert not (workdir / "eval").exists()


def digest_outside_eval(workdir) -> dict:
    return {name: tree_digest(workdir / name) if (workdir / name).is_dir() else (workdir / name).read_bytes()
            for name in sorted(os.listdir(workdir)) if name != "eval"}


def test_evaluations_beside_a_save_in_flight_keep_their_own_results_and_count_the_inputs_cut(workdir, tmp_path):
    """A half-written save (Orbax's temporary directory) is not read; each evaluation writes its own scores under
    eval/ and nothing else; a source longer than the run's data.max_length (48) is cut, counted and translated."""
    in_flight = workdir / "checkpoints" / "9.orbax-checkpoint-tmp-1010101"
    shutil.copytree(workdir / "checkpoints" / "6", in_flight)
    try:
        before = digest_outside_eval(workdir)
        long = tmp_path / "long.txt"
        long.write_text("\n".join([LINES[0], " ".join([LINES[4]] * 12), LINES[2]]) + "\n")
        result = run("eval.py", f"--workdir={workdir}", f"--input={long}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"{long}: 1 of 3 source sentence(s) longer than 48 tokens cut to their first 47 and EOS" in result.stderr
        [cut] = json.loads(eval_file(workdir, "scores.long.txt-*.avg2_step6.greedy-extra4.json").read_text())
        assert (cut["step"], cut["inputs_cut"], cut["max_input_length"], cut["sentences"]) == (6, 1, 48, 3)
        assert len(eval_file(workdir, "long.txt-*.avg2_step6.greedy-extra4.txt").read_text().splitlines()) == 3
        result = run("eval.py", f"--workdir={workdir}", "--split=valid", "--beam_size=2")
        assert result.returncode == 0, result.stderr[-3000:]
        [valid] = json.loads((workdir / "eval" / "scores.valid.avg2_step6.beam2-gnmt0.6-extra4.json").read_text())
        settings = Settings.from_config(load_workdir_config(str(workdir)))
        sources = [source for source, _ in data.read_split(settings.data, "valid")]
        too_long = sum(len(ids) > 48 for ids in Tokenizer(str(workdir / "vocab.model")).encode(sources))
        assert valid["step"] == 6 and valid["inputs_cut"] == too_long > 0
        rescored = rescored_bleu(workdir, valid["output"], "valid")  # the translations written, scored again
        assert {key: valid[key] for key in rescored} == pytest.approx(rescored)
        assert f"valid BLEU {valid['bleu']:.2f}  {valid['signature']}" in result.stdout
        assert valid["sentences"] == len(sources)  # the cut ones are scored too
        assert json.loads(eval_file(workdir, "scores.long.txt-*.avg2_step6.greedy-extra4.json").read_text()) == [cut]
        assert not [name for name in os.listdir(workdir / "eval") if ".tmp" in name]  # only whole files remain
        assert digest_outside_eval(workdir) == before
    finally:
        shutil.rmtree(in_flight)


@pytest.mark.slow
def test_eval_reads_files_as_training_does_and_inputs_of_one_name_keep_their_own_results(workdir, tmp_path):
    """Sources and references with a byte order mark and CR line ends score as plain ones do (as training reads
    its text; the tiny model's translations are empty, so the references' length shows it: a kept mark would
    make the empty first reference a one-token line); the two inputs share a name in different folders and
    each keeps its own files; invalid UTF-8 is named by file and line, an empty input by name, neither with a
    traceback."""
    shutil.rmtree(workdir / "eval", ignore_errors=True)
    plain = lambda lines: "\n".join(lines).encode() + b"\n"
    marked = lambda lines: b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n"
    references = ["", "El gato negro duerme en el jardín.", "Dos lobos están tristes."]
    scores = []
    for folder, encode in (("plain", plain), ("marked", marked)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test").write_bytes(encode(LINES[:3]))
        (tmp_path / folder / "ref.txt").write_bytes(encode(references))
        result = run("eval.py", f"--workdir={workdir}", f"--input={tmp_path / folder / 'test'}",
                     f"--reference={tmp_path / folder / 'ref.txt'}")
        assert result.returncode == 0, result.stderr[-3000:]
        [score] = json.loads(open(result.stdout.split("wrote ")[-1].strip()).read())  # the scores it wrote
        scores.append(score)
    assert scores[0]["output"] != scores[1]["output"]  # one name, two folders: two files
    assert [open(score["output"]).read() for score in scores] == [open(scores[0]["output"]).read()] * 2
    assert scores[0]["reference_length"] == scores[1]["reference_length"] == 13
    assert len(list((workdir / "eval").glob("scores.test-*.json"))) == 2
    (tmp_path / "bad.txt").write_bytes(b"The cat sleeps.\ncaf\xe9\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    for name, message in (("bad.txt", f"{tmp_path / 'bad.txt'}:2: invalid UTF-8"),
                          ("empty.txt", f"--input={tmp_path / 'empty.txt'} is empty")):
        result = run("eval.py", f"--workdir={workdir}", f"--input={tmp_path / name}")
        assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr, \
            result.stderr[-2000:]


def test_translate_gives_n_lines_for_n_lines_of_stdin_whatever_their_bytes(workdir, tmp_path):
    """Invalid UTF-8 on stdin is replaced and counted on stderr, a byte order mark dropped; stdout holds exactly one
    translation per input line; a file's invalid UTF-8 names its line."""
    lines = [b"\xef\xbb\xbf" + LINES[0].encode(), b"", b"Two wolves are \xff sad.", LINES[3].encode() + b"\r",
             " ".join([LINES[4]] * 12).encode()]  # the last one past the run's max_length
    command = [sys.executable, "-m", "transformer.translate", f"--workdir={workdir}"]
    result = subprocess.run(command, input=b"\n".join(lines) + b"\n", capture_output=True, cwd=ROOT, timeout=600)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 0, stderr[-3000:]
    out = result.stdout.decode().split("\n")
    assert len(out) == len(lines) + 1 and out[-1] == "" and out[1] == ""  # N lines, each ended by a newline
    assert "stdin: 1 line(s) held invalid UTF-8" in stderr and "line(s) 3" in stderr
    (tmp_path / "bad.txt").write_bytes(b"The cat.\n\xff\n")
    result = run("-m", "transformer.translate", f"--workdir={workdir}", f"--input={tmp_path / 'bad.txt'}")
    assert result.returncode != 0 and f"{tmp_path / 'bad.txt'}:2: invalid UTF-8" in result.stderr, result.stderr[-2000:]


def test_translate_ends_quietly_when_its_reader_leaves(workdir):
    """`translate | head -1`: stdout's reader gone (here, before the first line), translate ends at its next write
    with a shell's status for SIGPIPE, 141, and no traceback."""
    read, write = os.pipe()
    os.close(read)  # the reader left: every write to the pipe fails
    try:
        result = subprocess.run([sys.executable, "-m", "transformer.translate", f"--workdir={workdir}"],
                                input=("\n".join(LINES) + "\n").encode(), stdout=write, stderr=subprocess.PIPE,
                                cwd=ROOT, timeout=600)
    finally:
        os.close(write)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 141 and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
