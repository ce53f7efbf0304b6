"""The training run behind train.py and the restore behind eval.py: build, compile once, loop, evaluate,
checkpoint, resume. A config arrives as plain nested values (config_files.plain) and is read into frozen dataclasses here.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer import checkpoint, config_files, data, decode, errors, files, loop, metrics, sharding, throughput
from transformer import workdir as workdirs
from transformer.metrics import log
from transformer.checkpoint import Checkpointer, abstract_like
from transformer.model import ROUTER_STATS, ModelConfig, build
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.steps import DROPOUT_RNGS, TrainState, eval_step, summarize, train_step
from transformer.tokenizer import Tokenizer

CONFIG_FILE = "config.json"
BEST_CHECKPOINT_DIR = "best_checkpoint"
PARAMS_DIR = "params"  # params snapshots of the last decode.average_last checkpoints, for averaging
RUN_FILE = "run.json"  # the batch shape a run trains on, and each start's provenance
REPORTS_FILE = "reports.json"  # the train.report_minutes scores, by mark, written at each mark
SAMPLE_TRANSLATIONS = 4  # (source, reference, translation) triples written as text at each BLEU evaluation


@config_files.section("train")
class TrainConfig:
    num_train_steps: int
    label_smoothing: float
    log_every_steps: int
    eval_every_steps: int
    bleu_every_steps: int
    checkpoint_every_steps: int
    keep_checkpoints: int
    async_checkpointing: bool
    num_microbatches: int
    dropout_rng: str
    keep_best_checkpoint: bool
    max_train_minutes: float
    report_minutes: str
    checkpoint_every_minutes: float
    compilation_cache_dir: str
    nonfinite: str
    debug_nans: bool
    wandb_project: str
    profile_steps: str

    def __post_init__(self):
        if self.num_microbatches < 1:
            raise ValueError(f"train.num_microbatches={self.num_microbatches} must be >= 1")
        if self.nonfinite not in loop.NONFINITE_POLICIES:
            raise ValueError(f"train.nonfinite={self.nonfinite!r} is not one of {loop.NONFINITE_POLICIES}")
        if self.dropout_rng not in DROPOUT_RNGS:
            raise ValueError(f"train.dropout_rng={self.dropout_rng!r} is not one of {DROPOUT_RNGS}")
        if self.num_train_steps < 0:
            raise ValueError(f"train.num_train_steps={self.num_train_steps} must be >= 0")
        for name in ("log_every_steps", "checkpoint_every_steps", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be positive")
        if self.max_train_minutes < 0 or self.checkpoint_every_minutes < 0:
            raise ValueError(f"train.max_train_minutes={self.max_train_minutes} and train.checkpoint_every_minutes="
                             f"{self.checkpoint_every_minutes} must be >= 0")
        self.report_marks  # validates the list now
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"train.label_smoothing={self.label_smoothing} must be in [0, 1)")
        self.profile_range  # validates it now

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """train.profile_steps as (first, last) step, or None."""
        if not self.profile_steps:
            return None
        first, dash, last = self.profile_steps.partition("-")
        if not (dash and first.strip().isdigit() and last.strip().isdigit() and 0 < int(first) <= int(last)):
            raise ValueError(f"train.profile_steps={self.profile_steps!r} must be 'N-M' with 0 < N <= M, e.g. '100-110'")
        return int(first), int(last)

    @property
    def report_marks(self) -> list[float]:
        """train.report_minutes as sorted minutes, each inside the budget (the end of the run reports anyway)."""
        try:
            marks = sorted(float(m) for m in self.report_minutes.split(",") if m.strip())
        except ValueError as error:
            raise ValueError(f"train.report_minutes={self.report_minutes!r} must be comma-separated minutes, "
                             f"e.g. '20' or '20,40'") from error
        for mark in marks:
            if mark <= 0 or (self.max_train_minutes and mark >= self.max_train_minutes):
                raise ValueError(f"train.report_minutes has {mark:g}: each mark must be > 0 and below "
                                 f"train.max_train_minutes={self.max_train_minutes:g} (the end reports anyway)")
        return marks


# The config's sections and the dataclass each is read into (Settings.from_config).
SECTIONS = {"data": data.DataConfig, "model": ModelConfig, "optimizer": OptimizerConfig, "train": TrainConfig,
            "decode": decode.DecodeConfig, "mesh": sharding.MeshConfig}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The whole resolved configuration, typed. vocab_size is not here: it comes from the tokenizer."""

    seed: int
    data: data.DataConfig
    model: dict[str, Any]
    optimizer: OptimizerConfig
    train: TrainConfig
    decode: decode.DecodeConfig
    mesh: sharding.MeshConfig = sharding.MeshConfig()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "Settings":
        config = config_files.plain(config)

        def build(kind, section, **extra):
            values = config.get(section, {})
            known = [f.name for f in dataclasses.fields(kind) if f.name not in extra]
            unknown = sorted(set(values) - set(known))
            if unknown:  # name it, with the nearest known keys, rather than drop it
                raise errors.ConfigError("; ".join(f"unknown config key config.{section}.{key}" + errors.did_you_mean(
                    key, known, f"config.{section}.") for key in unknown))
            with errors.as_config_error():
                return kind(**values, **extra)

        model = config.get("model", {})
        shapes = build(ModelConfig, "model", vocab_size=1, seed=0)  # validates shapes before any data work
        unknown = sorted(set(config.keys()) - {"seed", *SECTIONS})
        if unknown:
            raise errors.ConfigError("; ".join(f"unknown top-level config key config.{key}" + errors.did_you_mean(
                key, ["seed", *SECTIONS], "config.") for key in unknown))
        settings = cls(seed=int(config.get("seed", 0)), data=build(data.DataConfig, "data"), model=model,
                       optimizer=build(OptimizerConfig, "optimizer"), train=build(TrainConfig, "train"),
                       decode=build(decode.DecodeConfig, "decode"), mesh=build(sharding.MeshConfig, "mesh"))
        settings.decode.splits  # validates the split names now, before training
        if settings.seed < 0:
            raise ValueError(f"config.seed={settings.seed} must be >= 0")
        if shapes.row_mixing and settings.data.pack:
            field, value, why = shapes.row_mixing[0]
            raise ValueError(f"model.{field}={value!r} mixes the positions of a row ({why}), so it takes one "
                             "sentence per row: set data.pack=false")
        if shapes.position_limit is not None and shapes.position_limit < settings.data.max_length:
            table = "the learned position table" if shapes.positional_encoding == "learned" else "linformer's projection"
            joined = ", which numbers a target on from its source (half each)" if shapes.joins_pair else ""
            raise ValueError(f"model.max_length={shapes.max_length} ({table}{joined}) is shorter than "
                             f"data.max_length={settings.data.max_length}" + (" per side" if joined else ""))
        if shapes.family == "encoder_only":  # a masked language model is scored by its masked tokens, not BLEU
            for key, value in (("bleu_every_steps", settings.train.bleu_every_steps),
                               ("keep_best_checkpoint", settings.train.keep_best_checkpoint)):
                if value:
                    raise ValueError(f"train.{key}={value} needs BLEU, and model.family='encoder_only' has no "
                                     "decoder to translate with: unset it (the run reports masked accuracy and "
                                     "perplexity)")
        return settings

    def model_config(self, vocab_size: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, seed=self.seed, **self.model)


