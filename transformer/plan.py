"""What a run is built from, before any array exists: the batch shape it trains on (`plan_batch`), the model's
graph, the optimizer, the state's and the batch's shardings (`Plan`), the train state itself, born sharded
(`create_train_state`), and the jitted train and eval steps (`make_steps`). train.py and `scripts/benchmark.py
--compile_only` both build the plan, so the compile-ahead check compiles exactly what a run would."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer import data, risk, sharding
from transformer.model import ModelConfig, build
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.settings import Settings, TrainConfig
from transformer.steps import TrainState, eval_step, train_step
from transformer.tokenizer import Tokenizer
from transformer import workdir as workdirs
from transformer.workdir import RUN_FILE


# Tracing a model's construction takes ~1.5 s at the paper's sizes, and start-up needs its graph, its shardings
# and the state's shapes: each is traced once per model config (and optimizer) and reused.
@functools.lru_cache(maxsize=16)
def abstract_model(model_config: ModelConfig) -> nnx.Module:
    """The model with ShapeDtypeStructs for arrays (read-only: its graph and logical axes)."""
    return nnx.eval_shape(lambda: build(model_config, rngs=nnx.Rngs(0)))


def model_graphdef(model_config: ModelConfig) -> nnx.GraphDef:
    return nnx.split(abstract_model(model_config))[0]


def init_params(model_config: ModelConfig, key: jax.Array) -> dict:
    return nnx.to_pure_dict(nnx.state(build(model_config, rngs=nnx.Rngs(params=key)), nnx.Param))


def create_train_state(model_config: ModelConfig, optimizer, seed: int, shardings: Any = None) -> TrainState:
    """The initial state, born sharded when `shardings` (state_shardings) is given: no device ever holds more
    than its shard."""
    def init(key):
        params_key, dropout_key = jax.random.split(key)
        params = init_params(model_config, params_key)
        return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params), rng=dropout_key)
    return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(seed))


@functools.lru_cache(maxsize=16)
def _abstract_state(model_config: ModelConfig, optimizer) -> TrainState:
    return jax.eval_shape(lambda: create_train_state(model_config, optimizer, 0))  # shapes do not depend on the seed


def abstract_train_state(model_config: ModelConfig, optimizer, seed: int, shardings: Any = None) -> TrainState:
    abstract = _abstract_state(model_config, optimizer)
    return abstract if shardings is None else sharding.with_shardings(abstract, shardings)


def state_shardings(model_config: ModelConfig, optimizer, mesh, mesh_config: sharding.MeshConfig) -> TrainState:
    return sharding.train_state_shardings(abstract_train_state(model_config, optimizer, 0),
                                          abstract_model(model_config), optimizer, mesh, mesh_config)


def count_params(params: dict) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """A training batch: `rows` packed rows of `row_length` tokens per side, over all processes."""

    rows: int
    row_length: int

    @property
    def tokens(self) -> int:
        return self.rows * self.row_length


def recorded_batch(workdir: str) -> BatchShape:
    """The batch shape the run in `workdir` trains on, which its first start recorded in run.json."""
    batch = workdirs.read_run_file(workdir).get("batch")
    if not batch:
        raise FileNotFoundError(f"{os.path.join(workdir, RUN_FILE)} records no batch shape: --workdir must be a "
                                "directory written by train.py")
    return BatchShape(int(batch["rows"]), int(batch["row_length"]))


def plan_batch(data_config: data.DataConfig, ways: int, recorded: BatchShape | None = None
               ) -> tuple[BatchShape, str | None]:
    """The batch a run trains on, and the one log line that says so when it is not the config's own.

    The rows must split into whole rows over `ways` (batch-axis devices x microbatches, and processes). The
    config's tokens_per_batch // max_length rows are kept when they split; else the nearest multiple of
    `ways` (ties: the larger, so no step has fewer tokens than asked), keeping the row length, which is the
    longest pair a run trains on. A resumed run keeps the batch it `recorded`, so its data stream is the same
    on any device count that splits it."""
    if recorded is not None:
        if recorded.rows % ways:
            raise ValueError(f"this run trains on batches of {recorded.rows} rows of {recorded.row_length} "
                             f"(recorded in {RUN_FILE}), which cannot be split {ways} ways on this mesh; resume on a "
                             f"device count whose batch axes (x microbatches) divide {recorded.rows}, or use a new "
                             "--workdir")
        return recorded, None
    asked = BatchShape(data_config.rows_per_batch, data_config.max_length)
    if asked.rows % ways == 0:
        return asked, None
    below = asked.rows // ways * ways
    rows = below if below and asked.rows - below < below + ways - asked.rows else below + ways
    shape = BatchShape(rows, asked.row_length)
    return shape, (f"batch: data.tokens_per_batch={data_config.tokens_per_batch} is {asked.rows} rows of "
                   f"{asked.row_length}, which do not split {ways} ways (batch-axis devices x microbatches, "
                   f"processes); training on {rows} rows = {shape.tokens:,} tokens per side per step "
                   f"({100 * (shape.tokens / asked.tokens - 1):+.1f}%)")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the train and eval steps are built from, before any array exists."""

    mesh: Any
    batch: BatchShape
    model_config: ModelConfig
    optimizer: Any
    schedule: Any
    graphdef: nnx.GraphDef
    state_shardings: TrainState
    batch_sharding: Any

    def abstract_state(self, seed: int) -> TrainState:
        return abstract_train_state(self.model_config, self.optimizer, seed, self.state_shardings)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        shapes = data.batch_shapes(self.batch.rows, self.batch.row_length)
        return {key: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.batch_sharding)
                for key, x in shapes.items()}


