"""scripts/prepare_wmt.py: argument handling and the dry run (no network here, so nothing is downloaded)."""

import os
import subprocess
import sys

import pytest
from tiny import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "prepare_wmt.py")


@pytest.fixture(scope="module")
def prepare_wmt():
    return load_script("prepare_wmt")


@pytest.mark.parametrize("data_dir, datasets, message", [
    (None, ["wmt14_translate/de-en"], "--data_dir is required"),
    ("", ["wmt14_translate/de-en"], "--data_dir is required"),
    ("d", [" ", ""], "--datasets is empty"),
    ("d", ["wmt14_translate"], "without a config.*wmt14_translate/de-en"),
])
def test_bad_arguments_are_named(prepare_wmt, data_dir, datasets, message):
    with pytest.raises(prepare_wmt.PrepareError, match=message):
        prepare_wmt.check_args(data_dir, datasets)


def test_a_file_as_data_dir_is_refused(prepare_wmt, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(prepare_wmt.PrepareError, match="not a directory"):
        prepare_wmt.check_args(str(tmp_path / "file"), ["wmt14_translate/de-en"])
    assert prepare_wmt.check_args(str(tmp_path), ["wmt14_translate/de-en", " wmt17_translate/de-en"]) == [
        "wmt14_translate/de-en", "wmt17_translate/de-en"]


def test_config_names_the_dataset_it_reads_or_is_refused(prepare_wmt):
    assert prepare_wmt.config_dataset("configs/base_enfr.py") == "wmt14_translate/fr-en"
    assert prepare_wmt.config_dataset("configs/big.py") == "wmt14_translate/de-en"
    with pytest.raises(prepare_wmt.PrepareError, match="data.source='text', not a TFDS dataset"):
        prepare_wmt.config_dataset("configs/multi30k.py")
    with pytest.raises(prepare_wmt.PrepareError, match="no such file"):
        prepare_wmt.config_dataset("configs/base_deen.py")


def test_an_unknown_config_lists_the_available_ones(prepare_wmt, tmp_path):
    with pytest.raises(prepare_wmt.PrepareError, match=r"wmt14_translate/xx-en.*available configs: .*de-en"):
        prepare_wmt.builder_for("wmt14_translate/xx-en", str(tmp_path))


def test_dry_run_describes_each_dataset_and_writes_nothing(tmp_path):
    data_dir = tmp_path / "tfds"
    result = subprocess.run([sys.executable, SCRIPT, f"--data_dir={data_dir}", "--dry_run",
                             "--datasets=wmt14_translate/de-en,wmt17_translate/de-en"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wmt14_translate/de-en version 1.0.0: languages ('de', 'en')" in result.stdout
    assert "train: europarl_v7, commoncrawl, newscommentary_v9" in result.stdout
    assert "train: europarl_v7, commoncrawl, newscommentary_v12, rapid_2016" in result.stdout
    assert "would run: " in result.stdout and "file_format='array_record'" in result.stdout
    assert not data_dir.exists()
    # --config prepares what a training config reads: the English-French configs' fr-en, with its splits.
    result = subprocess.run([sys.executable, SCRIPT, f"--data_dir={data_dir}", "--dry_run",
                             "--config=configs/big_enfr.py"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wmt14_translate/fr-en version 1.0.0" in result.stdout and "validation: newstest2013" in result.stdout
    assert "test: newstest2014" in result.stdout and not data_dir.exists()
    help_text = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=300)
    # absl exits 1 after --help; what matters is the usage text
    assert "--data_dir" in help_text.stdout + help_text.stderr and "array_record" in help_text.stdout + help_text.stderr
