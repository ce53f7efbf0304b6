"""Scores and logs: sacreBLEU and chrF with their signatures, the paper's tokenized compound-split BLEU;
TensorBoard, a metrics JSONL and the progress bar (console lines: transformer.console)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import time
from typing import Any

import sacrebleu

from transformer import files
from transformer.console import log


def bleu(hypotheses: list[str], references: list[str], *, target_lang: str | None = None) -> dict[str, Any]:
    """Corpus sacreBLEU (13a tokenizer, cased; ja/zh/ko get their own tokenizers) with its signature."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    metric = sacrebleu.metrics.BLEU(trg_lang=target_lang or "")
    score = metric.corpus_score(hypotheses, [references])
    return {"bleu": score.score, "signature": str(metric.get_signature()), "precisions": score.precisions,
            "brevity_penalty": score.bp, "hypothesis_length": score.sys_len, "reference_length": score.ref_len}


def chrf(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """Corpus chrF (sacreBLEU's defaults: character 6-grams, beta 2) with its signature."""
    metric = sacrebleu.metrics.CHRF()
    return {"chrf": metric.corpus_score(hypotheses, [references]).score, "chrf_signature": str(metric.get_signature())}


# The paper's BLEU is tensor2tensor's get_ende_bleu.sh: Moses tokenizer.perl -l <lang> (default options, so
# XML special characters are escaped), then, for German only (the WMT en-de convention; the paper's en-fr score is
# tokenized BLEU alone), compounds put in ##AT## form with perl's s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g,
# then multi-bleu.perl (cased, no smoothing, whitespace tokens). sacremoses is the Python port of tokenizer.perl;
# sacreBLEU with tok 'none' and no smoothing computes multi-bleu.perl's corpus BLEU.
COMPOUND_SPLIT_LANGS = ("de",)
PAPER_TOKENIZE_METHOD = "sacremoses MosesTokenizer(lang).tokenize(escape=True)"
COMPOUND_SPLIT_METHOD = "s/(\\S)-(\\S)/\\1 ##AT##-##AT## \\2/g"
PAPER_BLEU_SCORE_METHOD = "cased BLEU without smoothing on whitespace tokens (multi-bleu.perl's)"
_COMPOUND = re.compile(r"(\S)-(\S)")


@functools.lru_cache(maxsize=8)
def _moses(lang: str):
    from sacremoses import MosesTokenizer  # imported here: only the paper BLEU needs it
    return MosesTokenizer(lang=lang)


def paper_tokenize(text: str, lang: str) -> str:
    """Moses-tokenized text, compound-split in German: "ein Test-Fall." -> "ein Test ##AT##-##AT## Fall ."."""
    tokenized = _moses(lang).tokenize(text, escape=True, return_str=True)
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized) if lang in COMPOUND_SPLIT_LANGS else tokenized


def paper_bleu_name(lang: str) -> str:
    return "paper BLEU (tokenized, compound-split)" if lang in COMPOUND_SPLIT_LANGS else "paper BLEU (tokenized)"


def paper_bleu(hypotheses: list[str], references: list[str], *, target_lang: str) -> dict[str, Any]:
    """The paper's tokenized BLEU, compound-split for German (comparable to Vaswani et al. Table 2)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    metric = sacrebleu.metrics.BLEU(tokenize="none", smooth_method="none", force=True)
    score = metric.corpus_score([paper_tokenize(h, target_lang) for h in hypotheses],
                                [[paper_tokenize(r, target_lang) for r in references]])
    steps = [PAPER_TOKENIZE_METHOD] + ([COMPOUND_SPLIT_METHOD] if target_lang in COMPOUND_SPLIT_LANGS else [])
    method = f"tensor2tensor get_ende_bleu.sh: {', '.join(steps)}, then {PAPER_BLEU_SCORE_METHOD}, lang {target_lang}"
    return {"paper_bleu": score.score, "paper_bleu_method": method}


def all_scores(hypotheses: list[str], references: list[str], *, target_lang: str) -> dict[str, Any]:
    """sacreBLEU, chrF and the paper's BLEU side by side, each with its signature or method."""
    return {**bleu(hypotheses, references, target_lang=target_lang), **chrf(hypotheses, references),
            **paper_bleu(hypotheses, references, target_lang=target_lang)}


