"""Real processes on localhost: two JAX processes each read their own shard and build their half of the global batch;
input workers end with their parent, however it ends."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_processes_build_disjoint_halves_of_one_global_batch(tmp_path):
    from data_test import RANDOM_LENGTHS, write_cache

    cache = write_cache(tmp_path / "cache", RANDOM_LENGTHS)
    with socket.socket() as probe:  # a free port for the coordinator
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    processes = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "processes_worker.py"), str(index),
                                   str(port), cache.directory], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for index in range(2)]
    outputs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [o["shard"] for o in outputs] == [[0, 2], [1, 2]]
    for output in outputs:
        assert output["global_shape"] == [8, 32] and output["local_rows"] == 4 and output["local_data_in_global"]
    first, second = (set(o["pairs"]) for o in outputs)
    assert first and second and not first & second
    assert first | second <= set(np.arange(len(RANDOM_LENGTHS)).tolist())


# Reads a few batches through grain worker processes, says its children's pids, then waits to be killed.
WORKERS_RUN = """
import os, sys, time
from absl import flags
from data_test import RANDOM_LENGTHS, write_cache
from transformer import data
flags.FLAGS.mark_as_parsed()  # grain's workers read its absl flags, as under train.py
cache = write_cache(sys.argv[1], RANDOM_LENGTHS)
iterator = iter(data.train_dataset(cache, data.LengthFilter.of(cache, 32).kept, seed=0, max_length=32,
                                   rows_per_batch=4, num_workers=2))
for _ in range(3):
    next(iterator)
print(" ".join(map(str, children(os.getpid()))), flush=True)
time.sleep(600)
"""


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")
def test_input_workers_exit_when_their_parent_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT]), "JAX_PLATFORMS": "cpu"}
    script = "from data_processes_test import children\n" + WORKERS_RUN
    process = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "cache")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        pids = [int(pid) for pid in line.split()]
        assert len(pids) >= 2, process.stderr.read() if process.poll() is not None else line  # 2 workers (+ tracker)
    finally:
        process.kill()  # SIGKILL: the parent has no chance to stop its workers itself
        process.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)], "processes outlived their parent's SIGKILL"
