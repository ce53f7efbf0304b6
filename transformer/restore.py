"""A trained model read back from its workdir, for evaluation, translation, features and export: the config, the
tokenizer, and the parameters of one checkpoint, or the mean of the last N (the paper's averaging), or the best by
dev BLEU, restored into the run's own mesh where this machine's devices hold it (`restore`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flax import nnx

from transformer import checkpoint, data, files, sharding
from transformer import workdir as workdirs
from transformer.checkpoint import Checkpointer
from transformer.model import ModelConfig
from transformer.optim import make_optimizer
from transformer.plan import abstract_train_state, model_graphdef, state_shardings
from transformer.settings import Settings, field_default
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
