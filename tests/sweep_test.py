"""Sweeps: definition helpers and names, validation before launch (every shipped sweep; the base.py grid's
invalid points), SLURM emit, device slots, collect, and a real 2-point sweep through scripts/sweep.py where one
point fails."""

import csv
import glob
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tiny import TINY_OVERRIDES
from transformer import sweep, sweep_results, sweep_runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.py")
BASE = os.path.join(ROOT, "configs", "base.py")


def run_sweep_script(*args, env=None):
    command = [sys.executable, os.path.join(ROOT, "scripts", "sweep.py"), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, **(env or {})})


# ----------------------------------------------------------------------------------------------------
# Definition


def test_product_zip_and_shared_overrides():
    grid = sweep.product([{"seed": 1}], sweep.axis("a.x", [1, 2]), sweep.zip(sweep.axis("b.y", [3, 4]),
                                                                             sweep.axis("b.z", ["p", "q"])))
    assert grid == [{"seed": 1, "a.x": 1, "b.y": 3, "b.z": "p"}, {"seed": 1, "a.x": 1, "b.y": 4, "b.z": "q"},
                    {"seed": 1, "a.x": 2, "b.y": 3, "b.z": "p"}, {"seed": 1, "a.x": 2, "b.y": 4, "b.z": "q"}]
    with pytest.raises(sweep.SweepError, match="one length"):
        sweep.zip(sweep.axis("a", [1, 2]), sweep.axis("b", [1]))
    with pytest.raises(sweep.SweepError, match="'a' is set twice"):
        sweep.product(sweep.axis("a", [1]), sweep.axis("a", [2]))
    with pytest.raises(sweep.SweepError, match="no values"):
        sweep.axis("a", [])


def test_run_names_come_from_the_swept_keys():
    points = sweep.product([{"train.num_train_steps": 400}], sweep.axis("optimizer.warmup_steps", [100, 4000]),
                           sweep.axis("model.dropout_rate", [0.0, 1e-9]))
    assert sweep_runner.run_names(points) == ["warmup_steps=100,dropout_rate=0", "warmup_steps=100,dropout_rate=1e-09",
                                       "warmup_steps=4000,dropout_rate=0", "warmup_steps=4000,dropout_rate=1e-09"]
    # A leaf shared by two swept keys keeps its full key; characters unsafe in a path become '_'.
    points = sweep.zip(sweep.axis("data.max_length", [32, 64]), sweep.axis("model.max_length", [32, 64]),
                       sweep.axis("data.text_dir", ["/a b", "/c"]))
    assert sweep_runner.run_names(points) == ["data.max_length=32,model.max_length=32,text_dir=_a_b",
                                       "data.max_length=64,model.max_length=64,text_dir=_c"]
    assert sweep_runner.run_names([{"model.emb_dim": 64}]) == ["emb_dim=64"] and sweep_runner.run_names([{}]) == ["base"]
    assert sweep_runner.name_value(0.1 + 0.2) == "0.30000000000000004"  # never rounded into another point's name
    with pytest.raises(sweep.SweepError, match="points 0 and 1 have the same name"):
        sweep_runner.run_names([{"seed": 1}, {"seed": 1}, {"seed": 2}])


def test_cli_values_parse_back_to_the_same_value():
    assert [sweep_runner.cli_value(v) for v in (0.1, 1e-9, 4000, True, "pre")] == ["0.1", "1e-09", "4000", "True", "pre"]
    assert float(sweep_runner.cli_value(0.1 + 0.2)) == 0.1 + 0.2


# ----------------------------------------------------------------------------------------------------
# Validation