# ----------------------------------------------------------------------------------------------------
# Model and state


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


# ----------------------------------------------------------------------------------------------------
# The start-up plan: batch shape, model, shardings. train.py and `scripts/benchmark.py --compile_only` both build
# it, so the compile-ahead check compiles exactly what a run would.


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """A training batch: `rows` packed rows of `row_length` tokens per side, over all processes."""

    rows: int
    row_length: int

    @property
    def tokens(self) -> int:
        return self.rows * self.row_length


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


def batch_ways(settings: Settings, mesh_shape, processes: int | None = None) -> int:
    """What the rows of a batch must split by: each microbatch over the batch axes of `mesh_shape` (a Mesh's
    .shape, or any axis -> size mapping), and over the processes."""
    processes = jax.process_count() if processes is None else processes
    return math.lcm(sharding.batch_axis_size(mesh_shape, settings.mesh) * settings.train.num_microbatches, processes)


def startup_plan(settings: Settings, recorded: BatchShape | None = None) -> tuple[Plan, str | None]:
    """The plan train.py builds for `settings` on this machine's devices, with the vocabulary size it would have
    (data.vocab_path's, else data.vocab_size), before any data is read; and the batch note, if any."""
    mesh = sharding.make_mesh(settings.mesh)
    batch, note = plan_batch(settings.data, batch_ways(settings, mesh.shape), recorded)
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


# ----------------------------------------------------------------------------------------------------
# Data


def tokenized_split(tokenizer: Tokenizer, pairs: list[tuple[str, str]], max_length: int
                    ) -> tuple[data.TokenCache, np.ndarray]:
    """A split's pairs tokenized, and the indices of those within max_length (the pairs an eval loss reads)."""
    cache = data.TokenCache.tokenize(tokenizer, pairs)
    return cache, data.LengthFilter.of(cache, max_length).kept


def eval_loss(evaluate, params, cache: data.TokenCache, kept: np.ndarray, data_config: data.DataConfig, rows: int,
              batch_sharding) -> dict[str, float]:
    """The eval step over the pairs `kept` of a cache, packed as training packs them, summed and summarized:
    loss, accuracy, perplexity, target tokens (and a mixture of experts' router stats)."""
    batches = data.eval_batches(cache, kept, max_length=data_config.max_length, rows_per_batch=rows,
                                pack=data_config.pack)
    summary = summarize(jax.device_get([evaluate(params, sharding.place_batch(batch, batch_sharding))
                                        for batch in batches]))
    keys = ("loss", "accuracy", "perplexity", "target_tokens") + tuple(k for k in ROUTER_STATS if k in summary)
    return {key: summary[key] for key in keys}


@dataclasses.dataclass
class Corpus:
    tokenizer: Tokenizer
    pairs: dict[str, list[tuple[str, str]]]  # split -> raw (source, target) sentences, read on first use
    valid: data.TokenCache  # the dev set, tokenized, for the eval loss
    valid_kept: np.ndarray  # indices into valid of the pairs within max_length
    train_cache: data.TokenCache  # the tokenized train split
    train_kept: np.ndarray  # indices into train_cache of the pairs within max_length
    train_source: Any = None  # the train split's fingerprint (what its token cache was built from)


def load_corpus(settings: Settings, workdir: str, splits: list[str]) -> Corpus:
    """Read the evaluation splits and fingerprint the train split (input errors surface here, before
    training), then the tokenizer and the train split's token cache. The train split itself is read (once,
    streamed) only when its vocabulary or its cache must be built: a restart does not read it."""
    pairs = data.SplitPairs(settings.data)  # the train split's text is read only if decoded (bleu_splits)
    for split in splits:
        if split != "train" and not pairs[split]:
            raise data.DataError(f"the {split} split has no sentence pairs")
    with data.split_source(settings.data, "train") as train:  # removes the train split's spill, if one was made
        if jax.process_count() > 1 and not settings.data.vocab_path:
            # One process trains the vocabulary into the (shared) workdir; the others read it afterwards.
            from jax.experimental import multihost_utils
            if jax.process_index() == 0:
                data.load_or_train_tokenizer(settings.data, train, workdir)
            multihost_utils.sync_global_devices("vocabulary written")
        tokenizer = data.load_or_train_tokenizer(settings.data, train, workdir)
        recorded = read_run_file(workdir)
        workdirs.check_vocabulary(recorded.get("vocabulary"), tokenizer.path)  # before any token is cached with it
        source = data.as_split_source(train, "train").fingerprint
        if recorded.get("train_data") not in (None, source):
            # A warning, not a refusal: text files are known by path, size and mtime, which a copy or a touch changes.
            log.warning("the train split's fingerprint %s differs from the one this run started with, %s (in %s): "
                        "its token cache is built again, and the batches from here on may differ", source,
                        recorded["train_data"], os.path.join(workdir, RUN_FILE))
        cache = data.load_or_build_token_cache(train, tokenizer, workdir, "train", num_workers=settings.data.num_workers,
                                               local_root=settings.data.local_cache_dir)
    length_filter = data.LengthFilter.of(cache, settings.data.max_length)
    log.info("train: %d pairs, %d dropped for length > %d tokens", len(length_filter.kept), length_filter.too_long,
             settings.data.max_length)
    if not len(length_filter.kept):
        raise data.DataError(f"every train pair is longer than data.max_length={settings.data.max_length} tokens")
    valid = data.TokenCache.tokenize(tokenizer, pairs["valid"])
    valid_filter = data.LengthFilter.of(valid, settings.data.max_length)
    decoded = "" if settings.model.get("family") == "encoder_only" else " (BLEU decodes them all)"
    log.info("valid loss: %d pairs, %d longer than %d tokens left out%s", len(valid_filter.kept),
             valid_filter.too_long, settings.data.max_length, decoded)
    if not len(valid_filter.kept):
        raise data.DataError(f"every valid pair is longer than data.max_length={settings.data.max_length} tokens")
    return Corpus(tokenizer, pairs, valid, valid_filter.kept, cache, length_filter.kept, source)


def place_batch(local_batch: dict[str, np.ndarray], batch_sharding) -> dict[str, jax.Array]:
    """The one place training batches meet the devices: this process's rows -> global arrays split over the
    mesh's batch axes."""
    return sharding.place_local_batch(local_batch, batch_sharding)


def batches_with_states(iterator) -> Iterator[tuple[dict, bytes]]:
    """(batch, the iterator's state right after it): the state a checkpoint of that batch's step saves."""
    while True:
        batch = next(iterator)
        yield batch, data.iterator_state_json(iterator)


def prefetch_to_device(batches: Iterator[tuple[dict, Any]], batch_sharding, size: int = 2
                       ) -> Iterator[tuple[dict, Any]]:
    """Keep `size` batches in flight to the devices while the current step runs; passes each one's state on."""
    queue: deque = deque()
    for batch, state in batches:
        queue.append((place_batch(batch, batch_sharding), state))
        if len(queue) >= size:
            yield queue.popleft()
    yield from queue


