"""The device mesh, the logical-axis rules, and the shardings of the train state and of batches.

The only module that maps logical axis names (carried by every parameter, see model.partitioned) to mesh
axes. The mesh has four axes:

  data    pure data parallelism: parameters replicated, batch split;
  fsdp    batch split too, and parameters/optimizer state split along `embed` (ZeRO-3 / FSDP);
  expert  batch split too, and a mixture of experts' `expert` dimension (expert parallelism, as GShard: the
          other parameters replicated over it);
  tensor  Megatron-style model parallelism: `mlp`, `heads` and `vocab` dimensions split.

Batches are split over (data, fsdp, expert). The same code runs on one CPU, one GPU, a node or many hosts: a
mesh of size 1 makes every sharding trivial.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer import config_files

PyTree = Any
MESH_AXES = ("data", "fsdp", "expert", "tensor")  # tensor innermost: the axis whose collectives are most frequent
BATCH_AXES = ("data", "fsdp", "expert")
AXES_NAMED = "(" + ", ".join(MESH_AXES) + ")"
# flax lm1b's few-rule table: logical name = mesh axes (joined by +), comma-separated; `none` replicates.
# `layers`, the leading axis of scanned layer stacks (model.scan_layers), stays whole: a scan step reads one
# layer, so a split layer axis would gather each layer across devices at every step.
LAYER_AXIS = "layers"
@config_files.section("mesh")
class MeshConfig:
    """config.mesh: the size of each mesh axis (one may be -1: all remaining devices) and the rules table."""

    data: int
    fsdp: int
    tensor: int
    expert: int
    rules: str

    def __post_init__(self):
        sizes = self.sizes
        if sum(size == -1 for size in sizes) > 1 or any(size == 0 or size < -1 for size in sizes):
            raise ValueError(f"mesh sizes {AXES_NAMED}={sizes}: each must be positive, and at most one -1")
        self.logical_rules  # validates the table

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes in MESH_AXES order."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def logical_rules(self) -> dict[str, tuple[str, ...]]:
        rules = {}
        for entry in filter(None, (item.strip() for item in self.rules.split(","))):
            name, sep, axes = (part.strip() for part in entry.partition("="))
            if not sep or not name:
                raise ValueError(f"mesh.rules entry {entry!r} is not `logical=mesh_axis[+mesh_axis]`")
            mesh_axes = () if axes in ("", "none") else tuple(a.strip() for a in axes.split("+"))
            unknown = [axis for axis in mesh_axes if axis not in MESH_AXES]
            if unknown:
                raise ValueError(f"mesh.rules entry {entry!r} names mesh axes {unknown}; known: {MESH_AXES}")
            rules[name] = mesh_axes
        if rules.get(LAYER_AXIS):
            raise ValueError(f"mesh.rules maps {LAYER_AXIS!r} (the scanned layer axis) to {rules[LAYER_AXIS]}: it must "
                             f"stay whole ({LAYER_AXIS}=none, or leave it out)")
        return rules


def mesh_shape(sizes: tuple[int, ...], num_devices: int) -> tuple[int, ...]:
    """Resolve the -1 entry so that the product is num_devices; a clear error when it cannot be."""
    known = int(np.prod([size for size in sizes if size != -1]))
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"mesh {AXES_NAMED}={sizes}: {num_devices} devices are not divisible by {known}")
        sizes = tuple(num_devices // known if size == -1 else size for size in sizes)
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(f"mesh {AXES_NAMED}={sizes} needs {int(np.prod(sizes))} devices; "
                         f"there are {num_devices} (set one axis to -1 to take the rest)")
    return sizes


def make_mesh(config: MeshConfig, devices: list | None = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(config.sizes, len(devices))
    # mesh_utils lays the axes out along the physical topology (ICI on TPU, NVLink within a node; `data`
    # outermost so that its gradient all-reduce is the one that crosses hosts).
    from jax.experimental import mesh_utils
    try:
        array = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
        array = np.asarray(devices).reshape(shape)
    return Mesh(array, MESH_AXES)


def logical_to_mesh(spec: tuple, rules: dict[str, tuple[str, ...]]) -> PartitionSpec:
    """PartitionSpec of mesh axes for a tuple of logical names; a mesh axis is used at most once per array."""
    used, out = set(), []
    for name in spec:
        axes = tuple(axis for axis in rules.get(name, ()) if axis not in used) if name is not None else ()
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def fit_to_shape(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes a dimension cannot be split by (e.g. a 1000-word vocab over tensor=8): replicate it."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
        out.append(axes if dim % size == 0 else None)
    return PartitionSpec(*out)


def logical_param_specs(abstract_model: nnx.Module) -> dict:
    """Pure dict (like TrainState.params) of each parameter's logical axis names."""
    specs = nnx.get_partition_spec(nnx.state(abstract_model, nnx.Param))
    return nnx.to_pure_dict(specs)


