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
    assert sharding.logical_to_mesh(("batch", "length"), rules) == PartitionSpec(("data", "fsdp", "expert"), None)
    assert sharding.logical_to_mesh(("expert", "embed", "mlp"), rules) == PartitionSpec("expert", "fsdp", "tensor")
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


def test_the_layer_axis_of_scanned_stacks_is_never_split():
    rules = sharding.MeshConfig().logical_rules
    assert sharding.logical_to_mesh(("layers", "embed", "mlp"), rules) == PartitionSpec(None, "fsdp", "tensor")
    with pytest.raises(ValueError, match="maps 'layers' \\(the scanned layer axis\\) to \\('data',\\)"):
        sharding.MeshConfig(rules="embed=fsdp, layers=data")


# On 8 fake devices, a scanned model's state is born sharded: the layer axis whole, `embed` over fsdp (and `mlp` over
# tensor) as in the per-layer model, the Adam moments like their parameters; then a train step runs on fsdp=8.
SCANNED_ON_8_DEVICES = """
import jax, numpy as np
from jax.sharding import PartitionSpec as P
from transformer import sharding, trainer
from transformer.model import ModelConfig
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.plan import create_train_state, make_steps, model_graphdef, state_shardings
from transformer.settings import TrainConfig

assert jax.device_count() == 8
model = ModelConfig(vocab_size=64, emb_dim=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=3, mlp_dim=64,
                    dropout_rate=0.1, scan_layers=True)
optimizer, schedule = make_optimizer(OptimizerConfig(warmup_steps=10), model.emb_dim)
hidden_spec = P(None, "fsdp", "tensor")
for sizes, hidden_shard in [((2, 2, 2), (3, 16, 32)), ((1, 8, 1), (3, 4, 64))]:
    mesh_config = sharding.MeshConfig(*sizes)
    mesh = sharding.make_mesh(mesh_config)
    shardings = state_shardings(model, optimizer, mesh, mesh_config)
    state = create_train_state(model, optimizer, seed=0, shardings=shardings)
    kernel = state.params["decoder_layers"]["stacked"]["feed_forward"]["hidden"]["kernel"]  # [layers, embed, mlp]
    assert kernel.shape == (3, 32, 64) and kernel.sharding.spec == hidden_spec, kernel.sharding
    assert kernel.addressable_shards[0].data.shape == hidden_shard
    moment = state.opt_state[0].mu["decoder_layers"]["stacked"]["feed_forward"]["hidden"]["kernel"]
    assert moment.sharding.spec == hidden_spec
    query = state.params["encoder_layers"]["stacked"]["self_attention"]["query"]["kernel"]
    assert query.sharding.spec[0] is None and query.sharding.spec[1] == "fsdp"
    for spec in jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, state.params["encoder_layers"]),
                                is_leaf=lambda x: isinstance(x, P)):
        assert len(spec) == 0 or spec[0] is None, spec  # no stacked array is split along its layers
    born = dict(state=state, shardings=shardings, mesh=mesh, mesh_config=mesh_config)
# One train step on the last mesh, fsdp=8.
batch_sharding = sharding.batch_sharding(born["mesh"], born["mesh_config"])
train, _ = make_steps(model_graphdef(model), optimizer, schedule, TrainConfig(),
                              born["shardings"], batch_sharding)
rng = np.random.default_rng(0)
batch = {key: rng.integers(3, 64, (8, 12)).astype(np.int32) for key in ("inputs", "targets")}
state, metrics = train(born["state"], sharding.place_batch(batch, batch_sharding))
assert np.isfinite(float(metrics["loss"])), metrics
kernel = state.params["decoder_layers"]["stacked"]["feed_forward"]["hidden"]["kernel"]
assert kernel.sharding.spec == hidden_spec
print("ok")
"""


@pytest.mark.slow  # its own 8-device process; the per-layer model is born sharded in the default suite
def test_a_scanned_models_state_is_born_sharded_on_8_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", SCANNED_ON_8_DEVICES], capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (result.stdout[-3000:]
                                                                             + result.stderr[-5000:])


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