def make_steps(graphdef, optimizer, schedule, train_config: TrainConfig, state_shardings, batch_sharding):
    """The jitted train step (state donated, shardings declared in and out) and eval step."""
    step_kw = dict(graphdef=graphdef, label_smoothing=train_config.label_smoothing)
    train = jax.jit(functools.partial(train_step, optimizer=optimizer, schedule=schedule,
                                      num_microbatches=train_config.num_microbatches,
                                      rng_impl=train_config.dropout_rng,
                                      skip_nonfinite=train_config.nonfinite == "skip", **step_kw),
                    in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, None),
                    donate_argnums=0)
    evaluate = jax.jit(functools.partial(eval_step, **step_kw), in_shardings=(state_shardings.params, batch_sharding))
    return train, evaluate


def router_line(summary: dict[str, float]) -> str:
    """A mixture of experts' part of a log line: its router losses, the share of assignments dropped for capacity
    and the busiest expert's load (1: balanced); empty without one."""
    if "router_balance" not in summary:
        return ""
    return (f"; experts: dropped {summary['expert_dropped']:.3f} load_max {summary['expert_load_max']:.2f} "
            f"balance {summary['router_balance']:.3f} z {summary['router_z']:.3f}")


def throughput_metrics(summary: dict[str, float], model_config: ModelConfig, seconds: float, steps: int,
                       peak_flops: float | None) -> dict[str, float]:
    """Tokens/s (real, non-padding tokens) and MFU over a logging window: analytic model FLOPs of the batches'
    real tokens and attention pairs (throughput.model_flops) / seconds / the devices' peak."""
    flops = throughput.model_flops(model_config, source_tokens=summary["source_tokens"],
                                   target_tokens=summary["target_tokens"], encoder_pairs=summary["encoder_pairs"],
                                   decoder_pairs=summary["decoder_pairs"], cross_pairs=summary["cross_pairs"])
    out = {"tokens_per_second": summary["target_tokens"] / seconds,
           "all_tokens_per_second": (summary["target_tokens"] + summary["source_tokens"]) / seconds,
           "steps_per_second": steps / seconds, "model_flops_per_second": flops / seconds}
    if peak_flops:
        out["mfu"] = flops / seconds / (peak_flops * jax.device_count())
    return out


# ----------------------------------------------------------------------------------------------------
# The run


