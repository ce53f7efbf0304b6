"""transformer/sharding.py: the rules table and mesh arithmetic here; sharded training on 8 fake CPU devices in
tests/multidevice_test.py, run in a subprocess (XLA_FLAGS must be set before JAX starts, and the rest of the
suite keeps its one device)."""

import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec

from transformer import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_logical_names_map_through_the_rules_table():
    rules = sharding.MeshConfig().logical_rules
    assert rules["batch"] == ("data", "fsdp") and rules["mlp"] == ("tensor",)
    assert sharding.logical_to_mesh(("embed", "mlp"), rules) == PartitionSpec("fsdp", "tensor")
    assert sharding.logical_to_mesh((None, "embed"), rules) == PartitionSpec(None, "fsdp")
    # a mesh axis appears once per array: the second `tensor` dimension stays whole
    assert sharding.logical_to_mesh(("heads", "mlp"), rules) == PartitionSpec("tensor", None)


def test_mesh_sizes_resolve_minus_one_and_fail_clearly():
    assert sharding.mesh_shape((-1, 2, 1), 8) == (4, 2, 1)
    with pytest.raises(ValueError, match="needs 4 devices; there are 8"):
        sharding.mesh_shape((2, 2, 1), 8)
    with pytest.raises(ValueError, match="not divisible by 3"):
        sharding.mesh_shape((-1, 3, 1), 8)
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.MeshConfig(-1, -1, 1)
    with pytest.raises(ValueError, match="names mesh axes \\['model'\\]"):
        sharding.MeshConfig(rules="mlp=model")


def run_multidevice(marker):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "pytest", os.path.join(ROOT, "tests", "multidevice_test.py"), "-q", "-m", marker,
               "-p", "no:cacheprovider", "-n", "0"]  # one process: its 8 devices are the parallelism
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


def test_sharded_training_on_8_devices():
    run_multidevice("not slow")


@pytest.mark.slow
def test_sharded_training_on_8_devices_more_meshes_and_bfloat16():
    run_multidevice("slow")


CLUSTER_VARIABLES = ("SLURM_NTASKS", "SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "OMPI_COMM_WORLD_SIZE")


@pytest.mark.parametrize("environment, detected", [
    ({}, False),
    ({"SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}, True),
    ({"SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}, False),  # a one-task job is a single process
    ({"SLURM_NTASKS": "2"}, False),  # not inside a job (srun sets SLURM_JOB_ID)
    ({"TPU_WORKER_HOSTNAMES": "host-0,host-1"}, True),
    ({"TPU_WORKER_HOSTNAMES": "host-0"}, False),  # a single-host TPU
    ({"OMPI_COMM_WORLD_SIZE": "4"}, True),
])
def test_multi_host_runs_are_detected_from_the_clusters_environment(monkeypatch, environment, detected):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args: calls.append(args))
    monkeypatch.setattr(jax.config, "update", lambda *args: None)  # this process's backend is already running
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert sharding.initialize_distributed() is detected
    assert calls == ([()] if detected else [])  # jax.distributed then reads the cluster itself


def test_explicit_multi_host_flags_must_be_complete(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args: calls.append(args))
    monkeypatch.setattr(jax.config, "update", lambda *args: None)
    assert sharding.initialize_distributed("10.0.0.1:1234", 2, 1)
    assert calls == [("10.0.0.1:1234", 2, 1)]
    for partial in [("10.0.0.1:1234", 2, -1), ("", 2, 0), ("10.0.0.1:1234", 2, 2)]:
        with pytest.raises(ValueError, match="give all three"):
            sharding.initialize_distributed(*partial)
    assert len(calls) == 1
