"""Decoding over several devices and processes gives the outputs of one device: 8 fake CPU devices in a
subprocess (decode_multidevice_test.py; XLA_FLAGS must be set before JAX starts, and the rest of the suite keeps
its one device), and two processes on localhost (jax.distributed over gloo, one CPU device each)."""

import json
import os
import socket
import subprocess
import sys

import decode_setup
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def run_multidevice(marker: str) -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "pytest", os.path.join(TESTS, "decode_multidevice_test.py"), "-q", "-m", marker,
               "-p", "no:cacheprovider", "-n", "0"]  # one process: its 8 devices are the parallelism
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def test_decoding_on_8_devices_gives_the_outputs_of_one():
    run_multidevice("not slow")


@pytest.mark.slow
def test_a_shrinking_batch_on_8_devices_gives_the_outputs_of_one():
    run_multidevice("slow")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # two processes, each compiling every search
def test_two_processes_each_get_every_output_of_one_process(tmp_path):
    tokenizer = decode_setup.vocabulary(tmp_path)  # trained once, read by both processes
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    worker, port = os.path.join(TESTS, "decode_processes_worker.py"), str(free_port())
    processes = [subprocess.Popen([sys.executable, worker, str(index), port, str(tmp_path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env) for index in range(2)]
    outputs = [process.communicate(timeout=900) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
    results = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]
    assert all((r["processes"], r["devices"]) == (2, 2) for r in results)
    graphdef, params = decode_setup.tiny_model()
    single = decode_setup.decode_all(decode_setup.make_searches(graphdef), params, tokenizer)
    assert results[0]["hypotheses"] == results[1]["hypotheses"]  # exactly: the same gathered arrays
    shrunk = results[0]["hypotheses"].pop("shrinking beam")  # rows gathered across the processes, then back
    decode_setup.assert_same_hypotheses(results[0]["hypotheses"], single)
    decode_setup.assert_same_hypotheses({"beam": shrunk}, {"beam": single["beam"]})