class Run:
    """One training run in one workdir: everything is validated and built in __init__, before any write
    that could replace an existing file; `train()` then runs the loop."""

    def __init__(self, config: Mapping[str, Any], workdir: str):
        self.config, self.workdir = config_files.plain(config), workdir
        self.is_writer = jax.process_index() == 0
        if not self.is_writer:  # one console: process 0's, from the first line on
            log.setLevel("WARNING")
        self.settings = Settings.from_config(config)
        if files.exists(workdir) and not files.is_dir(workdir):
            raise NotADirectoryError(f"--workdir={workdir} exists and is not a directory")
        self.checkpointer = self.snapshots = self.best_checkpointer = None
        self.checkpoints_closed = False
        self.warned_cut: set[str] = set()  # the splits whose cut sources have been named in the log
        self.eval_caches: dict[str, tuple] = {}  # split -> its token cache and kept pairs (evaluate_loss)
        self.evaluate = None  # the compiled eval step, once train() has compiled it
        self.lock = acquire_workdir(workdir)  # before anything reads or writes the workdir
        try:
            self._start(self.config, workdir)
        except BaseException:
            self.close()  # a refused start leaves the workdir as it found it, and free
            raise

    def _start(self, config: dict[str, Any], workdir: str) -> None:
        settings = self.settings
        splits = ["train", "valid"] + [s for s in settings.decode.splits if s != "valid"]
        checkpoint_dir = os.path.join(workdir, "checkpoints")
        resuming = any(name.isdigit() for name in files.list_dir(checkpoint_dir))
        if resuming:
            for change in check_resume_config(load_workdir_config(workdir), config):
                log.info("resuming with a changed setting: %s", change)
        # The mesh and the batch are settled before any data work, so a batch that cannot split fails at once.
        self.mesh = sharding.make_mesh(settings.mesh)
        self.batch, note = plan_batch(settings.data, batch_ways(settings, self.mesh.shape),
                                      recorded_batch(workdir) if resuming else None)
        if note:
            log.warning("%s", note)
        files.make_dirs(workdir)
        if settings.train.debug_nans:
            jax.config.update("jax_debug_nans", True)
        use_compilation_cache(settings.train.compilation_cache_dir, workdir)
        self.corpus = load_corpus(settings, workdir, splits)
        plan = make_plan(settings, self.corpus.tokenizer.vocab_size, self.mesh, self.batch)
        self.model_config, self.optimizer, self.schedule = plan.model_config, plan.optimizer, plan.schedule
        self.graphdef, self.state_shardings, self.batch_sharding = (plan.graphdef, plan.state_shardings,
                                                                    plan.batch_sharding)
        self.plan = plan
        self.checkpointer = Checkpointer(checkpoint_dir, save_every_steps=settings.train.checkpoint_every_steps,
                                         keep=settings.train.keep_checkpoints,
                                         use_async=settings.train.async_checkpointing)
        # Averaging reads parameters only, so the last average_last checkpoints keep a params snapshot each
        # rather than needing that many full train states on disk.
        if settings.decode.average_last > 1:
            self.snapshots = Checkpointer(os.path.join(workdir, PARAMS_DIR), save_every_steps=1,
                                          keep=settings.decode.average_last,
                                          use_async=settings.train.async_checkpointing)
        self.data_state: bytes | None = None  # the data iterator's state in the restored checkpoint
        self.state = self._restore_or_init()
        if settings.train.keep_best_checkpoint:
            self.best_checkpointer = Checkpointer(os.path.join(workdir, BEST_CHECKPOINT_DIR), save_every_steps=1,
                                                  keep=1, use_async=settings.train.async_checkpointing,
                                                  best_metric="valid_bleu")
        if self.is_writer:
            files.write_text(os.path.join(workdir, CONFIG_FILE), saved_config(config, self.corpus.tokenizer))
            record_start(workdir, self.batch, self.mesh, settings, self.corpus)

    def close(self) -> None:
        """Commit every pending save, close the checkpoint managers and free the workdir (idempotent)."""
        try:
            self.close_checkpointers()
        finally:
            if self.lock is not None:
                release_workdir(self.workdir, self.lock)
                self.lock = None

    def _restore_or_init(self) -> TrainState:
        if self.checkpointer.latest_step() is None:
            return create_train_state(self.model_config, self.optimizer, self.settings.seed, self.state_shardings)
        # Restored straight into this run's shardings, whatever mesh wrote the checkpoint: the newest readable one
        # (unreadable newer ones are named and moved aside); raises, touching nothing, on a shape mismatch.
        abstract = abstract_train_state(self.model_config, self.optimizer, self.settings.seed, self.state_shardings)
        step, state, self.data_state = self.checkpointer.restore_latest(abstract)
        log.info("resumed from %s at step %d", self.checkpointer.directory, step)
        return state

    def compile(self) -> tuple[Any, Any, float]:
        """The jitted train and eval steps, compiled once on the real shapes; returns the compile seconds."""
        batch = self.plan.abstract_batch()
        train, evaluate = make_steps(self.graphdef, self.optimizer, self.schedule, self.settings.train,
                                     self.state_shardings, self.batch_sharding)
        start = time.perf_counter()
        train = train.lower(abstract_like(self.state), batch).compile()
        evaluate = evaluate.lower(abstract_like(self.state.params), batch).compile()
        return train, evaluate, time.perf_counter() - start

    def search_fn(self):
        return self.settings.decode.search_fn(self.graphdef, self.settings.seed)

    def evaluate_loss(self, evaluate, split: str = "valid", params=None) -> dict[str, float]:
        """The eval step's loss, accuracy and perplexity over a split's pairs within data.max_length (an
        encoder_only model's: of its masked tokens, the same ones at every evaluation: steps.eval_mask_key)."""
        if split == "valid":
            cache, kept = self.corpus.valid, self.corpus.valid_kept
        else:
            if split not in self.eval_caches:
                self.eval_caches[split] = tokenized_split(self.corpus.tokenizer, self.corpus.pairs[split],
                                                          self.settings.data.max_length)
            cache, kept = self.eval_caches[split]
        return eval_loss(evaluate, self.state.params if params is None else params, cache, kept,
                         self.settings.data, self.batch.rows, self.batch_sharding)

    def evaluate_bleu(self, search, splits: list[str], params=None, prefix: str = "") -> dict[str, dict[str, Any]]:
        scores, params = {}, self.state.params if params is None else params
        for split in splits:
            start = time.perf_counter()
            sources, references = zip(*self.corpus.pairs[split])
            settings = self.settings.decode
            bound = settings.input_bound(self.settings.data.max_length, self.model_config.position_limit)
            # A source past the bound is cut, so that evaluation always finishes; said once per split and run.
            decoded = decode.search_sentences(search, params, self.corpus.tokenizer, list(sources), settings.batch_size,
                                              bound, name=None if split in self.warned_cut else split,
                                              max_tokens_per_batch=settings.max_tokens_per_batch,
                                              batch_sharding=self.batch_sharding)  # every device decodes its rows
            self.warned_cut.add(split)
            hypotheses = decoded.translations(self.corpus.tokenizer)
            scores[split] = metrics.bleu(hypotheses, list(references), target_lang=self.settings.data.target_lang)
            scores[split]["inputs_cut"] = decoded.cut
            scores[split]["samples"] = list(zip(sources, references, hypotheses))[:SAMPLE_TRANSLATIONS]
            scores[split]["decode_seconds"] = time.perf_counter() - start
            if self.is_writer:
                step = int(self.state.step)
                path = os.path.join(self.workdir, f"translations_{split}_{prefix}step{step}.txt")
                files.write_text(path, "".join(h + "\n" for h in hypotheses))
        return scores

    def train(self) -> dict[str, Any]:
        """The loop: the next batch, the step, and at a sync step the periodic actions whose turn it is
        (transformer/loop.py); then the end's save, evaluation and scores. After a stop signal it returns
        {"preempted": step} instead, with that step's checkpoint committed."""
        train, evaluate, compile_seconds = self.compile_and_log()
        self.evaluate = evaluate
        start_step = int(self.state.step)
        iterator = self.train_iterator(start_step)
        batches = prefetch_to_device(batches_with_states(iterator), self.batch_sharding)
        self.open_loop(start_step)
        final_step, data_state, stop = self.cooldown.final_step(), self.data_state, None
        try:
            with loop.Preemption() as preemption:
                for step in range(start_step + 1, final_step + 1):
                    self.state = self.cooldown.by_steps(self.state, step)
                    waited = time.perf_counter()
                    batch, data_state = next(batches)
                    self.window.input_seconds += time.perf_counter() - waited
                    self.profile.before(step)
                    self.state, step_metrics = train(self.state, batch)
                    self.profile.after(step, self.state)
                    self.window.add(step_metrics)
                    preempted = preemption.reached(step)
                    if preempted or self.sync_due(step, final_step):
                        self.log_window(step)  # the fetch: raises on a non-finite step, before any save
                        stop = f"preempted by {preemption.received}" if preempted else self.stop_reason(step, final_step)
                        if stop or self.timed_checkpoint.due(self.clock.seconds, self.saved_at):
                            self.save_checkpoint(step, data_state, force=True)
                        if stop:
                            break
                        self.state = self.cooldown.by_time(self.state, step, self.clock.seconds, self.budget,
                                                           self.pace(step))
                        if self.marks.due(self.clock.seconds):
                            self.report_mark(step, data_state)
                    if step != final_step:  # the final step is evaluated after the loop
                        with self.clock.paused():  # evaluation does not count as training time
                            if self.eval_due(step):
                                self._report_loss(evaluate)
                            if self.bleu_due(step):
                                self._report_bleu(["valid"])
                    self.save_checkpoint(step, data_state)
        except BaseException:
            self.close()  # the saves already begun are committed; the workdir is free for the next start
            raise
        finally:
            self.profile.stop()
            if hasattr(iterator, "close"):
                iterator.close()  # stops grain's worker processes, on an error or a signal too
        if stop is None and preemption.received and not preemption.service:
            # A signal during the last step's fetch or save, after its check: still a stop, not the final evaluation.
            self.save_checkpoint(int(self.state.step), data_state, force=True)
            stop = f"preempted by {preemption.received}"
        if stop and stop.startswith("preempted"):
            return self.finish_preempted(preemption.received)
        return self.finish(evaluate, compile_seconds, data_state)

    def compile_and_log(self) -> tuple[Any, Any, float]:
        log.info("model: %s parameters; vocab %d; %d rows x %d tokens per batch", f"{count_params(self.state.params):,}",
                 self.model_config.vocab_size, self.batch.rows, self.batch.row_length)
        log.info("mesh %s over %d devices (%s) in %d processes", dict(self.mesh.shape), jax.device_count(),
                 jax.devices()[0].device_kind, jax.process_count())
        train, evaluate, compile_seconds = self.compile()
        log.info("compiled train and eval steps in %.1fs", compile_seconds)
        return train, evaluate, compile_seconds

    def open_loop(self, start_step: int) -> None:
        """The loop's periodic actions and their state, for a part of the run starting after `start_step`."""
        config = self.settings.train
        self.writer = metrics.MetricWriter(self.workdir, enabled=self.is_writer, resume_step=start_step,
                                           local_root=self.settings.data.local_cache_dir,
                                           wandb_project=config.wandb_project, hparams=flatten(self.config))
        self.profile = loop.Profile(config.profile_range, os.path.join(self.workdir, "profile"), start_step)
        self.progress = metrics.Progress(config.num_train_steps, start_step)
        self.search = self.search_fn()
        self.peak_flops = throughput.device_peak_flops(dtype=self.model_config.dtype)
        self.window = loop.MetricsWindow(start_step + 1, config.nonfinite)
        self.budget = loop.TimeBudget(config.max_train_minutes, config.log_every_steps)
        self.marks = loop.ReportMarks(config.report_marks, read_reports(self.workdir) if start_step else {})
        self.cooldown = loop.Cooldown(self.settings.optimizer.cooldown_fraction, config.num_train_steps,
                                      self.state.opt_state, self.progress)
        self.timed_checkpoint = loop.TimedCheckpoint(config.checkpoint_every_minutes)
        self.eval_due, self.bleu_due = loop.Every(config.eval_every_steps), loop.Every(config.bleu_every_steps)
        timed = self.budget.limited or bool(self.marks.marks) or config.checkpoint_every_minutes > 0
        # The trainer's own clock reading (time.perf_counter looked up at each call), which the tests replace.
        self.clock = loop.Clock(previous_train_seconds(self.workdir, start_step), timed, now=lambda: time.perf_counter())
        self.saved_at = self.clock.seconds  # the training seconds at the last save (checkpoint_every_minutes)
        self.part_start = (start_step, self.clock.seconds)  # this part's pace projects a timed decay's end
        self.last_step = start_step  # the last fetched step

    @property
    def train_seconds(self) -> float:
        return self.clock.seconds

    def sync_due(self, step: int, final_step: int) -> bool:
        config = self.settings.train
        # A dev BLEU step too: it may save the best checkpoint, which must not hold a non-finite update.
        return (step % config.log_every_steps == 0 or step % config.checkpoint_every_steps == 0 or step == final_step
                or self.cooldown.ends_at(step) or step == self.budget.check_step or self.bleu_due(step))

    def log_window(self, step: int) -> dict[str, float]:
        """Fetch the window's metrics, advance the clock and the budget's projection, write the log line."""
        config = self.settings.train
        summary = self.window.fetch(last_checkpoint=self.last_checkpoint())
        before, seconds = self.clock.seconds, self.clock.tick()
        steps, self.last_step = step - self.last_step, step
        self.budget.update(step, steps, before, self.clock.seconds)
        summary["train_seconds"] = self.clock.seconds  # training only: no compilation or evaluation
        # The share of the window spent getting the next batch: near 1, the run is input-bound.
        summary["input_wait_fraction"], self.window.input_seconds = self.window.input_seconds / max(seconds, 1e-9), 0.0
        summary.update(throughput_metrics(summary, self.model_config, seconds, steps, self.peak_flops))
        eta = min((config.num_train_steps - step) / summary["steps_per_second"], self.budget.left(self.clock.seconds))
        self.writer.write(step, summary, "train")
        self.progress.update(steps, summary)
        skipped = f", {summary['skipped_updates']} non-finite updates skipped" if summary["skipped_updates"] else ""
        self.progress.write(f"step {step}: loss {summary['loss']:.4f} acc {summary['accuracy']:.3f} "
                            f"lr {summary['learning_rate']:.2e} grad_norm {summary['grad_norm']:.3f} "
                            f"{summary['tokens_per_second']:.0f} target tokens/s "
                            f"({summary['all_tokens_per_second']:.0f} with source), "
                            f"MFU {summary.get('mfu', float('nan')):.3f}, ETA {eta:.0f}s{skipped}{router_line(summary)}")
        return summary

    def last_checkpoint(self) -> str:
        step = self.checkpointer.last_saved
        return "none" if step is None else f"step {step} in {self.checkpointer.directory}"

    def stop_reason(self, step: int, final_step: int) -> str | None:
        """Why the run stops at this fetch before its last step (said in the log), or None."""
        if self.budget.spent():
            reason = (f"the time budget of train.max_train_minutes={self.settings.train.max_train_minutes:g} is "
                      f"spent ({self.clock.seconds:.0f}s of training"
                      f"{'' if self.budget.steps_left <= 0 else ', less than a step of it left'})")
        elif self.cooldown.done(step, final_step):
            reason = (f"the cooldown (optimizer.cooldown_fraction={self.cooldown.fraction:g}) is done "
                      f"({self.clock.seconds:.0f}s of training)")
        else:
            return None
        self.progress.write(f"step {step}: {reason}")
        return reason

    def pace(self, step: int) -> float:
        """This part's steps per training second."""
        return (step - self.part_start[0]) / max(self.clock.seconds - self.part_start[1], 1e-9)

    def report_mark(self, step: int, data_state: bytes | None) -> None:
        """A train.report_minutes mark: save, then average, decode and score (not counted as training time)."""
        self.save_checkpoint(step, data_state, force=True)
        with self.clock.paused():
            self.progress.write(f"step {step}: train.report_minutes mark reached after {self.clock.seconds:.0f}s of "
                                "training")
            self.marks.record(self.clock.seconds, self._score_final_params())
            self._write_reports(self.marks.reports)

    def finish(self, evaluate, compile_seconds: float, data_state: bytes | None) -> dict[str, Any]:
        """The end of the run: the last save, the valid loss, the final (averaged) parameters scored, scores.json."""
        self.progress.close()
        step = int(self.state.step)
        result = {"step": step, "compile_seconds": compile_seconds, "train_seconds": self.clock.seconds}
        if step != self.checkpointer.last_saved:  # the same answer on every process
            self.save_checkpoint(step, data_state or self.data_state, force=True)
        result["valid"] = self._report_loss(evaluate)
        final = self._score_final_params()
        if final["averaged_steps"]:
            result["averaged_steps"] = final["averaged_steps"]
        scored = "masked" if "masked" in final else "bleu"
        result[scored] = final[scored]
        self.marks.record(self.clock.seconds, final)  # marks passed in the same fetch as the budget: the end's scores
        if self.marks.reports:
            result["reports"] = self.marks.reports
            self._write_reports(self.marks.reports)
        self.close_checkpointers()
        if scored == "bleu":
            self.writer.write_final({f"{split}_bleu": score["bleu"] for split, score in result["bleu"].items()})
        else:
            self.writer.write_final({f"{split}_masked_{key}": score[key] for split, score in result["masked"].items()
                                     for key in ("accuracy", "perplexity")})
        self.writer.close()
        if self.is_writer:
            files.write_json(os.path.join(self.workdir, "scores.json"), result)
        self.close()
        return result

    def finish_preempted(self, received: str) -> dict[str, Any]:
        """After a stop signal: the step's checkpoint committed, the logs closed, one line naming the step."""
        self.progress.close()
        self.writer.close()
        self.close()  # waits until every save is committed, then frees the workdir
        step = int(self.state.step)
        log.warning("%s: stopped at step %d with its checkpoint committed in %s; run the same command to resume "
                    "(exit status %d)", received, step, self.checkpointer.directory, loop.EXIT_PREEMPTED)
        return {"preempted": step, "signal": received}

    def close_checkpointers(self) -> None:
        """Wait until every save is committed, then close the managers (once; all_steps() still answers)."""
        if self.checkpoints_closed:
            return
        self.checkpoints_closed = True
        failed = []
        for checkpointer in (self.checkpointer, self.snapshots, self.best_checkpointer):
            if checkpointer is not None:
                try:
                    checkpointer.close()  # waits for the last save first: a failed one raises CheckpointSaveError
                except checkpoint.CheckpointSaveError as error:
                    failed.append(error)
        if failed:
            raise failed[0]

    def save_checkpoint(self, step: int, data_state: bytes | None, force: bool = False) -> None:
        """The train state (and data state) at checkpoint steps, with a params snapshot when averaging needs one."""
        if force or step % self.checkpointer.save_every_steps == 0:
            check_workdir_lock(self.lock)  # a run whose workdir another job took over must not write into it
        if not self.checkpointer.save(step, self.state, data_state=data_state, force=force):
            return
        self.saved_at = self.train_seconds
        if self.snapshots:
            self.snapshots.save(step, {"params": self.state.params}, force=True)

    def final_params(self) -> tuple[dict, list[int]]:
        """The parameters the end of the run scores: with decode.average_last > 1, the mean of the last
        params snapshots (the paper's averaging), summed on the devices in the training shardings; else the
        final ones."""
        if self.snapshots is None:
            return self.state.params, []
        self.snapshots.wait()
        steps = self.snapshots.all_steps()[-self.settings.decode.average_last:]
        if len(steps) < 2:
            return self.state.params, []
        abstract = sharding.with_shardings(abstract_like(self.state.params), self.state_shardings.params)
        log.info("averaging the parameters of the checkpoints of steps %s", steps)
        params, steps = checkpoint.average_readable_params([(self.snapshots, s) for s in steps], abstract, len(steps))
        return (params, steps) if len(steps) > 1 else (self.state.params, [])  # unreadable ones were named

    def _score_final_params(self) -> dict[str, Any]:
        """What the end of the run reports, also at each train.report_minutes mark: the mean of the last
        checkpoints (final_params), decoded and scored on decode.bleu_splits. Nothing here feeds back into
        training, so scoring the test split at a mark is as safe as at the end."""
        params, averaged = self.final_params()
        prefix = "avg_" if averaged else ""
        report = {"step": int(self.state.step), "train_seconds": self.train_seconds, "averaged_steps": averaged}
        if self.model_config.family == "encoder_only":
            return {**report, "masked": self._report_masked(self.settings.decode.splits, params, prefix)}
        return {**report, "bleu": self._report_bleu(self.settings.decode.splits, params=params, prefix=prefix)}

    def _report_masked(self, splits: list[str], params, prefix: str) -> dict[str, dict[str, float]]:
        """encoder_only's scores in place of BLEU: masked-token accuracy and perplexity on each split."""
        scores, step = {}, int(self.state.step)
        for split in splits:
            scores[split] = self.evaluate_loss(self.evaluate, split, params)
            self.writer.write(step, scores[split], f"{prefix}{split}_masked")
            self.progress.write(f"step {step}: {prefix}{split} masked accuracy {scores[split]['accuracy']:.3f} "
                                f"perplexity {scores[split]['perplexity']:.2f} over {scores[split]['target_tokens']:.0f} "
                                "masked tokens")
        return scores

    def _write_reports(self, reports: dict[str, Any]) -> None:
        if self.is_writer:
            files.write_json(os.path.join(self.workdir, REPORTS_FILE), reports)

    def train_iterator(self, start_step: int):
        """The grain iterator of this process's training batches, positioned after batch `start_step`."""
        settings = self.settings.data
        iterator = iter(data.train_dataset(
            self.corpus.train_cache, self.corpus.train_kept, seed=self.settings.seed, max_length=settings.max_length,
            rows_per_batch=self.batch.rows, shard=data.Shard.of_process(), num_workers=settings.num_workers,
            pack=settings.pack))
        if self.data_state is not None:
            data.restore_iterator(iterator, self.data_state)
        elif start_step:  # a checkpoint written before the data state was saved: the stream is deterministic
            log.info("checkpoint has no data iterator state; skipping %d batches", start_step)
            for _ in range(start_step):
                next(iterator)
        return iterator

    def _report_loss(self, evaluate) -> dict[str, float]:
        scores, step = self.evaluate_loss(evaluate), int(self.state.step)
        self.writer.write(step, scores, "valid")
        self.progress.write(f"step {step}: valid loss {scores['loss']:.4f} accuracy {scores['accuracy']:.3f} "
                            f"perplexity {scores['perplexity']:.2f}{router_line(scores)}")
        return scores

    def _report_bleu(self, splits: list[str], params=None, prefix: str = "") -> dict[str, dict[str, Any]]:
        scores = self.evaluate_bleu(self.search, splits, params, prefix)
        step = int(self.state.step)
        # Only the dev set chooses checkpoints; the test set never does.
        if self.best_checkpointer is not None and "valid" in scores and not prefix \
                and step != self.best_checkpointer.last_saved:
            self.best_checkpointer.save(step, {"params": self.state.params}, force=True,
                                        metrics={"valid_bleu": scores["valid"]["bleu"]})
        for split, score in scores.items():
            self.writer.write(step, {"bleu": score["bleu"], "decode_seconds": score["decode_seconds"],
                                     "train_seconds": self.train_seconds, "inputs_cut": score["inputs_cut"]},
                              f"{prefix}{split}_bleu")
            self.writer.write_samples(step, f"{prefix}{split}_bleu", score.pop("samples"))
            self.progress.write(f"step {step}: {prefix}{split} BLEU {score['bleu']:.2f} ({score['signature']}), "
                           f"decoded in {score['decode_seconds']:.1f}s")
        return scores


