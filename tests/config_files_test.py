"""--config=configs/NAME.py works from any directory (the configs package installs beside the code), a missing
file is named with every place looked, and an override of a key the config does not have is named with the
nearest known keys before absl parses anything."""

import os

import pytest

from transformer import config_files, errors

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
    with pytest.raises(errors.ConfigError, match=r"--config=configs/nope.py: no such file; looked at .*nope.py and "
                                         r".*configs/nope.py \(the installed configs: base.py, .*big.py, .*multi30k.py"):
        config_files.find("configs/nope.py")


def test_an_override_of_an_unknown_key_is_named_with_the_nearest_known_ones():
    default = os.path.join(ROOT, "configs", "default.py")
    config_files.check_overrides(["train.py", "--config.train.num_train_steps=5", "--noconfig.train.debug_nans",
                                  "--config.model.num_heads", "8"], default)  # known keys pass, in any form
    with pytest.raises(errors.ConfigError, match=r"^unknown config key --config.train.num_train_step; did you mean "
                                                 r"--config.train.num_train_steps\?$"):
        config_files.check_overrides(["train.py", "--config.train.num_train_step=5"], default)
    # The keys are those of the file --config names, with its argument (multi30k.py reads its data directory).
    with pytest.raises(errors.ConfigError, match=r"unknown config key --config.data.text_dri; did you mean "
                                                 r"--config.data.text_dir\? \(and 1 more unknown key\(s\)\)"):
        config_files.check_overrides(["train.py", f"--config={os.path.join(ROOT, 'configs', 'multi30k.py')}:/data",
                                      "--config.data.text_dri=/x", "--config.nope=1"], default)
    with pytest.raises(errors.ConfigError, match=r"--config.seed is a value, not a section with a key x"):
        config_files.check_overrides(["train.py", "--config.seed.x=1"], default)