def test_unknown_keys_and_wrong_types_fail_the_whole_sweep_naming_each_run_and_key():
    points = [{"model.dropout_rate": 0.1}, {"model.dropuot_rate": 0.2}, {"train.num_train_steps": 1.5},
              {"train.label_smoothing": "0.1"}, {"train.async_checkpointing": 1}, {"model.emb_dim": True},
              {"nosection.x": 1}, {"model": 3}]
    with pytest.raises(sweep.SweepError) as error:
        sweep_runner.make_points(DEFAULT, points)
    message = str(error.value)
    assert message.startswith("7 bad override(s); nothing was launched")
    for expected in ["run 'dropuot_rate=0.2': unknown key 'model.dropuot_rate'",
                     "run 'num_train_steps=1.5': train.num_train_steps=1.5 has type float; the config's "
                     "train.num_train_steps has type int",
                     "run 'label_smoothing=0.1': train.label_smoothing='0.1' has type str",
                     "run 'async_checkpointing=1': train.async_checkpointing=1 has type int",
                     "run 'emb_dim=True': model.emb_dim=True has type bool",
                     "run 'x=1': unknown key 'nosection.x' (no section 'nosection')",
                     "run 'model=3': 'model' is a section"]:
        assert expected in message
    assert "dropout_rate=0.1'" not in message  # the valid point is not blamed
    # An int is fine for a float field, and the resolved config carries the values.
    (point,) = sweep_runner.make_points(DEFAULT, [{"train.label_smoothing": 0, "model.layer_norm": "pre"}])
    assert point.config.train.label_smoothing == 0.0 and point.config.model.layer_norm == "pre" and not point.problem


def test_a_grid_point_is_invalid_exactly_where_its_heads_do_not_divide_its_width():
    points = sweep_runner.make_points(BASE, sweep_runner.load_sweep(BASE))
    invalid = {p.name: p.problem for p in points if p.problem}
    expected = {p.name: f"model config: num_heads={p.config.model.num_heads} must divide "
                        f"emb_dim={p.config.model.emb_dim}"
                for p in points if p.config.model.emb_dim % p.config.model.num_heads}
    assert invalid == expected and 0 < len(invalid) < len(points)  # both kinds, so the check means something
    with pytest.raises(sweep.SweepError, match=rf"{len(invalid)} of {len(points)} points are invalid; nothing was "
                                               "launched") as error:
        sweep_runner.refuse_invalid(points, skip_invalid=False)
    assert all(name in str(error.value) for name in invalid)
    valid = sweep_runner.refuse_invalid(points, skip_invalid=True)
    assert [p.name for p in valid] == [p.name for p in points if p.name not in invalid]


SHIPPED_SWEEPS = sorted(path for path in glob.glob(os.path.join(ROOT, "configs", "[!_]*.py"))
                        if hasattr(importlib.import_module(f"configs.{os.path.basename(path)[:-3]}"), "get_sweep"))


@pytest.mark.parametrize("config_file", SHIPPED_SWEEPS, ids=os.path.basename)
def test_every_shipped_sweep_resolves_with_each_points_overrides(config_file):
    """A get_sweep() beside get_config() names only keys the config has, with their types (make_points raises
    otherwise), and each point's config holds its overrides; the example sweep of default.py runs as the docs show
    it, without --skip_invalid."""
    overrides = sweep_runner.load_sweep(config_file)
    points = sweep_runner.make_points(config_file, overrides)
    assert [p.name for p in points] == sweep_runner.run_names(overrides) and len(points) > 1
    for point in points:
        for key, value in point.overrides.items():
            node = point.config
            for part in key.split("."):
                node = node[part]
            assert node == value, (point.name, key)
    if config_file == DEFAULT:
        assert not any(p.problem for p in points)


def test_base_grid_is_refused_without_skip_invalid_and_emitted_for_slurm_with_it(tmp_path):
    points = sweep_runner.make_points(BASE, sweep_runner.load_sweep(BASE))
    invalid, valid = [p for p in points if p.problem], [p for p in points if not p.problem]
    result = run_sweep_script(f"--config={BASE}", f"--sweep_dir={tmp_path / 'grid'}", "--parallel=4")
    assert result.returncode == 2
    assert f"{len(invalid)} of {len(points)} points are invalid; nothing was launched" in result.stderr
    assert all(f"{p.name}: model config" in result.stderr for p in invalid)
    assert not (tmp_path / "grid").exists()

    result = run_sweep_script(f"--config={BASE}", f"--sweep_dir={tmp_path / 'grid'}", "--skip_invalid",
                              "--emit=slurm", "--parallel=4", "--slurm_option=--gres=gpu:8",
                              "--slurm_setup=source /venv/bin/activate")
    assert result.returncode == 0, result.stderr
    assert all(f"skipping invalid point {p.name}" in result.stdout for p in invalid)
    slurm = tmp_path / "grid" / "slurm"
    scripts = (slurm / "runs.txt").read_text().splitlines()
    assert len(scripts) == len(valid) and all(os.access(path, os.X_OK) for path in scripts)
    array = (slurm / "array.sbatch").read_text()
    assert f"#SBATCH --array=0-{len(valid) - 1}%4" in array and "#SBATCH --gres=gpu:8" in array
    point = valid[-1]
    script = (slurm / f"{point.name}.sh").read_text()
    assert f"--only={point.name}" in script and "--skip_invalid" in script and "source /venv/bin/activate" in script
    assert all(f"--config.{key}={sweep_runner.cli_value(value)}" in script for key, value in point.overrides.items())
    for path in [*scripts, slurm / "array.sbatch"]:
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    # Nothing ran: no run has a status, a log or a workdir.
    assert sorted(os.listdir(tmp_path / "grid")) == ["slurm", "sweep.json"]


