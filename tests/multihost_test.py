"""A multi-host run on localhost, as a pod would run it: 4 processes x 2 fake CPU devices (jax.distributed over
gloo), mesh fsdp=4 x data=2, train and checkpoint, stop; resume as 2 processes x 4 devices, finish, average the
last 3 checkpoints, decode and score. The parameters and the BLEU equal those of the same run in one process of
8 devices, uninterrupted; eval.py on 2 processes scores what it scores on one."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from multiprocess_test import free_port
from tiny import TINY_OVERRIDES

from transformer import data
from transformer.restore import load_workdir_config, restore
from transformer.settings import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {**TINY_OVERRIDES, "train.num_train_steps": 12, "train.log_every_steps": 3,
             "train.eval_every_steps": 0, "train.checkpoint_every_steps": 3, "train.keep_checkpoints": 2,
             "decode.average_last": 3, "decode.bleu_splits": "valid", "model.dropout_rate": 0.1,
             "mesh.data": 2, "mesh.fsdp": 4}


def run(workdir, processes, devices, steps):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    command = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}",
               *[f"--config.{key}={value}" for key, value in {**OVERRIDES, "train.num_train_steps": steps}.items()]]
    if processes == 1:
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout
    address = f"localhost:{free_port()}"
    logs = [open(f"{workdir}.{processes}x{devices}.process{index}.log", "w+") for index in range(processes)]
    # Files, not pipes: a process whose pipe fills while another is read would block before the shutdown barrier.
    started = [subprocess.Popen(command + [f"--coordinator_address={address}", f"--num_processes={processes}",
                                           f"--process_id={index}"], stdout=log, stderr=subprocess.STDOUT,
                                text=True, cwd=ROOT, env=env) for index, log in enumerate(logs)]
    codes = [process.wait(timeout=900) for process in started]
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    for code, output in zip(codes, outputs):
        assert code == 0, output[-3000:]
    return outputs[0]


def evaluate(workdir, processes, devices, tool=("eval.py", "--split=valid")):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    program = ["-m", "transformer.translate"] if tool[0] == "translate" else [os.path.join(ROOT, tool[0])]
    command = [sys.executable, *program, f"--workdir={workdir}", *tool[1:]]
    if processes == 1:
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        return
    address = f"localhost:{free_port()}"
    logs = [open(f"{workdir}.eval.process{index}.log", "w+") for index in range(processes)]
    started = [subprocess.Popen(command + [f"--coordinator_address={address}", f"--num_processes={processes}",
                                           f"--process_id={index}"], stdout=log, stderr=subprocess.STDOUT,
                                text=True, cwd=ROOT, env=env) for index, log in enumerate(logs)]
    for process, log in zip(started, logs):
        code = process.wait(timeout=900)
        log.seek(0)
        assert code == 0, log.read()[-3000:]
        log.close()


@pytest.mark.slow  # four train.py runs (7 processes), each compiling and decoding: minutes on 2 cores
def test_four_hosts_stopped_and_resumed_on_two_end_like_one_process(tmp_path):
    run(tmp_path / "one", 1, 8, 12)
    run(tmp_path / "hosts", 4, 2, 6)  # stopped after its 6th step (it ends and scores as any run does)
    starts = json.loads((tmp_path / "hosts" / "run.json").read_text())["starts"]
    assert [(s["processes"], s["devices"]) for s in starts] == [(4, 8)]
    output = run(tmp_path / "hosts", 2, 4, 12)
    assert "resumed from" in output and "averaging the parameters of the checkpoints of steps [6, 9, 12]" in output
    starts = json.loads((tmp_path / "hosts" / "run.json").read_text())["starts"]
    assert [(s["processes"], s["devices"], s["mesh"]["fsdp"]) for s in starts] == [(4, 8, 4), (2, 8, 4)]

    one = json.loads((tmp_path / "one" / "scores.json").read_text())
    hosts = json.loads((tmp_path / "hosts" / "scores.json").read_text())
    assert hosts["averaged_steps"] == one["averaged_steps"] == [6, 9, 12]
    assert hosts["bleu"]["valid"]["bleu"] == one["bleu"]["valid"]["bleu"]
    a = restore(str(tmp_path / "one"), average_last=3).params
    b = restore(str(tmp_path / "hosts"), average_last=3).params
    worst = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                   jax.tree.leaves(b)))
    print(f"largest parameter difference, 4+2 hosts against one process: {worst:.3g}")
    assert worst <= 1e-5

    # eval.py as 2 processes x 4 devices: each decodes its share, process 0 writes what one process would.
    evaluate(tmp_path / "hosts", 1, 8)
    name = "scores.valid.avg3_step12.greedy-extra4.json"
    alone = json.loads((tmp_path / "hosts" / "eval" / name).read_text())
    (tmp_path / "hosts" / "eval" / name).unlink()
    evaluate(tmp_path / "hosts", 2, 4)
    together = json.loads((tmp_path / "hosts" / "eval" / name).read_text())
    assert together[0]["bleu"] == alone[0]["bleu"] and together[0]["devices"] == 8
    translations = tmp_path / "hosts" / "eval" / "valid.avg3_step12.greedy-extra4.txt"
    assert len(translations.read_text().splitlines()) == together[0]["sentences"] == 64

    # translate as 2 processes x 4 devices writes what it writes as one process.
    sources = tmp_path / "sources.txt"
    settings = Settings.from_config(load_workdir_config(str(tmp_path / "hosts")))
    sources.write_text("".join(s + "\n" for s, _ in data.read_split(settings.data, "valid")[:40]))
    outputs = {}
    for processes, devices in ((1, 8), (2, 4)):
        output = tmp_path / f"translated{processes}.txt"
        evaluate(tmp_path / "hosts", processes, devices,
                 ("translate", f"--input={sources}", f"--output={output}", "--average_last=3"))
        outputs[processes] = output.read_text().splitlines()
    assert len(outputs[1]) == 40 and outputs[2] == outputs[1]