# ----------------------------------------------------------------------------------------------------
# Restore for evaluation


# Settings a resumed run may change; any other difference from the workdir's config.json is refused.
RESUMABLE_CHANGES = ("train.num_train_steps", "train.log_every_steps", "train.eval_every_steps",
                     "train.bleu_every_steps", "train.checkpoint_every_steps", "train.keep_checkpoints",
                     "train.async_checkpointing", "decode.", "mesh.", "train.num_microbatches",
                     "train.keep_best_checkpoint", "train.max_train_minutes", "train.report_minutes",
                     "train.dropout_rng",  # the masks change from the resumed step on, as with num_microbatches
                     "train.checkpoint_every_minutes", "train.compilation_cache_dir", "train.nonfinite",
                     "train.debug_nans", "data.local_cache_dir",
                     "train.wandb_project", "train.profile_steps")
# Keys a workdir's config.json may lack, with the value such a run actually used where it differs from today's
# default (field_default): dropout masks came from threefry before train.dropout_rng existed.
LEGACY_DEFAULTS = {"train.dropout_rng": "threefry2x32"}


def read_run_file(workdir: str) -> dict[str, Any]:
    return files.read_json(os.path.join(workdir, RUN_FILE), {})  # {} before the first start writes it


def recorded_batch(workdir: str) -> BatchShape | None:
    """The batch shape the run in `workdir` trains on; None for a workdir written before it was recorded (such a
    run keeps the config's own rows, as it had then)."""
    batch = read_run_file(workdir).get("batch")
    return BatchShape(int(batch["rows"]), int(batch["row_length"])) if batch else None


