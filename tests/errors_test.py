"""train.py, eval.py and `python -m transformer.translate` report the project's errors (bad data, an unknown or
refused setting, a missing workdir or checkpoint) as one `error: ...` line on stderr with exit status 1, before
any work, and show the traceback only under --traceback; anything else (a bug, a preemption's SystemExit) is
not theirs to hide."""

import os
import re
import subprocess
import sys

import pytest
from tiny import TINY_OVERRIDES

from transformer import errors
from transformer.errors import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# absl's own log lines (Orbax's notices that a directory is opened read-only): not the tools' messages.
ABSL_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ ")


def run(*command):
    return subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=ROOT, timeout=300)


def assert_reported(result, *fragments):
    """Exit status 1 and one or two lines on stderr (absl's log lines aside), the first `error: ...` holding every
    fragment; no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and not ABSL_LOG.match(line)]
    assert result.returncode == 1 and 1 <= len(lines) <= 2 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A 2-step run with one checkpoint (step 2) and no BLEU at its end."""
    workdir = tmp_path_factory.mktemp("run") / "demo"
    overrides = {**TINY_OVERRIDES, "train.num_train_steps": 2, "train.checkpoint_every_steps": 2,
                 "train.eval_every_steps": 2, "decode.bleu_splits": ""}
    result = run("train.py", f"--workdir={workdir}", *[f"--config.{key}={value}" for key, value in overrides.items()])
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


@pytest.mark.parametrize("flags, message", [
    (["--config.train.num_train_step=5"],
     "error: unknown config key --config.train.num_train_step; did you mean --config.train.num_train_steps?"),
    (["--config=configs/default.py", "--config.modle.x=1"],  # with --config, ml_collections would parse it later
     "error: unknown config key --config.modle (in --config.modle.x); did you mean --config.model?"),
    (["--config.decode.beam_size=0"], "error: decode.beam_size=0 must be >= 1"),
    (["--config.train.num_train_steps=0"], "error: train.num_train_steps=0 must be >= 1"),  # no run to speak of
    (["--config=configs/nope.py"], "error: --config=configs/nope.py: no such file; looked at"),
])
def test_train_names_a_bad_setting_in_one_line_before_any_work(tmp_path, flags, message):
    result = run("train.py", f"--workdir={tmp_path / 'w'}", *flags)
    assert_reported(result, message)
    assert not (tmp_path / "w").exists()


def test_train_names_missing_data_in_one_line(tmp_path):
    missing = tmp_path / "no_such_corpus"
    result = run("train.py", f"--workdir={tmp_path / 'w'}", "--config.data.source=text",
                 f"--config.data.text_dir={missing}")
    assert_reported(result, str(missing))


def test_a_missing_workdir_is_named_by_eval_and_translate(tmp_path):
    assert_reported(run("eval.py", f"--workdir={tmp_path / 'none'}"), f"{tmp_path / 'none'}/config.json not found")
    assert_reported(run("-m", "transformer.translate", f"--workdir={tmp_path / 'none'}"), "config.json not found")


def test_a_bad_step_is_named_with_the_steps_there_and_traceback_shows_where(workdir):
    result = run("eval.py", f"--workdir={workdir}", "--step=99")
    assert_reported(result, "error: no checkpoint for step 99 in", "found [2]")
    assert not (workdir / "eval").exists()
    result = run("eval.py", f"--workdir={workdir}", "--step=99", "--traceback")
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr
    assert "FileNotFoundError: no checkpoint for step 99" in result.stderr and "error: " not in result.stderr


def test_traceback_shows_where_an_unknown_key_was_found(tmp_path):
    result = run("train.py", f"--workdir={tmp_path / 'w'}", "--config.train.num_train_step=5", "--traceback")
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr
    assert "ConfigError: unknown config key --config.train.num_train_step" in result.stderr


def test_messages_report_the_projects_errors_and_let_bugs_and_exits_through(capsys):
    with pytest.raises(SystemExit) as exit_info, errors.messages():
        raise DataError("valid.en line 3: invalid UTF-8")
    assert exit_info.value.code == errors.EXIT_ERROR == 1
    assert capsys.readouterr().err == "error: valid.en line 3: invalid UTF-8\n"
    for passing in (SystemExit(75), KeyError("a bug"), ValueError("a bug too")):
        with pytest.raises(type(passing)) as raised, errors.messages():
            raise passing
        assert raised.value is passing
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as exit_info, errors.messages():  # a Ctrl-C: one line, a shell's status
        raise KeyboardInterrupt()
    assert exit_info.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def test_as_config_error_makes_a_plain_value_error_a_config_error_and_keeps_the_projects_kinds():
    with pytest.raises(errors.ConfigError, match="decode.beam_size=0 must be >= 1"), errors.as_config_error():
        raise ValueError("decode.beam_size=0 must be >= 1")
    with pytest.raises(DataError), errors.as_config_error():
        raise DataError("no such file")


def test_nearest_names_the_likely_misspelling_first():
    keys = ["num_train_steps", "log_every_steps", "eval_every_steps", "num_encoder_layers", "num_decoder_layers"]
    assert errors.nearest("num_train_step", keys) == ["num_train_steps"]
    assert errors.nearest("layers", keys) == ["num_encoder_layers", "num_decoder_layers"]
    assert errors.nearest("dropout", keys) == []
    assert errors.did_you_mean("modle", ["model", "data"], "config.") == "; did you mean config.model?"
    assert errors.did_you_mean("zzz", ["model", "data"]) == "; known: data, model"


@pytest.mark.parametrize("tool", ["train.py", "eval.py", "-m transformer.translate"])
def test_a_workdir_url_without_its_filesystem_names_the_flag_and_the_extra(tool):
    import importlib.util
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed: gs:// can be read here")
    assert_reported(run(*tool.split(), "--workdir=gs://no-bucket/run"),
                    "error: --workdir=gs://no-bucket/run: gs:// cannot be read here", 'pip install -e ".[gcs]"')
    assert_reported(run(*tool.split(), "--workdir=nosuch://x/run"), "--workdir=nosuch://x/run: unknown scheme nosuch://")