def param_shardings(abstract_model: nnx.Module, abstract_params: dict, mesh: Mesh, config: MeshConfig) -> dict:
    rules = config.logical_rules
    specs = logical_param_specs(abstract_model)
    return jax.tree.map(lambda spec, param: NamedSharding(mesh, fit_to_shape(logical_to_mesh(tuple(spec), rules),
                                                                             param.shape, mesh)),
                        specs, abstract_params, is_leaf=lambda x: isinstance(x, PartitionSpec))


def train_state_shardings(abstract_state, abstract_model: nnx.Module, optimizer, mesh: Mesh,
                          config: MeshConfig):
    """Shardings of a TrainState: parameters by their logical names, each optimizer moment like its parameter
    (optax.tree_map_params finds them), everything else (step, counts, rng) replicated."""
    import optax

    replicated = NamedSharding(mesh, PartitionSpec())
    params = param_shardings(abstract_model, abstract_state.params, mesh, config)
    opt_state = optax.tree_map_params(optimizer, lambda _, sharding: sharding, abstract_state.opt_state, params,
                                      transform_non_params=lambda _: replicated)
    return abstract_state.replace(step=replicated, params=params, opt_state=opt_state, rng=replicated)


def batch_sharding(mesh: Mesh, config: MeshConfig) -> NamedSharding:
    """[batch, length] arrays: rows split over the `batch` rule's mesh axes (data, fsdp, expert), lengths whole."""
    return NamedSharding(mesh, PartitionSpec(config.logical_rules.get("batch", BATCH_AXES) or None))


def batch_axis_size(mesh_shape, config: MeshConfig) -> int:
    """How many ways the `batch` rule's mesh axes split the rows of a batch (mesh_shape: axis -> size)."""
    return int(np.prod([mesh_shape[a] for a in config.logical_rules.get("batch", BATCH_AXES)]))


def check_batch_divisible(rows: int, mesh: Mesh, config: MeshConfig, what: str) -> None:
    ways = batch_axis_size(mesh.shape, config)
    if rows % ways:
        axes = config.logical_rules.get("batch", BATCH_AXES)
        raise ValueError(f"{what}: {rows} rows per batch cannot be split {ways} ways over mesh axes {axes} "
                         f"(mesh {dict(mesh.shape)}); change the batch or the mesh")


def place_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """A global host batch -> global device arrays, each process copying only the rows its devices hold.

    For batches every process holds whole (evaluation, benchmarks). Training batches come from the
    per-process pipeline and are placed by place_local_batch.
    """
    return {key: jax.make_array_from_callback(value.shape, sharding, lambda index, value=value: value[index])
            for key, value in batch.items()}


def place_local_batch(local_batch: dict[str, np.ndarray], sharding: NamedSharding | None = None
                      ) -> dict[str, jax.Array]:
    """This process's rows (the data pipeline gives each process its block of the global batch) -> global
    arrays whose batch axis spans every process's rows.

    The default sharding splits the batch axis over all devices (pure data parallelism); a mesh with other
    axes passes its own batch sharding."""
    if sharding is None:
        sharding = NamedSharding(Mesh(np.asarray(jax.devices()), ("data",)), PartitionSpec("data"))
    return {key: jax.make_array_from_process_local_data(sharding, value) for key, value in local_batch.items()}


def with_shardings(abstract_tree: PyTree, shardings: PyTree) -> PyTree:
    """ShapeDtypeStructs that also carry a sharding (what Orbax restores into, and jit.lower reads)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_tree, shardings)


# ----------------------------------------------------------------------------------------------------
# Multi-host


def define_distributed_flags() -> None:
    """train.py's, eval.py's and translate's multi-host flags: all three, or none to detect SLURM / a TPU pod slice / Open MPI
    from the environment. The tool adopts them (flags.adopt_module_key_flags(sharding)) for its --help."""
    from absl import flags
    flags.DEFINE_string("coordinator_address", "", "host:port of process 0 for jax.distributed.initialize.")
    flags.DEFINE_integer("num_processes", 0, "Number of processes (hosts) in the job.")
    flags.DEFINE_integer("process_id", -1, "This process's index in [0, num_processes).")


def initialize_distributed(coordinator_address: str = "", num_processes: int = 0, process_id: int = -1) -> bool:
    """jax.distributed.initialize from explicit flags, or from the cluster's environment (SLURM with more than
    one task, a multi-host TPU slice, Open MPI ...), before any other JAX call. Returns whether it did.

    On CPU the processes exchange collectives over gloo (JAX's CPU default has none across processes).
    """
    explicit = bool(coordinator_address) or num_processes > 1
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ
    tpu_pod = "TPU_WORKER_HOSTNAMES" in os.environ and "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    mpi = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    if not (explicit or slurm or tpu_pod or mpi):
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        if not coordinator_address or num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"--coordinator_address={coordinator_address!r} --num_processes={num_processes} "
                             f"--process_id={process_id}: give all three (0 <= process_id < num_processes), "
                             "or none to detect the cluster from the environment")
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    else:
        jax.distributed.initialize()  # auto-detects SLURM, TPU pods, Open MPI, GKE
    return True