def provenance(batch: BatchShape, mesh, settings: Settings) -> dict[str, Any]:
    """What a researcher needs days later to know what ran: code, packages, devices, mesh, tokens per step."""
    import importlib.metadata
    import platform
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (an installed package)
        commit, dirty = None, None
    versions = {}
    for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy", "sentencepiece",
                    "sacrebleu", "tensorflow-datasets", "transformer"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"time": now, "command": sys.argv,
            "host": platform.node(), "commit": commit, "uncommitted_changes": dirty, "python": sys.version.split()[0],
            "packages": versions, "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
            "processes": jax.process_count(), "mesh": dict(mesh.shape),
            "microbatches": settings.train.num_microbatches, "rows": batch.rows, "row_length": batch.row_length,
            "tokens_per_step": batch.tokens}


def record_start(workdir: str, batch: BatchShape, mesh, settings: Settings, corpus: Corpus | None = None) -> None:
    """run.json: the batch shape, the vocabulary's and the train data's fingerprints (once: a resume keeps the
    data stream, and is refused another vocabulary) and every start's provenance, written whole."""
    record = read_run_file(workdir)
    record.setdefault("batch", {"rows": batch.rows, "row_length": batch.row_length})
    if corpus is not None:
        record.setdefault("vocabulary", workdirs.vocabulary_record(corpus.tokenizer.path, corpus.tokenizer.vocab_size))
        record.setdefault("train_data", corpus.train_source)
    record.setdefault("starts", []).append(provenance(batch, mesh, settings))
    files.write_json(os.path.join(workdir, RUN_FILE), record)


