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


def test_a_resume_with_another_model_shape_names_the_change_and_leaves_the_workdir(workdir):
    from tiny import tree_digest
    before = tree_digest(workdir)
    overrides = {**TINY_OVERRIDES, "train.num_train_steps": 4, "model.emb_dim": 64}
    result = run("train.py", f"--workdir={workdir}", *[f"--config.{key}={value}" for key, value in overrides.items()])
    assert_reported(result, "another config (model.emb_dim: 32 -> 64)", "config.json", "or use a new --workdir")
    assert tree_digest(workdir) == before


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


def test_a_write_the_disk_refuses_is_one_line_naming_the_file_and_other_os_errors_pass(capsys):
    import errno
    with pytest.raises(SystemExit) as exit_info, errors.messages():
        raise OSError(errno.ENOSPC, "No space left on device", "/w/tokens/train-1")
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.startswith("error: cannot write /w/tokens/train-1: the disk is full (No space left")
    with pytest.raises(SystemExit), errors.messages():
        raise PermissionError(errno.EACCES, "Permission denied", "/w/config.json")  # a read as often as a write
    assert capsys.readouterr().err.startswith("error: cannot use /w/config.json: permission denied (Permission denied)")
    with pytest.raises(OSError, match="Input/output error"), errors.messages():
        raise OSError(errno.EIO, "Input/output error", "/w/x")  # not the disk's answer to a write: not ours to hide


def mount_namespace_available() -> bool:
    """Whether this process may mount in a namespace of its own (root, util-linux's unshare): the honest way to
    give a test a read-only or full disk, which root's writes would otherwise ignore."""
    if os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_with_mount(mount: str, *command, after: str = "true"):
    """`python command` in a mount namespace where the shell line `mount` ran first and `after` runs last (the
    namespace's mounts end with it); the command's status."""
    import shlex
    line = (f"{mount} && {{ {shlex.quote(sys.executable)} {' '.join(shlex.quote(c) for c in command)}; status=$?; "
            f"{after}; exit $status; }}")
    return subprocess.run(["unshare", "--mount", "sh", "-c", line], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.parametrize("tool, message", [
    ("train.py", "a training run keeps its lock"), ("eval.py", "eval.py writes its scores")])
def test_a_read_only_workdir_is_named_before_any_work_and_left_as_it_was(workdir, tmp_path, tool, message):
    from tiny import tree_digest
    before = tree_digest(workdir)
    view = tmp_path / "view"
    view.mkdir()
    if mount_namespace_available():
        result = run_with_mount(f"mount --bind {workdir} {view} && mount -o remount,bind,ro {view}", tool,
                                f"--workdir={view}", *[f"--config.{k}={v}" for k, v in TINY_OVERRIDES.items()
                                                       if tool == "train.py"])
    elif os.geteuid() != 0:
        view = workdir
        os.chmod(workdir, 0o555)
        try:
            result = run(tool, f"--workdir={view}")
        finally:
            os.chmod(workdir, 0o755)
    else:
        pytest.skip("root here ignores file modes, and no mount namespace can make a read-only view")
    assert_reported(result, f"--workdir={view}", "cannot be written", message)
    assert tree_digest(workdir) == before


def test_a_full_disk_while_the_token_cache_is_written_names_it_and_leaves_no_part_behind(tmp_path):
    if not mount_namespace_available():
        pytest.skip("a full disk needs a small tmpfs in a mount namespace (root, unshare)")
    disk = tmp_path / "disk"
    disk.mkdir()
    # 1 MiB: room for the vocabulary and the text, not for the token cache (measured with the tiny config).
    result = run_with_mount(f"mount -t tmpfs -o size=1m tmpfs {disk}", "train.py", f"--workdir={disk}/w",
                            *[f"--config.{k}={v}" for k, v in TINY_OVERRIDES.items()], "--config.decode.bleu_splits=",
                            after=f"echo left:; find {disk}/w")
    last = result.stderr.strip().splitlines()[-1]  # after the lines of the work done before the disk filled
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert last.startswith(f"error: cannot write {disk}/w/tokens/train-") and "the disk is full" in last, last
    left = result.stdout.split("left:\n")[1].split()
    assert f"{disk}/w/vocab.model" in left and not any("tokens/" in path for path in left), left  # no half cache
    assert f"{disk}/w/lock.json" not in left  # the workdir is free for the next start