def _parse_jsonl(path: str) -> tuple[list[tuple[bytes, dict[str, Any]]], list[int], bool]:
    """(raw line, record) of each readable line, the numbers of the unreadable ones, and whether the file
    ends with a newline. A line is readable if it is UTF-8 holding one JSON object."""
    content = files.read_bytes(path)
    lines, readable, unreadable = content.split(b"\n"), [], []
    if lines and not lines[-1]:
        lines.pop()  # the empty string after the final newline
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError:  # invalid JSON or invalid UTF-8
            record = None
        if isinstance(record, dict):
            readable.append((line, record))
        else:
            unreadable.append(number)
    return readable, unreadable, content.endswith(b"\n") or not content


def _line_numbers(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:10]))
    return f"{shown} and {len(numbers) - 10} more" if len(numbers) > 10 else shown


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, skipping (with one warning) lines that are not JSON objects, such as
    a last line torn by a kill; [] when there is no such file."""
    if not files.exists(path):
        return []
    readable, unreadable, _ = _parse_jsonl(path)
    if unreadable:
        log.warning("%s: skipped unreadable line(s) %s", path, _line_numbers(unreadable))
    return [record for _, record in readable]


def repair_jsonl(path: str, resume_step: int | None = None) -> None:
    """Rewrite a metrics JSONL file (atomically, only if anything changes) without its unreadable lines, with
    one warning naming them, and with resume_step without the records of steps after it."""
    readable, unreadable, ends_with_newline = _parse_jsonl(path)
    kept = [line for line, record in readable
            if resume_step is None or not isinstance(record.get("step"), (int, float)) or record["step"] <= resume_step]
    if unreadable:
        log.warning("%s: dropped unreadable line(s) %s (left by a run killed while writing); kept %d records",
                    path, _line_numbers(unreadable), len(kept))
    if unreadable or len(kept) < len(readable) or not ends_with_newline:
        files.write_bytes(path, b"".join(line + b"\n" for line in kept))


class MetricWriter:
    """The one metrics writer: scalars to TensorBoard (workdir/tensorboard) and as JSON lines
    (workdir/metrics.jsonl), and to Weights & Biases when a project is named; sample translations as text; the
    run's hyperparameters with its final scores (TensorBoard's hparams, the W&B summary).

    Object storage has no append: a workdir there gets both files written in its local mirror
    (files.local_directory) and copied up, metrics.jsonl at every write and TensorBoard's events at most
    every `publish_seconds` and at close."""

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int | None = None, *, local_root: str = "",
                 publish_seconds: float = 60.0, wandb_project: str = "", hparams: dict[str, Any] | None = None):
        """With resume_step, drop the JSONL records a stopped run wrote after that step (the checkpoint it
        resumes from), so that each step appears once. Lines a kill left unreadable (a torn last line, junk)
        are dropped with one warning, so that new records are not appended to a partial line."""
        self.enabled, self.wandb = enabled, None
        if not enabled:
            return
        from tensorboardX import SummaryWriter  # imported here: slow, and only the writing process needs it

        self.workdir, self.local = workdir, files.local_directory(workdir, local_root)
        self.publish_seconds, self.published = publish_seconds, time.monotonic()
        path, remote = os.path.join(self.local, "metrics.jsonl"), os.path.join(workdir, "metrics.jsonl")
        if self.local != workdir and files.exists(remote):
            files.fetch(remote, path)  # the workdir's copy is the record; the mirror may be stale or absent
        if os.path.exists(path):
            repair_jsonl(path, resume_step)
        os.makedirs(self.local, exist_ok=True)
        self.tensorboard = SummaryWriter(os.path.join(self.local, "tensorboard"))
        self.jsonl = open(path, "a", encoding="utf-8")
        self.hparams = hparams or {}
        if wandb_project:
            self.wandb = start_wandb(wandb_project, workdir, self.local, self.hparams)

    def write(self, step: int, scalars: dict[str, float], prefix: str) -> None:
        if not self.enabled:
            return
        for key, value in scalars.items():
            if isinstance(value, (int, float)):
                self.tensorboard.add_scalar(f"{prefix}/{key}", value, step)
        self.jsonl.write(json.dumps({"step": step, "split": prefix, "time": time.time(), **scalars}) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{key}": value for key, value in scalars.items()
                            if isinstance(value, (int, float))}, step=step)
        self.publish(tensorboard=time.monotonic() - self.published > self.publish_seconds)

    def write_samples(self, step: int, name: str, rows: list[tuple[str, str, str]]) -> None:
        """A few (source, reference, translation) triples of a BLEU evaluation, as a text table."""
        if not self.enabled or not rows:
            return
        table = "| source | reference | translation |\n|---|---|---|\n" + "".join(
            "| " + " | ".join(text.replace("|", "\\|").replace("\n", " ") for text in row) + " |\n" for row in rows)
        self.tensorboard.add_text(f"{name}/samples", table, step)
        if self.wandb is not None:
            import wandb
            self.wandb.log({f"{name}/samples": wandb.Table(columns=["source", "reference", "translation"],
                                                           data=[list(row) for row in rows])}, step=step)

    def write_final(self, scores: dict[str, float]) -> None:
        """The run's hyperparameters beside its final scores: TensorBoard's hparams view, the W&B summary."""
        if not self.enabled:
            return
        shown = {key: value if isinstance(value, (int, float, str, bool)) else str(value)
                 for key, value in self.hparams.items()}
        self.tensorboard.add_hparams(shown, {f"final/{key}": value for key, value in scores.items()}, name="hparams")
        if self.wandb is not None:
            self.wandb.summary.update({f"final/{key}": value for key, value in scores.items()})

    def publish(self, tensorboard: bool) -> None:
        """Copy the mirror's files up to a workdir on object storage (nothing to do for a local one)."""
        if self.local == self.workdir:
            return
        files.publish(self.jsonl.name, os.path.join(self.workdir, "metrics.jsonl"))
        if tensorboard:
            self.tensorboard.flush()
            events = os.path.join(self.local, "tensorboard")
            for name in os.listdir(events):
                files.publish(os.path.join(events, name), os.path.join(self.workdir, "tensorboard", name))
            self.published = time.monotonic()

    def close(self) -> None:
        if self.enabled and not self.jsonl.closed:
            self.tensorboard.close()
            self.jsonl.close()
            self.publish(tensorboard=True)
            if self.wandb is not None:
                self.wandb.finish()