def acquire_workdir(workdir: str) -> workdirs.WorkdirLock | None:
    """Process 0 takes the workdir's lock for the whole job (workdirs.WorkdirLock); every process learns whether it
    did, so that all refuse together. A lock this process still holds from a Run it never closed is released
    first: one process is one owner."""
    lock, error = None, None
    if jax.process_index() == 0:
        previous = _HELD_LOCKS.pop(_lock_key(workdir), None)
        if previous is not None:
            previous.release()
        try:
            lock = workdirs.WorkdirLock(workdir).acquire()
            _HELD_LOCKS[_lock_key(workdir)] = lock
        except Exception as caught:  # in use, or an unwritable workdir: every process must learn it
            error = caught
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        if not bool(multihost_utils.broadcast_one_to_all(np.int32(error is None))) and error is None:
            error = workdirs.WorkdirInUseError(f"{workdir} is in use: process 0's log names the job that holds it")
    if error is not None:
        raise error
    return lock


def check_workdir_lock(lock: workdirs.WorkdirLock | None) -> None:
    """Raise WorkdirLockLost on every process if process 0's lock was taken over (they stop together)."""
    lost = None
    if lock is not None:
        try:
            lock.check()
        except workdirs.WorkdirLockLost as error:
            lost = error
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        if not bool(multihost_utils.broadcast_one_to_all(np.int32(lost is None))) and lost is None:
            lost = workdirs.WorkdirLockLost("process 0 lost the workdir lock to another job (its log names it)")
    if lost is not None:
        raise lost


def release_workdir(workdir: str, lock: workdirs.WorkdirLock) -> None:
    if _HELD_LOCKS.get(_lock_key(workdir)) is lock:
        del _HELD_LOCKS[_lock_key(workdir)]
    lock.release()


def _lock_key(workdir: str) -> str:
    return os.path.realpath(workdir) if files.is_local(workdir) else workdir


_HELD_LOCKS: dict[str, workdirs.WorkdirLock] = {}  # this process's workdir locks, by real path or URL


def use_compilation_cache(directory: str, workdir: str) -> None:
    """JAX's persistent compilation cache, so that a restarted run loads its compiled steps instead of compiling
    them again: train.compilation_cache_dir, by default workdir/compilation_cache; "none" turns it off. A cache
    the environment already chose (JAX_COMPILATION_CACHE_DIR) is left as it is."""
    if directory == "none" or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", directory or os.path.join(workdir, "compilation_cache"))


def read_reports(workdir: str) -> dict[str, Any]:
    """The train.report_minutes scores an earlier part of the run wrote (workdir/reports.json), by mark."""
    return files.read_json(os.path.join(workdir, REPORTS_FILE), {})


def previous_train_seconds(workdir: str, start_step: int) -> float:
    """The training seconds a stopped run had spent up to start_step (its last train record in
    metrics.jsonl), so that train.max_train_minutes and the time-to-BLEU curve count the whole run."""
    seconds = 0.0
    for record in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if start_step else []:
        if record.get("split") == "train" and record.get("step", 0) <= start_step and "train_seconds" in record:
            seconds = record["train_seconds"]
    return seconds


def field_default(key: str) -> Any:
    """The default of a dotted config key (e.g. "optimizer.cooldown_fraction"): configs/default.py's, or None."""
    section, _, name = key.partition(".")
    values = config_files.default_values()
    value = values.get(section, {}).get(name) if name else values.get(section)
    return list(value) if isinstance(value, tuple) else value


def flatten(tree, prefix: str = "") -> dict[str, Any]:
    """A config as {"section.key": value} (tuples as lists, as config.json holds them)."""
    items = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            items.update(flatten(value, f"{prefix}{key}."))
        else:
            items[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return items


def check_resume_config(saved: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """A resumed run must be the same run: refuse changes to the model, data, optimizer or seed. Returns the
    changes it allows (RESUMABLE_CHANGES) as "key: old -> new", for the log."""
    old, new = flatten(config_files.plain(saved)), flatten(config_files.plain(config))
    for key in set(new) - set(old):  # a key added since the workdir was made: the run had its default
        old[key] = LEGACY_DEFAULTS.get(key, field_default(key))
    if new.get("data.vocab_path"):  # the file decides the size (saved_config), and its identity is checked apart
        old.pop("data.vocab_size", None), new.pop("data.vocab_size", None)
    differ = sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))
    change = {key: f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in differ}
    refused = [change[key] for key in differ if not key.startswith(RESUMABLE_CHANGES)]
    if refused:
        raise ValueError(f"this workdir holds checkpoints of a run with another config ({', '.join(refused)}). "
                         "Resume with the same settings (see config.json there; only the keys starting with "
                         f"{', '.join(RESUMABLE_CHANGES)} may change), or use a new --workdir.")
    return list(change.values())


def saved_config(config: Mapping[str, Any], tokenizer: Tokenizer) -> str:
    """config.json: the run's config, with the vocabulary size the model has (data.vocab_path's file decides it)."""
    saved = config_files.plain(config)
    saved["data"] = {**saved.get("data", {}), "vocab_size": tokenizer.vocab_size}
    return json.dumps(saved, indent=2)


def workdir_family(workdir: str) -> str:
    """The model family (model.family) of a workdir's run, from its config.json."""
    return load_workdir_config(workdir).get("model", {}).get("family", field_default("model.family"))


def load_workdir_config(workdir: str) -> dict[str, Any]:
    path = os.path.join(workdir, CONFIG_FILE)
    if not files.exists(path):
        raise FileNotFoundError(f"{path} not found: --workdir must be a directory written by train.py")
    return files.read_json(path)


