"""Two processes on localhost (jax.distributed over gloo, one CPU device each, mesh data=2) run 20 steps of
train.py and end with the parameters of the same run in one process."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from tiny import TINY_OVERRIDES, metric_records

from transformer.restore import restore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {**TINY_OVERRIDES, "train.num_train_steps": 20, "train.log_every_steps": 10,
             "train.eval_every_steps": 10, "train.checkpoint_every_steps": 10, "decode.bleu_splits": "valid",
             "model.dropout_rate": 0.1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def train_command(workdir, *extra):
    overrides = [f"--config.{key}={value}" for key, value in OVERRIDES.items()]
    return [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={workdir}", *overrides, *extra]


@pytest.mark.slow  # ~2 min on 2 idle cores: three train.py runs, each compiling and decoding
def test_two_processes_end_with_the_parameters_of_one(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    single = subprocess.run(train_command(tmp_path / "single"), capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    address = f"localhost:{free_port()}"
    processes = [subprocess.Popen(train_command(tmp_path / "multi", f"--coordinator_address={address}",
                                                "--num_processes=2", f"--process_id={index}"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
                 for index in range(2)]
    outputs = [process.communicate(timeout=600) for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    assert "valid BLEU" in outputs[0][0] and "BLEU" not in outputs[1][0]  # one console: process 0's
    assert "mesh {'data': 2" in outputs[0][0]

    def records(name):  # one writer: process 1 adds no line to the shared workdir's metrics.jsonl
        return [(record["step"], record["split"]) for record in metric_records(tmp_path / name)]
    assert records("multi") == records("single")
    one, two = restore(str(tmp_path / "single")), restore(str(tmp_path / "multi"))
    assert one.step == two.step == 20
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(two.params)[0], jax.tree.leaves(one.params)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # ~2 min on 2 idle cores, as above
def test_two_processes_train_a_mixture_as_one_does(tmp_path):
    """A mixture's caches built by process 0 and waited for by process 1, its batches split over both: the same
    steps and parameters as one process."""
    from transformer import corpus
    folder = tmp_path / "extra"
    folder.mkdir()
    pairs = corpus.builtin_split("train", seed=11, train_size=500)
    for side, lang in enumerate(("en", "es")):
        (folder / f"train.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs), encoding="utf-8")
    mix = [f"--config.data.mixture=2:main,1:synthetic:{folder}", "--config.data.tag_synthetic=true",
           "--config.data.filter_duplicates=true"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    single = subprocess.run(train_command(tmp_path / "single", *mix), capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    address = f"localhost:{free_port()}"
    processes = [subprocess.Popen(train_command(tmp_path / "multi", *mix, f"--coordinator_address={address}",
                                                "--num_processes=2", f"--process_id={index}"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
                 for index in range(2)]
    for process in processes:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
    shares = [(r["step"], r["share_main"]) for r in metric_records(tmp_path / "multi") if r["split"] == "train"]
    assert shares == [(r["step"], r["share_main"]) for r in metric_records(tmp_path / "single")
                      if r["split"] == "train"]
    one, two = restore(str(tmp_path / "single")), restore(str(tmp_path / "multi"))
    assert one.step == two.step == 20
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(two.params)[0], jax.tree.leaves(one.params)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))