# ----------------------------------------------------------------------------------------------------
# Devices, errors, statuses


def test_device_slots_split_gpus_and_pin_cpu_cores():
    assert [s.env for s in sweep_runner.device_slots(1, gpus=["0", "1"])] == [{}]
    slots = sweep_runner.device_slots(2, gpus=["0", "1", "2", "3", "4"])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0,1,2", "3,4"] and slots[0].cpus is None
    slots = sweep_runner.device_slots(3, gpus=["0", "1"])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0", "1", "0"]
    assert all(s.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" for s in slots)
    slots = sweep_runner.device_slots(2, gpus=[], cpus=[0, 1])
    assert [s.cpus for s in slots] == [[0], [1]] and slots[0].env["OMP_NUM_THREADS"] == "1"
    assert "--xla_force_host_platform_device_count=1" in slots[0].env["XLA_FLAGS"]
    assert "--xla_cpu_multi_thread_eigen=false" in slots[0].env["XLA_FLAGS"]
    slots = sweep_runner.device_slots(2, gpus=[], cpus=list(range(8)))
    assert [s.cpus for s in slots] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "multi_thread_eigen" not in slots[0].env["XLA_FLAGS"]


def test_error_line_is_the_exception_of_the_traceback():
    log = ("12:00:01 step 2: loss nan\nTraceback (most recent call last):\n  File \"train.py\", line 3\n"
           "    raise FloatingPointError(...)\nFloatingPointError: non-finite training loss nan at step 2\n"
           "  and a second line of the message\n")
    assert sweep_runner.error_line(log) == "FloatingPointError: non-finite training loss nan at step 2"
    assert sweep_runner.error_line("jaxlib._jax.XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory\n").startswith(
        "jaxlib._jax.XlaRuntimeError: RESOURCE_EXHAUSTED")
    assert sweep_runner.error_line("no exception here\nKilled\n") == "Killed"
    # The entry points print the project's errors as "error: <message>": the message is the error line.
    assert sweep_runner.error_line("step 2: loss 3.1\nerror: the valid split has no sentence pairs\n") == \
        "the valid split has no sentence pairs"
    earlier = f"{sweep_runner.ATTEMPT} 1\nValueError: an earlier attempt\n{sweep_runner.ATTEMPT} 2\nstep 3: loss 2.0\nKilled\n"
    assert sweep_runner.error_line(earlier) == "Killed"


def fake_run(sweep_dir, name, status=None, scores_step=None, metrics=()):
    workdir = sweep_dir / name
    workdir.mkdir(parents=True)
    if status is not None:
        (workdir / sweep_runner.STATUS).write_text(json.dumps(status))
    if scores_step is not None:
        (workdir / "scores.json").write_text(json.dumps({
            "step": scores_step, "valid": {"loss": 1.5, "perplexity": 4.0}, "bleu": {"valid": {"bleu": 40.0}, "test": {"bleu": 41.0}}}))
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"half a li')


def test_collect_reports_every_status_and_writes_csv_markdown_and_plot(tmp_path):
    runs = ["a=1", "a=2", "a=3", "a=4", "a=5", "a=6"]
    (tmp_path / sweep_runner.MANIFEST).write_text(json.dumps({"axes": ["model.a"], "runs": [
        {"name": name, "overrides": {"model.a": i + 1}, "num_train_steps": 10,
         "invalid": "model config: bad" if name == "a=6" else None} for i, name in enumerate(runs)]}))
    train = [{"step": 5, "split": "train", "loss": 3.0, "target_tokens": 1000, "tokens_per_second": 100.0},
             {"step": 10, "split": "train", "loss": 2.0, "target_tokens": 1000, "tokens_per_second": 400.0},
             {"step": 5, "split": "valid_bleu", "bleu": 45.0}, {"step": 10, "split": "valid_bleu", "bleu": 40.0},
             {"step": 5, "split": "valid", "loss": 2.5}]
    fake_run(tmp_path, "a=1", {"state": "exited", "returncode": 0, "total_wall_seconds": 75.0}, 10, train)
    fake_run(tmp_path, "a=2", {"state": "exited", "returncode": 1, "error": "FloatingPointError: nan"}, None,
             train[:1])
    fake_run(tmp_path, "a=3", {"state": "running", "pid": os.getpid(), "host": sweep_runner.socket.gethostname(),
                               "started": 1.0}, None, train[:1])
    fake_run(tmp_path, "a=4", {"state": "running", "pid": 2**22 + 12345, "host": sweep_runner.socket.gethostname()})
    axes, rows, curves = sweep_results.collect(str(tmp_path))  # a=5 has no workdir: never launched
    by_name = {row["name"]: row for row in rows}
    assert [row["status"] for row in rows] == ["done", "failed", "running", "stopped", "pending", "invalid"]
    done = by_name["a=1"]
    assert (done["dev_bleu"], done["best_dev_bleu"], done["test_bleu"], done["train_loss"], done["dev_loss"]) == (
        40.0, 45.0, 41.0, 2.0, 1.5)
    assert done["dev_perplexity"] == 4.0 and done["step"] == 10 and done["tokens_per_second"] == pytest.approx(2000 / 12.5)
    assert by_name["a=3"]["step"] == 5 and by_name["a=3"]["wall_seconds"] > 1e6  # still counting
    assert curves["a=1"]["dev_bleu"] == [(5, 45.0), (10, 40.0)]

    table = sweep_results.write_results(str(tmp_path), echo=lambda line: None)
    assert "| a=1 | 1 | 40.00 | 45.00 | 41.00 | 2.000 | 1.500 | 10 | 160 | 1m15s | done |" in table
    assert "| failed (exit 1): FloatingPointError: nan |" in table and "| 5/10 |" in table
    assert "| invalid: model config: bad |" in table
    assert (tmp_path / "results.md").read_text() == table
    with open(tmp_path / "results.csv", newline="") as handle:
        records = list(csv.DictReader(handle))
    assert [(r["name"], r["model.a"], r["status"]) for r in records[:2]] == [("a=1", "1", "done"),
                                                                             ("a=2", "2", "failed")]
    assert records[1]["error"] == "FloatingPointError: nan" and records[1]["exit_code"] == "1"


def test_a_run_still_running_on_this_host_is_not_started_twice(tmp_path):
    (point,) = sweep_runner.make_points(DEFAULT, [{"seed": 1}])
    (tmp_path / point.name).mkdir()
    (tmp_path / point.name / sweep_runner.STATUS).write_text(json.dumps(
        {"state": "running", "pid": os.getpid(), "host": sweep_runner.socket.gethostname()}))
    lines = []
    assert sweep_runner.run_points([point], str(tmp_path), DEFAULT, echo=lines.append) == {}
    assert lines == [f"skip seed=1: already running as pid {os.getpid()} (another sweep of this directory)"]


def test_a_run_killed_hard_on_another_host_is_stopped_once_its_workdir_lock_says_so(tmp_path):
    from transformer import workdir as workdirs
    now, hour = time.time(), 3600.0
    target = {"num_train_steps": 10, "max_train_minutes": 0.0}

    def state(name, started, heartbeat=None, scores_step=None):
        fake_run(tmp_path, name, {"state": "running", "pid": 4242, "host": "node-17", "started": started},
                 scores_step)
        if heartbeat is not None:  # the lock train.py holds on the node, refreshed every minute while it lives
            (tmp_path / name / "lock.json").write_text(json.dumps({
                "host": "node-17", "pid": 4242, "token": "t" + name, "started": workdirs._now_text(started),
                "heartbeat": workdirs._now_text(heartbeat)}))
        return sweep_runner.run_state(str(tmp_path / name), target)

    assert state("starting", now - 30)[0] == "running"  # not yet locked: it may still be importing
    assert state("beating", now - hour, heartbeat=now - 30)[0] == "running"
    stale, status = state("stale", now - hour, heartbeat=now - hour / 2)
    assert stale == "stopped" and status["error"].startswith("killed hard: its workdir lock is stale: its last "
                                                             "heartbeat was 30 min ago")
    unlocked, status = state("unlocked", now - hour)
    assert unlocked == "stopped" and "no job has held its workdir lock in the 1h00m" in status["error"]
    assert state("finished", now - hour, scores_step=10)[0] == "done"  # its wrapper died after the scores


@pytest.mark.slow
def test_a_point_ended_by_its_time_budget_is_done_and_reported_by_its_final_scores(tmp_path):
    """A time-budgeted point (num_train_steps an upper bound) is done when its run ended by the budget under the
    point's settings: a rerun skips it, and collect reports scores.json's final scores, not in-training BLEU."""
    overrides = {**TINY_OVERRIDES, "train.num_train_steps": 1000, "train.max_train_minutes": 1e-4,
                 "decode.bleu_splits": "valid", "train.bleu_every_steps": 1}
    sweep_file = tmp_path / "timed.py"
    sweep_file.write_text(f"def get_sweep():\n    return [{overrides!r}]\n")
    sweep_dir = tmp_path / "sweep"
    (name,) = sweep_runner.run_names([overrides])
    result = run_sweep_script(f"--sweep={sweep_file}", f"--sweep_dir={sweep_dir}")
    assert result.returncode == 0 and f"{name}: done" in result.stdout, result.stderr[-3000:]
    scores = json.loads((sweep_dir / name / "scores.json").read_text())
    assert scores["step"] < 1000 and scores["end"]["reason"].startswith("the time budget")
    again = run_sweep_script(f"--sweep={sweep_file}", f"--sweep_dir={sweep_dir}")
    assert again.returncode == 0 and f"skip {name}: done" in again.stdout and f"start {name}" not in again.stdout
    (row,) = sweep_results.collect(str(sweep_dir))[1]
    assert row["status"] == "done" and row["scored"] == "final" and row["step"] == scores["step"]
    assert row["dev_bleu"] == scores["bleu"]["valid"]["bleu"]
    assert f"| {scores['step']} (timed) |" in (sweep_dir / "results.md").read_text()


def children(pid: int) -> list[int]:
    return [int(child) for child in open(f"/proc/{pid}/task/{pid}/children").read().split()]


@pytest.mark.slow
def test_an_emitted_slurm_script_stops_its_run_on_the_signal_and_requeues_on_75(tmp_path):
    """SLURM's stop signal (--signal=TERM@300) reaches every process of the job step, scripts/sweep.py and the
    train.py it runs, which takes the sweep's forwarded copy as the same stop; the run commits and exits 75, and the script requeues its job. srun and scontrol are stand-ins here that
    record their calls (no SLURM on this machine); the sweep, the run and the signal are real."""
    overrides = {**TINY_OVERRIDES, "train.num_train_steps": 100000}
    sweep_file = tmp_path / "long.py"
    sweep_file.write_text(f"def get_sweep():\n    return [{overrides!r}]\n")
    sweep_dir = tmp_path / "sweep"
    (name,) = sweep_runner.run_names([overrides])
    assert run_sweep_script(f"--sweep={sweep_file}", f"--sweep_dir={sweep_dir}", "--emit=slurm").returncode == 0
    script = sweep_dir / "slurm" / f"{name}.sh"
    assert "#SBATCH --signal=TERM@300" in script.read_text() and "#SBATCH --requeue" in script.read_text()
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> {calls}\nwhile [[ $1 == --* ]]; do shift; done\n'
                                  'exec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> {calls}\n')
    for tool in ("srun", "scontrol"):
        os.chmod(bin_dir / tool, 0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "PYTHON": sys.executable}
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    workdir, deadline = sweep_dir / name, time.time() + 120
    while not (workdir / "lock.json").exists():  # train.py is up, its stop handlers installed
        assert job.poll() is None and time.time() < deadline, job.communicate()[0][-3000:]
        time.sleep(0.1)
    (step_pid,) = children(job.pid)  # the job step: scripts/sweep.py
    (train_pid,) = children(step_pid)
    # SLURM (proctrack/cgroup) signals every process of the step: the run gets the sweep's copy too.
    os.kill(train_pid, signal.SIGTERM)
    os.kill(step_pid, signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 75, output[-3000:]
    assert calls.read_text().splitlines()[0].startswith("srun --ntasks=1 ")
    assert calls.read_text().splitlines()[1:] == ["scontrol requeue 4242"]
    status = json.loads((workdir / sweep_runner.STATUS).read_text())
    assert status["state"] == "stopped" and status["returncode"] == 75 and not (workdir / "lock.json").exists()


def test_a_second_stop_while_the_runs_commit_kills_them_and_none_outlives_the_sweep(tmp_path):
    """The run is frozen (SIGSTOP) so that the sweep is surely in its grace period when the second signal comes."""
    overrides = {**TINY_OVERRIDES, "train.num_train_steps": 100000}
    sweep_file = tmp_path / "long.py"
    sweep_file.write_text(f"def get_sweep():\n    return [{overrides!r}]\n")
    sweep_dir = tmp_path / "sweep"
    (name,) = sweep_runner.run_names([overrides])
    sweep = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "sweep.py"), f"--sweep={sweep_file}",
                              f"--sweep_dir={sweep_dir}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.time() + 120
    while not (sweep_dir / name / "lock.json").exists():
        assert sweep.poll() is None and time.time() < deadline, sweep.communicate()
        time.sleep(0.1)
    (train_pid,) = children(sweep.pid)
    try:
        os.kill(train_pid, signal.SIGSTOP)
        sweep.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the sweep has passed the stop on and waits for the frozen run
        assert sweep.poll() is None
        sweep.send_signal(signal.SIGINT)
        _, stderr = sweep.communicate(timeout=60)
        assert "SIGINT again: killing the runs" in stderr and sweep.returncode not in (0, 75), stderr[-3000:]
        assert not os.path.exists(f"/proc/{train_pid}")  # reaped, not orphaned
    finally:
        if os.path.exists(f"/proc/{train_pid}"):
            os.kill(train_pid, signal.SIGKILL)
    assert json.loads((sweep_dir / name / sweep_runner.STATUS).read_text())["state"] == "stopped"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"name": f"x={x}", "model.x": x, "status": "done", "dev_bleu": 10.0 * x, "dev_loss": 3.0 / x}
            for x in (1, 2)]
    curves = {row["name"]: {"train_loss": [(1, 4.0), (2, 3.0)], "dev_loss": [(2, 3.5)], "dev_bleu": [(2, 5.0)]}
              for row in rows}
    sweep_results.plot(str(tmp_path / "results.png"), ["model.x"], rows, curves)
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------------
# A real sweep: 2 tiny points, one of which fails


