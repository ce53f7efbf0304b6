"""Stop signals on train.py, as clusters send them: SIGTERM finishes the step, commits its checkpoint and exits with
status 75; the same command resumes, and the run ends bitwise equal to an uninterrupted one. With several processes
JAX's preemption notice stops every host at the same step. The fault drill (slow) mixes SIGTERM, SIGINT and SIGKILL."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import pytest
from multiprocess_test import free_port
from tiny import TINY_OVERRIDES, make_tiny_config, metric_records

from transformer import loop, trainer
from transformer.restore import restore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Enough steps that a signal sent at the first logged step finds the run still training.
OVERRIDES = {**TINY_OVERRIDES, "train.num_train_steps": 400, "train.log_every_steps": 1, "train.eval_every_steps": 0,
             "train.checkpoint_every_steps": 1000, "decode.bleu_splits": ""}


def command(workdir, overrides=OVERRIDES):
    return [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
            *[f"--config.{key}={value}" for key, value in overrides.items()]]


def wait_for_step(log_path, process, step=1, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        with open(log_path, encoding="utf-8") as handle:
            if re.search(rf"step {step}: loss", handle.read()):
                return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {log_path} (exit {process.poll()})")


def committed(workdir):
    directory = os.path.join(workdir, "checkpoints")
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit()) if os.path.isdir(directory) else []


def final_params(workdir):
    return jax.tree.leaves(jax.device_get(restore(str(workdir)).params))


def test_sigterm_commits_the_step_exits_75_and_the_same_command_resumes_bitwise(tmp_path):
    workdir, log_path = tmp_path / "stopped", tmp_path / "train.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        process = subprocess.Popen(command(workdir), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        wait_for_step(log_path, process)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=300)
    output = log_path.read_text()
    assert code == loop.EXIT_PREEMPTED, output[-3000:]
    stopped = int(re.search(r"stopped at step (\d+) with its checkpoint committed", output).group(1))
    assert 1 <= stopped < 400 and committed(workdir) == [stopped]  # no step lost: the one it was on is saved
    assert "Traceback" not in output

    resumed = subprocess.run(command(workdir), capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {workdir / 'checkpoints'} at step {stopped}" in resumed.stderr
    straight = tmp_path / "straight"
    trainer.Run(make_tiny_config(**OVERRIDES), str(straight)).train()
    for a, b in zip(final_params(straight), final_params(workdir)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.slow  # two processes, twice: start-up and compiling dominate (a minute or two on 2 cores)
def test_with_two_processes_a_preemption_notice_stops_both_at_one_step(tmp_path):
    workdir = tmp_path / "hosts"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    overrides = {**OVERRIDES, "mesh.data": 4}
    address = f"localhost:{free_port()}"
    logs = [tmp_path / f"process{index}.log" for index in range(2)]
    handles = [open(path, "w") for path in logs]
    started = [subprocess.Popen(command(workdir, overrides) + [f"--coordinator_address={address}", "--num_processes=2",
                                                               f"--process_id={index}"],
                                stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
               for index, handle in enumerate(handles)]
    wait_for_step(logs[0], started[0], step=2)
    started[1].send_signal(signal.SIGTERM)  # the notice reaches one host; JAX's service tells the other
    codes = [process.wait(timeout=600) for process in started]
    for handle in handles:
        handle.close()
    outputs = [path.read_text() for path in logs]
    assert codes == [loop.EXIT_PREEMPTED] * 2, [output[-2000:] for output in outputs]
    stopped = int(re.search(r"stopped at step (\d+) with its checkpoint committed", outputs[0]).group(1))
    assert committed(workdir) == [stopped] and 2 <= stopped < 400


@pytest.mark.slow  # the drill: an uninterrupted run and four more starts of train.py (a few minutes on 2 cores)
def test_the_fault_drill_loses_nothing_and_ends_bitwise_equal(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fault_drill.py"), "--interruptions=3",
                             "--steps=120", f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=1800)
    last = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert last == ("fault drill: 3 interruptions (1 SIGTERM, 1 SIGINT, 1 SIGKILL), 3 resumes, 0 checkpoints lost, "
                    "0 steps lost to SIGTERM/SIGINT, final parameters bitwise equal: yes"), last


# train.py, with one function of the run replaced by one that first sends this process a signal: a stop at a
# known point outside the loop. argv: module:attribute to replace, the signal's name, then train.py's flags.
SIGNALLED_TRAIN = """
import importlib, os, runpy, signal, sys
module, _, attribute = sys.argv[1].partition(":")
owner = importlib.import_module(module)
*path, name = attribute.split(".")
for part in path:
    owner = getattr(owner, part)
original, signum = getattr(owner, name), getattr(signal, sys.argv[2])

def signalled(*args, **kwargs):
    os.kill(os.getpid(), signum)
    return original(*args, **kwargs)

setattr(owner, name, signalled)
sys.argv = [sys.argv[0]] + sys.argv[3:]
runpy.run_path(os.path.join(os.getcwd(), "train.py"), run_name="__main__")
"""
# Asynchronous saves (the default): the final checkpoint may still be in the background when the signal comes.
OUTSIDE = {**TINY_OVERRIDES, "train.checkpoint_every_steps": 4, "decode.bleu_splits": "test"}


def signalled_train(workdir, target, signal_name):
    return subprocess.run([sys.executable, "-c", SIGNALLED_TRAIN, target, signal_name, f"--workdir={workdir}",
                           *[f"--config.{key}={value}" for key, value in OUTSIDE.items()]],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)


@pytest.mark.slow
def test_a_signal_in_the_final_evaluation_commits_the_last_save_and_the_same_command_finishes(tmp_path):
    workdir = tmp_path / "run"
    stopped = signalled_train(workdir, "transformer.evaluation:RunEvaluation.final", "SIGTERM")
    assert stopped.returncode == loop.EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert (f"SIGTERM during the final evaluation: stopped; the checkpoint of step 6 is committed in "
            f"{workdir / 'checkpoints'}; run the same command to evaluate it and finish (exit status 75)"
            in stopped.stderr), stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and stopped.stdout == ""
    assert committed(workdir) == [4, 6] and not (workdir / "lock.json").exists()
    assert not (workdir / "scores.json").exists()

    finished = subprocess.run(command(workdir, OUTSIDE), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"resumed from {workdir / 'checkpoints'} at step 6" in finished.stderr
    assert finished.stdout.startswith("test BLEU ") and committed(workdir) == [4, 6]
    scores = json.loads((workdir / "scores.json").read_text())
    assert scores["step"] == 6 and "test" in scores["bleu"]  # evaluated, not trained further
    assert max(record["step"] for record in metric_records(workdir)) == 6


@pytest.mark.parametrize("target, signal_name, phase", [
    ("transformer.trainer:load_corpus", "SIGTERM", "start-up"),
    ("transformer.trainer:Run.compile", "SIGINT", "compiling")])
def test_a_signal_in_start_up_or_compiling_stops_at_once_and_frees_the_workdir(tmp_path, target, signal_name, phase):
    workdir = tmp_path / "run"
    stopped = signalled_train(workdir, target, signal_name)
    assert stopped.returncode == loop.EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert (f"{signal_name} during {phase}: stopped; no checkpoint is saved; run the same command to start again "
            f"(exit status 75)" in stopped.stderr), stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr
    assert not (workdir / "lock.json").exists() and committed(workdir) == []
    assert "step 1: loss" not in stopped.stderr  # it stopped before training
