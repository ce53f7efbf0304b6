"""Two real JAX processes on localhost: each reads its own shard and builds its half of the global batch."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

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