def start_wandb(project: str, workdir: str, local: str, hparams: dict[str, Any]):
    """A W&B run named after the workdir; its id is the workdir's, so a resumed run goes on logging into it."""
    try:
        import wandb
    except ImportError as error:
        from transformer.errors import ConfigError
        raise ConfigError(f"train.wandb_project={project!r} needs Weights & Biases: pip install -e '.[wandb]'") \
            from error
    run_id = hashlib.sha256(files.absolute(workdir).encode()).hexdigest()[:16]
    return wandb.init(project=project, name=os.path.basename(os.path.normpath(workdir)), id=run_id, resume="allow",
                      dir=local, config=hparams)


class Progress:
    """A tqdm bar with step, loss, lr, tokens/s and ETA on a terminal; nothing extra otherwise (log lines do)."""

    def __init__(self, total: int, initial: int):
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, steps: int, summary: dict[str, float] | None = None) -> None:
        if self.bar is None:
            return
        self.bar.update(steps)
        if summary:
            self.bar.set_postfix(loss=f"{summary['loss']:.3f}", lr=f"{summary['learning_rate']:.2e}",
                                 tok_s=f"{summary.get('tokens_per_second', 0):.0f}", refresh=False)

    def write(self, line: str) -> None:
        if self.bar is None:
            log.info(line)
        else:
            self.bar.write(line, file=sys.stderr)  # the bar's stream: stdout carries results only

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