@pytest.mark.slow  # three runs of a sweep, one failing: ~50 s on 2 cores
@pytest.mark.parametrize("key, good_value, bad_value, error", [
    # A bad override that only training can find: fails in ~5 s, which keeps this test fast.
    ("data.builtin_valid_size", 64, 0, "the valid split has no sentence pairs"),
    # A run that diverges: fails after compiling, at its first logged step.
    pytest.param("optimizer.learning_rate_scale", 0.5, 1e9, "non-finite training loss nan",
                 marks=pytest.mark.slow),
])
def test_a_tiny_sweep_isolates_a_failure_skips_finished_runs_and_collects(tmp_path, key, good_value, bad_value,
                                                                          error):
    sweep_file = tmp_path / "tiny_sweep.py"
    shared = {k: v for k, v in TINY_OVERRIDES.items() if k != key}  # a key set twice in a point is refused
    sweep_file.write_text("from transformer import sweep\n"
                          f"SHARED = {shared!r}\n"
                          "def get_sweep():\n"
                          f"    return sweep.product([SHARED], sweep.axis({key!r}, [{good_value!r}, {bad_value!r}]))\n")
    sweep_dir = tmp_path / "sweep"
    args = [f"--sweep={sweep_file}", f"--sweep_dir={sweep_dir}", "--parallel=2"]
    leaf = key.rsplit(".", 1)[-1]
    good, bad = f"{leaf}={sweep_runner.name_value(good_value)}", f"{leaf}={sweep_runner.name_value(bad_value)}"

    result = run_sweep_script(*args)
    assert result.returncode == 1, result.stderr[-3000:]  # a run failed: the sweep says so, after finishing
    assert f"{bad}: failed (exit 1): {error}" in result.stdout
    assert f"{good}: done" in result.stdout
    scores = json.loads((sweep_dir / good / "scores.json").read_text())
    assert scores["step"] == TINY_OVERRIDES["train.num_train_steps"]
    saved = json.loads((sweep_dir / good / "config.json").read_text())
    for name, value in {**shared, key: good_value}.items():  # the point's own value and every shared one reached it
        section, field = name.split(".")
        assert saved[section][field] == value, name
    status = json.loads((sweep_dir / bad / sweep_runner.STATUS).read_text())
    assert status["state"] == "exited" and status["returncode"] == 1 and status["slot"] in ("CPU 0", "CPU 1")
    assert f"error: {error}" in (sweep_dir / bad / sweep_runner.LOG).read_text()  # the run's own one-line message
    with open(sweep_dir / "results.csv", newline="") as handle:
        statuses = {r["name"]: (r["status"], r["error"]) for r in csv.DictReader(handle)}
    assert statuses.keys() == {good, bad} and statuses[good] == ("done", "")
    assert statuses[bad][0] == "failed" and statuses[bad][1].startswith(error)  # the run's message, from its start
    assert f"| {good} | {sweep_runner.name_value(good_value)} |" in (sweep_dir / "results.md").read_text()
    if importlib.util.find_spec("matplotlib"):
        assert (sweep_dir / "results.png").stat().st_size > 0

    # The same command again: the finished run is skipped, the failed one is retried (and fails again).
    before = (sweep_dir / good / "scores.json").stat().st_mtime_ns
    result = run_sweep_script(*args)
    assert result.returncode == 1
    assert f"skip {good}: done" in result.stdout and f"start {bad}" in result.stdout
    assert f"start {good}" not in result.stdout
    assert (sweep_dir / good / "scores.json").stat().st_mtime_ns == before

    # The SLURM script of a finished point, run by hand, skips it too; --collect alone rewrites the table.
    result = run_sweep_script(*args, "--emit=slurm")
    assert result.returncode == 0 and "--array=0-1%2" in (sweep_dir / "slurm" / "array.sbatch").read_text()
    script = subprocess.run(["bash", str(sweep_dir / "slurm" / f"{good}.sh")], capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable}, timeout=300)
    assert script.returncode == 0 and f"skip {good}: done" in script.stdout, script.stderr[-2000:]
    (sweep_dir / "results.md").unlink()
    result = run_sweep_script("--collect", sweep_dir)
    assert result.returncode == 0 and "1 done, 1 failed" in result.stdout
    assert f"failed (exit 1): {error}" in (sweep_dir / "results.md").read_text()


