"""The run's settings: a config (plain nested values, config_files.plain) read into frozen, validating dataclasses,
one per section (`Settings`), and the rule for resuming a workdir with a changed config (`check_resume_config`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from transformer import config_files, data, decode, errors, loop, mixture, sharding
from transformer.model import ModelConfig
from transformer.optim import OptimizerConfig
from transformer.steps import DROPOUT_RNGS
from transformer.tokenizer import Tokenizer


OBJECTIVES = ("mle", "risk")


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
    max_skipped_updates: int
    debug_nans: bool
    wandb_project: str
    profile_steps: str
    init_from: str
    objective: str
    risk_weight: float
    risk_candidates: int

    def __post_init__(self):
        if self.num_microbatches < 1:
            raise ValueError(f"train.num_microbatches={self.num_microbatches} must be >= 1")
        if self.nonfinite not in loop.NONFINITE_POLICIES:
            raise ValueError(f"train.nonfinite={self.nonfinite!r} is not one of {loop.NONFINITE_POLICIES}")
        if self.dropout_rng not in DROPOUT_RNGS:
            raise ValueError(f"train.dropout_rng={self.dropout_rng!r} is not one of {DROPOUT_RNGS}")
        if self.num_train_steps < 1:  # 0 would build, save and score an untrained model as if it were a run
            raise ValueError(f"train.num_train_steps={self.num_train_steps} must be >= 1 (eval.py scores a "
                             f"trained workdir)")
        for name in ("log_every_steps", "checkpoint_every_steps", "keep_checkpoints", "max_skipped_updates"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train.{name}={getattr(self, name)} must be positive")
        if self.max_train_minutes < 0 or self.checkpoint_every_minutes < 0:
            raise ValueError(f"train.max_train_minutes={self.max_train_minutes} and train.checkpoint_every_minutes="
                             f"{self.checkpoint_every_minutes} must be >= 0")
        self.report_marks  # validates the list now
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"train.label_smoothing={self.label_smoothing} must be in [0, 1)")
        self.profile_range  # validates it now
        if self.objective not in OBJECTIVES:
            raise ValueError(f"train.objective={self.objective!r} is not one of {OBJECTIVES}")
        if not 0.0 <= self.risk_weight <= 1.0:
            raise ValueError(f"train.risk_weight={self.risk_weight} must be in [0, 1]")
        if self.risk_candidates < 2:  # one candidate has a risk of its own cost, whose gradient is 0
            raise ValueError(f"train.risk_candidates={self.risk_candidates} must be >= 2")

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
        # An unknown key is named with the nearest known ones rather than dropped: checked against configs/default.py,
        # the one schema, which has every field of the sections' dataclasses (but the model's vocab_size and seed).
        defaults = config_files.default_values()
        keys = [f"{name}.{key}" if isinstance(values, Mapping) and name in defaults else name
                for name, values in config.items() for key in (values if isinstance(values, Mapping) else [None])]
        problems = list(dict.fromkeys(problem for key in keys if (problem := config_files.unknown_key(defaults, key))))
        if problems:
            raise errors.ConfigError("; ".join(problems))

        def build(kind, section, **extra):
            with errors.as_config_error():
                return kind(**config.get(section, {}), **extra)

        model = config.get("model", {})
        shapes = build(ModelConfig, "model", vocab_size=1, seed=0)  # validates shapes before any data work
        settings = cls(seed=int(config.get("seed", 0)), data=build(data.DataConfig, "data"), model=model,
                       optimizer=build(OptimizerConfig, "optimizer"), train=build(TrainConfig, "train"),
                       decode=build(decode.DecodeConfig, "decode"), mesh=build(sharding.MeshConfig, "mesh"))
        settings.decode.splits  # validates the split names now, before training
        if settings.data.mixture:
            mixture.parse(settings.data.mixture)
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
        if settings.train.objective == "risk":
            if shapes.family != "encoder_decoder":
                raise ValueError(f"train.objective='risk' samples translations of each source: it takes "
                                 f"model.family='encoder_decoder', not {shapes.family!r}")
            if settings.data.pack:  # a packed row holds several sources, and its candidates would be one sequence
                raise ValueError("train.objective='risk' draws candidates for each source sentence, one per row: "
                                 "set data.pack=false")
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


# Settings a resumed run may change; any other difference from the workdir's config.json is refused.
RESUMABLE_CHANGES = ("train.num_train_steps", "train.log_every_steps", "train.eval_every_steps",
                     "train.bleu_every_steps", "train.checkpoint_every_steps", "train.keep_checkpoints",
                     "train.async_checkpointing", "decode.", "mesh.", "train.num_microbatches",
                     "train.keep_best_checkpoint", "train.max_train_minutes", "train.report_minutes",
                     "train.dropout_rng",  # the masks change from the resumed step on, as with num_microbatches
                     "train.checkpoint_every_minutes", "train.compilation_cache_dir", "train.nonfinite",
                     "train.max_skipped_updates",
                     "train.debug_nans", "data.local_cache_dir",
                     "train.wandb_project", "train.profile_steps")


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
    for key in set(new) - set(old):  # a config given in part (Settings takes one): the run had the key's default
        old[key] = field_default(key)
    if new.get("data.vocab_path"):  # the file decides the size (saved_config), and its identity is checked apart
        old.pop("data.vocab_size", None), new.pop("data.vocab_size", None)
    differ = sorted(key for key in set(old) | set(new) if old.get(key) != new.get(key))
    change = {key: f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in differ}
    refused = [change[key] for key in differ if not key.startswith(RESUMABLE_CHANGES)]
    if refused:
        raise errors.ConfigError(f"this workdir holds checkpoints of a run with another config ({', '.join(refused)}). "
                         "Resume with the same settings (see config.json there; only the keys starting with "
                         f"{', '.join(RESUMABLE_CHANGES)} may change), or use a new --workdir.")
    return list(change.values())


def saved_config(config: Mapping[str, Any], tokenizer: Tokenizer) -> str:
    """config.json: the run's config, with the vocabulary size the model has (data.vocab_path's file decides it)."""
    saved = config_files.plain(config)
    saved["data"] = {**saved.get("data", {}), "vocab_size": tokenizer.vocab_size}
    return json.dumps(saved, indent=2)
