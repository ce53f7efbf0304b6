"""What eval.py and `python -m transformer.translate` share on the command line: the flags that name a workdir's
checkpoint and override its config's decoding settings (`define_command_line_flags`), and the one rule both apply,
a flag left unset taking the workdir config's value (`command_line_settings`, `restore_for_command_line`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from absl import flags

from transformer.decode import MBR_SOURCES, PENALTIES, SEARCHES, WEIGHTS, DecodeConfig
from transformer.mbr import UTILITIES
from transformer.restore import Restored, load_workdir_config, restore

# Flags of both tools that override the workdir config's decode section when given.
COMMAND_LINE_OVERRIDES = ("batch_size", "max_tokens_per_batch", "beam_size", "alpha", "length_penalty",
                          "max_extra_length", "temperature", "top_k", "top_p", "epsilon", "search", "mbr_candidates",
                          "mbr_from", "mbr_utility", "weights", "shrink")


def define_command_line_flags(unit: str) -> None:
    """The flags both tools define alike (`unit`: what they decode, "sentences" or "lines"): the workdir and the
    checkpoint to restore, and the overrides of COMMAND_LINE_OVERRIDES but --batch_size, whose meaning differs.
    Each tool adopts them (flags.adopt_module_key_flags(cli)), so its --help lists them."""
    flags.DEFINE_string("workdir", None, "A directory written by train.py.", required=True)
    flags.DEFINE_integer("step", None, "Checkpoint step to restore (default: the latest).")
    flags.DEFINE_integer("average_last", None, "Average the parameters of the last N checkpoints up to --step "
                         "(default: the config's decode.average_last, none with --best; 0 or 1: no averaging).")
    flags.DEFINE_bool("best", False, "Use the checkpoint of the best dev BLEU (workdir/best_checkpoint).")
    flags.DEFINE_integer("beam_size", None, "Beam size (default: the config's decode.beam_size; 1 = greedy).")
    flags.DEFINE_float("alpha", None, "Length penalty alpha of beam search (default: the config's decode.alpha).")
    flags.DEFINE_enum("length_penalty", None, list(PENALTIES), "gnmt: ((5 + length) / 6)^alpha; fairseq: "
                      "length^alpha (default: the config's decode.length_penalty).")
    flags.DEFINE_integer("max_extra_length", None, "Outputs may have up to input length + this many tokens "
                         "(default: the config's decode.max_extra_length).")
    flags.DEFINE_integer("max_tokens_per_batch", None, f"At most this many {unit} x padded source length per "
                         "decoding batch; 0: no budget (default: the config's decode.max_tokens_per_batch).")
    flags.DEFINE_float("temperature", None, "> 0: sample at this temperature (beam_size 1), or MBR's samples' "
                       "(default: the config's decode.temperature).")
    flags.DEFINE_integer("top_k", None, "Sampling among the k most likely tokens (default: decode.top_k).")
    flags.DEFINE_float("top_p", None, "Nucleus sampling's p (default: decode.top_p).")
    flags.DEFINE_float("epsilon", None, "Sampling drops tokens below this probability (default: decode.epsilon).")
    flags.DEFINE_enum("search", None, list(SEARCHES), "mbr: minimum Bayes risk over --mbr_candidates candidates "
                      "(default: the config's decode.search).")
    flags.DEFINE_integer("mbr_candidates", None, "MBR's candidates per sentence (default: decode.mbr_candidates).")
    flags.DEFINE_enum("mbr_from", None, list(MBR_SOURCES), "MBR's candidates: samples or a beam's n-best "
                      "(default: decode.mbr_from).")
    flags.DEFINE_enum("mbr_utility", None, list(UTILITIES), "MBR's utility (default: decode.mbr_utility).")
    flags.DEFINE_enum("weights", None, list(WEIGHTS), "bfloat16: decode on bfloat16 weights and matmuls "
                      "(default: decode.weights).")
    flags.DEFINE_integer("shrink", None, "Halve a batch up to N times as its sentences finish: faster on CPU, "
                         "the same outputs (default: decode.shrink).")


def command_line_settings(saved: Mapping[str, Any], *, step: int | None, average_last: int | None, best: bool,
                          nbest: int = 0, **overrides: Any) -> tuple[int, dict[str, Any]]:
    """One rule for eval.py and transformer.translate: a flag left unset (None) takes the workdir config's decode
    value (`saved`), average_last included, except that --best restores one checkpoint and averages none.
    -> (checkpoints to average, decode overrides for restore.restore); ValueError names a bad flag."""
    if best and (step is not None or average_last):
        raise ValueError("--best chooses one checkpoint: it goes with neither --step nor --average_last")
    if average_last is not None and average_last < 0:
        raise ValueError(f"--average_last={average_last} must be >= 0")
    given = {key: value for key, value in overrides.items() if value is not None}
    known = {field.name for field in dataclasses.fields(DecodeConfig)}
    try:
        settings = DecodeConfig(**{**{k: v for k, v in saved.items() if k in known}, **given})
    except ValueError as error:  # name the flag rather than the config key it overrides
        message = str(error)
        for key, value in given.items():
            message = message.replace(f"decode.{key}={value!r}", f"--{key}={value!r}").replace(
                f"decode.{key}={value}", f"--{key}={value}")
        raise ValueError(message) from error
    settings.check_nbest(nbest)
    if average_last is None:
        average_last = 0 if best else int(saved.get("average_last", 0))
    return average_last, given


def restore_for_command_line(workdir: str, step: int | None, *, average_last: int | None, best: bool, nbest: int,
                             **decode_flags) -> Restored:
    """eval.py's and translate's one rule: every decoding flag left unset (None) takes the workdir config's decode
    value (command_line_settings); a ValueError names a bad flag before anything is restored."""
    average_last, overrides = command_line_settings(load_workdir_config(workdir).get("decode", {}), step=step,
                                                           average_last=average_last, best=best, nbest=nbest,
                                                           **decode_flags)
    return restore(workdir, step, average_last=average_last, best=best, decode_overrides=overrides)
