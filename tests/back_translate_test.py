"""Back-translation (transformer/back_translate.py): N lines in give N aligned pairs out in a text folder a mixture
reads, and a job killed mid-way and started again writes what an uninterrupted one writes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tiny import make_tiny_config
from transformer import back_translate, corpus, mixture, trainer
from transformer.cli import restore_for_command_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def reverse(tmp_path_factory):
    """A tiny es->en workdir, and a Spanish monolingual file with an empty line among its lines."""
    root = tmp_path_factory.mktemp("bt")
    workdir = str(root / "es_en")
    trainer.Run(make_tiny_config(**{"data.source_lang": "es", "data.target_lang": "en",
                                    "decode.bleu_splits": ""}), workdir).train()
    lines = [es for _, es in corpus.builtin_split("test", seed=4, test_size=300)]
    lines.insert(7, "")
    mono = root / "mono.es"
    mono.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return workdir, str(mono), lines


def sampled(workdir):
    return restore_for_command_line(workdir, None, average_last=None, best=False, nbest=0, temperature=1.0)


def test_n_lines_in_give_n_aligned_pairs_a_mixture_reads(reverse, tmp_path):
    workdir, mono, lines = reverse
    record = back_translate.back_translate(sampled(workdir), workdir, mono, str(tmp_path / "out"), "train", 16)
    translations = (tmp_path / "out" / "train.en").read_text(encoding="utf-8").split("\n")[:-1]
    originals = (tmp_path / "out" / "train.es").read_text(encoding="utf-8").split("\n")[:-1]
    assert originals == lines and len(translations) == len(lines) == record["lines"] == 301
    assert translations[7] == "" and record["complete"]
    assert json.loads((tmp_path / "out" / back_translate.MANIFEST).read_text())["decode"]["temperature"] == 1.0
    # The folder is a mixture's synthetic source for the forward (en->es) direction, pairs with an empty side
    # (the empty line, a sample that ended at once) skipped and sides stripped, as in any text folder.
    forward = mixture.entry_config(trainer.Settings.from_config(make_tiny_config()).data,
                                   mixture.Entry(1.0, "synthetic", str(tmp_path / "out")))
    assert list(mixture.data.iter_split(forward, "train")) == [
        (translation.strip(), line) for translation, line in zip(translations, lines) if translation.strip() and line]


def test_a_killed_job_started_again_writes_what_an_uninterrupted_one_writes(reverse, tmp_path):
    workdir, mono, _ = reverse
    back_translate.back_translate(sampled(workdir), workdir, mono, str(tmp_path / "straight"), "train", 4)
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "transformer.back_translate", f"--workdir={workdir}", f"--input={mono}",
               f"--output_dir={out}", "--temperature=1", "--batch_size=4"]
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest, deadline = out / back_translate.MANIFEST, time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        if manifest.exists() and json.loads(manifest.read_text() or "{}").get("lines", 0) >= 40:
            break
        time.sleep(0.02)
    job.send_signal(signal.SIGKILL)
    job.wait()
    done = json.loads(manifest.read_text())["lines"]
    assert 40 <= done < 301, job.stderr.read().decode()[-2000:]
    with open(out / "train.en", "a", encoding="utf-8") as handle:  # a write the kill cut short
        handle.write("half a line")
    record = back_translate.back_translate(sampled(workdir), workdir, mono, str(out), "train", 4)
    assert record["complete"] and record["lines"] == 301
    for name in ("train.en", "train.es"):
        assert (out / name).read_bytes() == (tmp_path / "straight" / name).read_bytes()


@pytest.mark.slow
def test_back_translation_over_4_devices_writes_what_one_device_writes(reverse, tmp_path):
    workdir, mono, _ = reverse
    back_translate.back_translate(sampled(workdir), workdir, mono, str(tmp_path / "one"), "train", 8)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "transformer.back_translate", f"--workdir={workdir}",
                             f"--input={mono}", f"--output_dir={tmp_path / 'four'}", "--temperature=1",
                             "--batch_size=8"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "four" / back_translate.MANIFEST).read_text())["devices"] == 4
    for name in ("train.en", "train.es"):
        assert (tmp_path / "four" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


def test_a_missing_input_is_named_before_anything_is_restored_or_written(reverse, tmp_path):
    workdir, _, _ = reverse
    result = subprocess.run([sys.executable, "-m", "transformer.back_translate", f"--workdir={workdir}",
                             f"--input={tmp_path / 'nope.de'}", f"--output_dir={tmp_path / 'out'}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and f"--input={tmp_path / 'nope.de'}: no such file" in result.stderr
    assert not (tmp_path / "out").exists()