def rows_multiple(settings: Settings, mesh_shape, processes: int | None = None) -> int:
    """What the rows of a training batch must be a multiple of: each microbatch over the batch axes of `mesh_shape`
    (a Mesh's .shape, or any axis -> size mapping), and over the processes."""
    processes = jax.process_count() if processes is None else processes
    return math.lcm(sharding.batch_axis_size(mesh_shape, settings.mesh) * settings.train.num_microbatches, processes)


def startup_plan(settings: Settings, recorded: BatchShape | None = None) -> tuple[Plan, str | None]:
    """The plan train.py builds for `settings` on this machine's devices, with the vocabulary size it would have
    (data.vocab_path's, else data.vocab_size), before any data is read; and the batch note, if any."""
    mesh = sharding.make_mesh(settings.mesh)
    batch, note = plan_batch(settings.data, rows_multiple(settings, mesh.shape), recorded)
    vocab_size = Tokenizer(settings.data.vocab_path).vocab_size if settings.data.vocab_path else settings.data.vocab_size
    return make_plan(settings, vocab_size, mesh, batch), note


@functools.lru_cache(maxsize=16)
def _optimizer(config: OptimizerConfig, emb_dim: int):
    """One optimizer object per config, so the traced state shapes cached by (model, optimizer) are reused."""
    return make_optimizer(config, emb_dim)


def make_plan(settings: Settings, vocab_size: int, mesh, batch: BatchShape) -> Plan:
    model_config = settings.model_config(vocab_size)
    optimizer, schedule = _optimizer(settings.optimizer, model_config.emb_dim)
    return Plan(mesh, batch, model_config, optimizer, schedule, model_graphdef(model_config),
                state_shardings(model_config, optimizer, mesh, settings.mesh),
                sharding.batch_sharding(mesh, settings.mesh))


def risk_objective(train_config: TrainConfig) -> risk.Objective | None:
    """train.objective="risk"'s settings for the train step; None for the likelihood alone."""
    if train_config.objective != "risk":
        return None
    return risk.Objective(weight=train_config.risk_weight, candidates=train_config.risk_candidates)


def make_steps(graphdef, optimizer, schedule, train_config: TrainConfig, state_shardings, batch_sharding):
    """The jitted train step (state donated, shardings declared in and out) and eval step."""
    step_kw = dict(graphdef=graphdef, label_smoothing=train_config.label_smoothing)
    train = jax.jit(functools.partial(train_step, optimizer=optimizer, schedule=schedule,
                                      num_microbatches=train_config.num_microbatches,
                                      rng_impl=train_config.dropout_rng,
                                      skip_nonfinite=train_config.nonfinite == "skip",
                                      objective=risk_objective(train_config), **step_kw),
                    in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, None),
                    donate_argnums=0)
    evaluate = jax.jit(functools.partial(eval_step, **step_kw), in_shardings=(state_shardings.params, batch_sharding))
    return train, evaluate