@pytest.mark.slow
def test_a_stopped_sweep_resumes_its_run_from_the_checkpoint(tmp_path):
    """SIGTERM (or Ctrl-C) stops the children and records them as stopped; the same command resumes them."""
    overrides = {**TINY_OVERRIDES, "train.num_train_steps": 300, "train.checkpoint_every_steps": 20,
                 "train.log_every_steps": 20, "train.eval_every_steps": 100}
    sweep_file = tmp_path / "one.py"
    sweep_file.write_text(f"def get_sweep():\n    return [{overrides!r}]\n")
    sweep_dir = tmp_path / "sweep"
    command = [sys.executable, os.path.join(ROOT, "scripts", "sweep.py"), f"--sweep={sweep_file}",
               f"--sweep_dir={sweep_dir}"]
    (name,) = sweep_runner.run_names([overrides])
    checkpoints = sweep_dir / name / "checkpoints"
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (checkpoints.is_dir() and any(p.isdigit() for p in os.listdir(checkpoints))):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 75 and "interrupted" in stderr  # its run committed a checkpoint: resumable
    assert json.loads((sweep_dir / name / sweep_runner.STATUS).read_text())["state"] == "stopped"
    assert sweep_results.collect(str(sweep_dir))[1][0]["status"] == "stopped"

    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in (sweep_dir / name / sweep_runner.LOG).read_text()
    assert json.loads((sweep_dir / name / "scores.json").read_text())["step"] == 300
    assert "| done |" in (sweep_dir / "results.md").read_text()
