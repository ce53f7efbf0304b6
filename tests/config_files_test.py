"""--config=configs/NAME.py works from any directory (the configs package installs beside the code), and a missing
file is named with every place looked."""

import os
import subprocess
import sys

import pytest

from transformer import config_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_config_is_found_in_the_installed_configs_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = config_files.find("configs/base.py")
    assert found == os.path.join(config_files.INSTALLED, "base.py") and os.path.exists(found)
    assert config_files.find("configs/multi30k.py:/data/m30k") == os.path.join(config_files.INSTALLED,
                                                                               "multi30k.py") + ":/data/m30k"
    (tmp_path / "mine.py").write_text("")
    assert config_files.find("mine.py") == "mine.py"  # a file that exists is used as given
    assert config_files.resolve_argv(["train.py", "--config", "configs/big.py", "--config.seed=1"])[2] == \
        os.path.join(config_files.INSTALLED, "big.py")


def test_a_missing_config_names_the_places_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"--config=configs/nope.py: no such file; looked at .*nope.py and "
                                         r".*configs/nope.py \(the installed configs: base.py, big.py"):
        config_files.find("configs/nope.py")


def test_train_py_resolves_the_config_before_parsing(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/nope.py",
                             f"--workdir={tmp_path / 'w'}"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode != 0 and "looked at" in result.stderr and not (tmp_path / "w").exists()