@dataclasses.dataclass
class Restored:
    """A trained model read back from a workdir: what eval.py and translation need."""

    settings: Settings
    model_config: ModelConfig
    graphdef: nnx.GraphDef
    params: dict
    tokenizer: Tokenizer
    step: int
    averaged_steps: list[int] = dataclasses.field(default_factory=list)  # the steps whose params were averaged
    best: bool = False  # restored from best_checkpoint/
    mesh: Any = None  # the params' mesh
    batch_sharding: Any = None  # rows of a batch split over that mesh's batch axes (decoding splits over them)

    @property
    def name(self) -> str:
        """step<N>, avg<K>_step<N> or best_step<N>: names the outputs of this model."""
        if len(self.averaged_steps) > 1:
            return f"avg{len(self.averaged_steps)}_step{self.step}"
        return f"best_step{self.step}" if self.best else f"step{self.step}"

    def search_fn(self):
        return self.settings.decode.search_fn(self.graphdef, self.settings.seed)

    @property
    def input_bound(self) -> int:
        """Sources past this many tokens are cut (decode.max_input_length, by default the training max_length)."""
        return self.settings.decode.input_bound(self.settings.data.max_length, self.model_config.position_limit)

    def masked_scores(self, pairs: list[tuple[str, str]]) -> dict[str, float]:
        """An encoder_only model's scores on sentence pairs, as its run's evaluation computes them: masked-token
        loss, accuracy and perplexity over the pairs within data.max_length, masked by steps.eval_mask_key (the
        same tokens as training's evaluation of the same split masked, in batches of the rows the run's plan gives
        this mesh)."""
        max_length = self.settings.data.max_length
        cache, kept = tokenized_split(self.tokenizer, pairs, max_length)
        if not len(kept):
            raise data.DataError(f"every pair is longer than data.max_length={max_length} tokens")
        rows = plan_batch(self.settings.data, batch_ways(self.settings, self.mesh.shape))[0].rows
        evaluate = jax.jit(functools.partial(eval_step, graphdef=self.graphdef,
                                             label_smoothing=self.settings.train.label_smoothing))
        summary = eval_loss(evaluate, self.params, cache, kept, self.settings.data, rows, self.batch_sharding)
        return {"loss": summary["loss"], "accuracy": summary["accuracy"], "perplexity": summary["perplexity"],
                "masked_tokens": summary["target_tokens"], "pairs": len(kept), "pairs_too_long": len(pairs) - len(kept)}


def restore(workdir: str, step: int | None = None, *, average_last: int = 0, best: bool = False,
            decode_overrides: dict[str, Any] | None = None) -> Restored:
    """The config, tokenizer and parameters of `workdir` at `step` (default: the latest checkpoint), or the
    mean of the parameters of the last `average_last` checkpoints up to `step`, or (best) the checkpoint of
    the best dev BLEU. Only parameters are read, into the run's own mesh where this machine's devices can hold
    it (else data parallel). decode_overrides replace fields of the saved decode config (e.g. beam_size)."""
    config = load_workdir_config(workdir)
    if decode_overrides:
        config["decode"] = {**config.get("decode", {}),
                            **{key: value for key, value in decode_overrides.items() if value is not None}}
    settings = Settings.from_config(config)
    names = [BEST_CHECKPOINT_DIR] if best else ["checkpoints", PARAMS_DIR]
    directories = [os.path.join(workdir, name) for name in names if files.is_dir(os.path.join(workdir, name))]
    if not directories:
        raise FileNotFoundError(f"no checkpoint in {workdir}: {os.path.join(workdir, names[0])} does not exist" + (
            " (train with --config.train.keep_best_checkpoint=true to keep one)" if best else ""))
    checkpointers = [Checkpointer(d, save_every_steps=1, keep=1, use_async=False, read_only=True)
                     for d in directories]
    try:
        holder = {s: c for c in reversed(checkpointers) for s in c.all_steps()}  # full states win a tie
        steps = sorted(holder)
        where = " or ".join(c.directory for c in checkpointers)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {where}")
        named = step is not None
        step = steps[-1] if step is None else step
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {where}; found {steps}")
        averaged = [s for s in steps if s <= step][-average_last:] if average_last > 1 else [step]
        if len(averaged) < average_last:
            raise ValueError(f"asked to average the last {average_last} checkpoints up to step {step}, but "
                             f"{where} holds only {len(averaged)} (steps {averaged}); the run kept "
                             f"decode.average_last={settings.decode.average_last} params snapshots and "
                             f"train.keep_checkpoints={settings.train.keep_checkpoints} train states")
        tokenizer = workdir_tokenizer(workdir, settings)
        model_config = settings.model_config(tokenizer.vocab_size)
        mesh_config, mesh = eval_mesh(settings.mesh)
        optimizer, _ = make_optimizer(settings.optimizer, model_config.emb_dim)
        shardings = state_shardings(model_config, optimizer, mesh, mesh_config).params
        abstract = sharding.with_shardings(abstract_train_state(model_config, optimizer, settings.seed).params,
                                           shardings)
        if named:  # the asked-for steps, or a clear error
            params = checkpoint.average_params([(holder[s], s) for s in averaged], abstract)
        else:  # the newest readable ones: a damaged newest checkpoint is named and passed over
            sources = [(c, s) for s in steps for c in checkpointers if s in c.all_steps()]  # full states first
            params, averaged = checkpoint.average_readable_params(sources, abstract, len(averaged))
            if len(averaged) < max(average_last, 1):
                raise checkpoint.CheckpointUnreadableError(
                    f"asked to average the last {average_last} checkpoints, but only {len(averaged)} of those in "
                    f"{where} can be read (steps {averaged}; the others are named above)")
            step = averaged[-1]
    finally:
        for checkpointer in checkpointers:
            checkpointer.close()
    return Restored(settings, model_config, model_graphdef(model_config), params, tokenizer, step,
                    averaged if len(averaged) > 1 else [], best, mesh, sharding.batch_sharding(mesh, mesh_config))


def restore_for_command_line(workdir: str, step: int | None, *, average_last: int | None, best: bool, nbest: int,
                             **decode_flags) -> Restored:
    """eval.py's and translate's one rule: every decoding flag left unset (None) takes the workdir config's decode
    value (decode.command_line_settings); a ValueError names a bad flag before anything is restored."""
    average_last, overrides = decode.command_line_settings(load_workdir_config(workdir).get("decode", {}), step=step,
                                                           average_last=average_last, best=best, nbest=nbest,
                                                           **decode_flags)
    return restore(workdir, step, average_last=average_last, best=best, decode_overrides=overrides)


def workdir_tokenizer(workdir: str, settings: Settings) -> Tokenizer:
    """The run's own vocabulary: its copy in the workdir (data.vocab_path's, for workdirs written before the copy),
    refused unless it is the one run.json recorded."""
    path = os.path.join(workdir, workdirs.VOCABULARY_FILE)
    if not files.exists(path) and settings.data.vocab_path:
        path = settings.data.vocab_path
    workdirs.check_vocabulary(read_run_file(workdir).get("vocabulary"), path)
    local = os.path.join(files.local_directory(workdir, settings.data.local_cache_dir), workdirs.VOCABULARY_FILE)
    return data.local_tokenizer(path, local if not files.is_local(path) else path)


def eval_mesh(mesh_config: sharding.MeshConfig) -> tuple[sharding.MeshConfig, Any]:
    """The run's own mesh on this machine's devices when it fits them, else data parallel over them all."""
    try:
        return mesh_config, sharding.make_mesh(mesh_config)
    except ValueError:
        fallback = sharding.MeshConfig(rules=mesh_config.rules)
        return fallback, sharding.make_mesh(fallback)
