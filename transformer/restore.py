"""A trained model read back from its workdir, for evaluation, translation, features and export: the config, the
tokenizer, and the parameters of one checkpoint, or the mean of the last N (the paper's averaging), or the best by
dev BLEU, restored into the run's own mesh where this machine's devices hold it (`restore`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flax import nnx

from transformer import checkpoint, data, errors, files, sharding
from transformer import workdir as workdirs
from transformer.checkpoint import Checkpointer
from transformer.model import ModelConfig
from transformer.optim import make_optimizer
from transformer.plan import abstract_train_state, model_graphdef, state_shardings
from transformer.settings import Settings, field_default, flatten
from transformer.tokenizer import Tokenizer
from transformer.workdir import BEST_CHECKPOINT_DIR, CHECKPOINTS_DIR, CONFIG_FILE, PARAMS_DIR


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

    @property
    def input_bound(self) -> int:
        """Sources past this many tokens are cut (decode.max_input_length, by default the training max_length)."""
        return self.settings.decode.input_bound(self.settings.data.max_length, self.model_config.position_limit)


def restore(workdir: str, step: int | None = None, *, average_last: int = 0, best: bool = False,
            decode_overrides: dict[str, Any] | None = None, into: Any = None) -> Restored:
    """The config, tokenizer and parameters of `workdir` at `step` (default: the latest checkpoint), or the
    mean of the parameters of the last `average_last` checkpoints up to `step`, or (best) the checkpoint of
    the best dev BLEU. Only parameters are read, into the run's own mesh where this machine's devices can hold
    it (else data parallel), or into `into` (abstract params with shardings: a warm start's, in its own run's
    mesh). decode_overrides replace fields of the saved decode config (e.g. beam_size)."""
    config = load_workdir_config(workdir)
    if decode_overrides:
        config["decode"] = {**config.get("decode", {}),
                            **{key: value for key, value in decode_overrides.items() if value is not None}}
    settings = Settings.from_config(config)
    names = [BEST_CHECKPOINT_DIR] if best else [CHECKPOINTS_DIR, PARAMS_DIR]
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
        abstract = into
        if abstract is None:
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


def workdir_tokenizer(workdir: str, settings: Settings) -> Tokenizer:
    """The run's own vocabulary: its copy in the workdir (of data.vocab_path's, if the run named one), refused unless
    it is the one run.json recorded."""
    path = os.path.join(workdir, workdirs.VOCABULARY_FILE)
    workdirs.check_vocabulary(workdirs.read_run_file(workdir).get("vocabulary"), path)
    local = os.path.join(files.local_directory(workdir, settings.data.local_cache_dir), workdirs.VOCABULARY_FILE)
    return data.local_tokenizer(path, local if not files.is_local(path) else path)


def eval_mesh(mesh_config: sharding.MeshConfig) -> tuple[sharding.MeshConfig, Any]:
    """The run's own mesh on this machine's devices when it fits them, else data parallel over them all."""
    try:
        return mesh_config, sharding.make_mesh(mesh_config)
    except ValueError:
        fallback = sharding.MeshConfig(rules=mesh_config.rules)
        return fallback, sharding.make_mesh(fallback)


# ----------------------------------------------------------------------------------------------------
# Warm starts (train.init_from): a new run begins from another run's parameters and vocabulary, as fairseq's
# --restore-file with --reset-optimizer --reset-dataloader, t5x's initial_checkpoint_path or Marian's
# --pretrained-model do: optimizer, schedule, step and data position start afresh.

# Model settings a warm start may change: they shape no parameter and change no function of them but in training.
WARM_START_FREE = ("dropout_rate", "attention_dropout_rate", "relu_dropout_rate", "dtype", "attention", "remat",
                   "init_std", "capacity_factor", "eval_capacity_factor", "router_balance_weight", "router_z_weight")


@dataclasses.dataclass(frozen=True)
class InitFrom:
    """train.init_from read: WORKDIR, WORKDIR:STEP, WORKDIR:best or WORKDIR:avgK."""

    workdir: str
    step: int | None = None
    average_last: int = 0
    best: bool = False

    @classmethod
    def parse(cls, spec: str) -> "InitFrom":
        head, colon, tail = spec.rpartition(":")
        # Only a known suffix is one (a gs:// path holds colons of its own).
        if colon and head and "/" not in tail and (tail.isdigit() or tail == "best" or
                                                   (tail.startswith("avg") and tail[3:].isdigit())):
            if tail == "best":
                return cls(head, best=True)
            if tail.startswith("avg"):
                if int(tail[3:]) < 1:
                    raise errors.ConfigError(f"train.init_from={spec!r}: avgK needs K >= 1")
                return cls(head, average_last=int(tail[3:]))
            return cls(head, step=int(tail))
        return cls(spec)


def warm_start_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config of a run with train.init_from, checked against the source run's before any work: its model
    settings must be the source's (but WARM_START_FREE), and its vocabulary is the source's, given as data.vocab_path
    (a different data.vocab_path is refused). The same config is returned for every start of the run, so that a
    resume with the same command is the same run. Without train.init_from, the config as it is."""
    spec = config.get("train", {}).get("init_from", "")
    if not spec:
        return config
    source = InitFrom.parse(spec)
    saved = load_workdir_config(source.workdir)  # names the missing config.json of a wrong path
    found = checkpoint_steps(source.workdir, source.best)
    if not found or (source.step is not None and source.step not in found) or source.average_last > len(found):
        asked = (f"checkpoint of step {source.step}" if source.step is not None else
                 f"{source.average_last} checkpoints to average" if source.average_last else
                 "best checkpoint" if source.best else "checkpoint")
        raise FileNotFoundError(f"train.init_from={spec}: {source.workdir} holds no {asked}; its checkpoints: "
                                f"{found or 'none'}")
    ours, theirs = (flatten({"model": c.get("model", {})}) for c in (config, saved))
    refused = [f"{key}: {theirs.get(key, field_default(key))!r} there, {ours.get(key, field_default(key))!r} here"
               for key in sorted(set(ours) | set(theirs) | {"model.family"})
               if key.split(".", 1)[1] not in WARM_START_FREE and ours.get(key, field_default(key)) !=
               theirs.get(key, field_default(key))]
    if refused:
        raise errors.ConfigError(f"train.init_from={spec}: the model settings differ from that run's "
                                 f"({'; '.join(refused)}); set them as there (see its config.json)")
    seeds = int(saved.get("seed", 0)), int(config.get("seed", 0))
    if seeds[0] != seeds[1] and any("performer" in str(value) for key, value in ours.items() if "attention" in key):
        raise errors.ConfigError(f"train.init_from={spec}: performer's random features are drawn from config.seed, "
                                 f"{seeds[0]} there and {seeds[1]} here: set seed={seeds[0]}")
    vocabulary = os.path.join(source.workdir, workdirs.VOCABULARY_FILE)
    workdirs.check_vocabulary(workdirs.read_run_file(source.workdir).get("vocabulary"), vocabulary)
    given = config.get("data", {}).get("vocab_path", "")
    if given and workdirs.fingerprint(given) != workdirs.fingerprint(vocabulary):
        raise errors.ConfigError(f"train.init_from={spec} keeps that run's vocabulary, {vocabulary}, but "
                                 f"data.vocab_path={given} is another file: leave data.vocab_path empty")
    return {**config, "data": {**config.get("data", {}), "vocab_path": given or vocabulary}}


def checkpoint_steps(workdir: str, best: bool = False) -> list[int]:
    """The steps of a workdir's committed checkpoints (train states and params snapshots), or of its best one."""
    names = [BEST_CHECKPOINT_DIR] if best else [CHECKPOINTS_DIR, PARAMS_DIR]
    return sorted({int(entry) for name in names for entry in files.list_dir(os.path.join(workdir, name))
                   if entry.isdigit()})


def warm_start(spec: str, abstract_params: Any) -> tuple[Any, dict[str, Any]]:
    """The parameters train.init_from names, read into `abstract_params` (the new run's shapes and shardings; a
    mismatch is refused naming the parameter), and what run.json records of them."""
    source = InitFrom.parse(spec)
    restored = restore(source.workdir, source.step, average_last=source.average_last, best=source.best,
                       into=abstract_params)
    record = {"workdir": files.absolute(source.workdir), "spec": spec, "params": restored.name,
              "step": restored.step, "averaged_steps": restored.averaged_steps, "best": restored.best,
              "vocabulary": workdirs.read_run_file(source.workdir).get("vocabulary")}
    return restored.params, record
