"""Evaluating a model's parameters, one way for a training run (its periodic evaluations, its end and its
train.report_minutes marks) and for eval.py: the eval loss over the pairs of a split within data.max_length (an
encoder_only model's masked-token scores), and the translations of sentences by the configured search, cut to the
input bound and timed, which BLEU scores (`Evaluator`). What a run writes of them (metrics, console lines,
translation files, the best checkpoint) is `RunEvaluation`."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from transformer import data, decode, files, metrics, sharding
from transformer.model import ROUTER_STATS, ModelConfig
from transformer.plan import plan_batch, rows_multiple
from transformer.settings import Settings
from transformer.steps import eval_step, summarize
from transformer.token_cache import TokenCache
from transformer.tokenizer import Tokenizer

SAMPLE_TRANSLATIONS = 4  # (source, reference, translation) triples written as text at each BLEU evaluation


def tokenized_split(tokenizer: Tokenizer, pairs: list[tuple[str, str]], max_length: int
                    ) -> tuple[TokenCache, np.ndarray]:
    """A split's pairs tokenized, and the indices of those within max_length (the pairs an eval loss reads)."""
    cache = TokenCache.tokenize(tokenizer, pairs)
    return cache, data.LengthFilter.of(cache, max_length).kept


def eval_loss(evaluate, params, cache: TokenCache, kept: np.ndarray, data_config: data.DataConfig, rows: int,
              batch_sharding) -> dict[str, float]:
    """The eval step over the pairs `kept` of a cache, packed as training packs them, summed and summarized:
    loss, accuracy, perplexity, target tokens (and a mixture of experts' router stats)."""
    batches = data.eval_batches(cache, kept, max_length=data_config.max_length, rows_per_batch=rows,
                                pack=data_config.pack)
    summary = summarize(jax.device_get([evaluate(params, sharding.place_batch(batch, batch_sharding))
                                        for batch in batches]))
    keys = ("loss", "accuracy", "perplexity", "target_tokens") + tuple(k for k in ROUTER_STATS if k in summary)
    return {key: summary[key] for key in keys}


@dataclasses.dataclass(frozen=True)
class Translations:
    decoded: decode.Decoded  # each sentence's hypotheses, and the inputs cut to the bound
    hypotheses: list[str]  # each sentence's best translation, in input order
    seconds: float  # the decoding's wall time, with the compilation of each new input shape


class Evaluator:
    """One model's evaluation, whatever parameters are passed: the eval step and the search are built once and
    reused for every split and every set of parameters (a run's own at each evaluation, averaged ones at its end).

    `pairs` maps a split to its (source, target) pairs, read on first use (data.SplitPairs); each split is
    tokenized once. The eval loss reads batches of `rows` rows, as training packs them."""

    def __init__(self, settings: Settings, model_config: ModelConfig, graphdef, tokenizer: Tokenizer,
                 batch_sharding, rows: int, pairs: Mapping[str, list[tuple[str, str]]], *, scores: bool = False):
        self.settings, self.tokenizer, self.batch_sharding, self.rows, self.pairs = (settings, tokenizer,
                                                                                  batch_sharding, rows, pairs)
        self.evaluate = jax.jit(functools.partial(eval_step, graphdef=graphdef,
                                                  label_smoothing=settings.train.label_smoothing))
        # encoder_only has no decoder to search with; `scores` scores greedy search's hypothesis too (n-best lists).
        self.search = None if model_config.family == "encoder_only" else settings.decode.search_fn(
            graphdef, settings.seed, scores=scores, model_config=model_config)
        self.input_bound = settings.decode.input_bound(settings.data.max_length, model_config.position_limit)
        self.splits: dict[str, tuple[TokenCache, np.ndarray]] = {}  # split -> its token cache and kept pairs

    @classmethod
    def of(cls, restored, *, scores: bool = False) -> "Evaluator":
        """A restored model's (restore.Restored): its eval loss in batches of the rows its run's plan gives this
        mesh, so that the same tokens are masked as in the run's own evaluation of a split."""
        settings = restored.settings
        rows = plan_batch(settings.data, rows_multiple(settings, restored.mesh.shape))[0].rows
        return cls(settings, restored.model_config, restored.graphdef, restored.tokenizer, restored.batch_sharding,
                   rows, data.SplitPairs(settings.data), scores=scores)

    def loss(self, params, split: str) -> dict[str, float]:
        """The eval step's loss, accuracy and perplexity over a split's pairs within data.max_length (an
        encoder_only model's: of its masked tokens, the same ones at every evaluation: steps.eval_mask_key)."""
        if split not in self.splits:
            self.splits[split] = tokenized_split(self.tokenizer, self.pairs[split], self.settings.data.max_length)
        cache, kept = self.splits[split]
        if not len(kept):
            raise data.DataError(f"every {split} pair is longer than data.max_length={self.settings.data.max_length} "
                                 "tokens")
        return eval_loss(self.evaluate, params, cache, kept, self.settings.data, self.rows, self.batch_sharding)

    def masked_scores(self, params, split: str) -> dict[str, float]:
        """An encoder_only model's scores on a split as eval.py reports them: masked-token loss, accuracy and
        perplexity (`loss`), the masked tokens, and the pairs scored and left out for length."""
        summary = self.loss(params, split)
        kept, pairs = len(self.splits[split][1]), len(self.pairs[split])
        return {"loss": summary["loss"], "accuracy": summary["accuracy"], "perplexity": summary["perplexity"],
                "masked_tokens": summary["target_tokens"], "pairs": kept, "pairs_too_long": pairs - kept}

    def translate(self, params, sentences: list[str], name: str | None) -> Translations:
        """Every sentence decoded (each one finishes: a source past the input bound is cut to it, with one warning
        naming `name`, none when None), in batches of decode.batch_size split over every device."""
        config = self.settings.decode
        start = time.perf_counter()
        decoded = decode.search_sentences(self.search, params, self.tokenizer, sentences, config.batch_size,
                                          self.input_bound, name=name, max_tokens_per_batch=config.max_tokens_per_batch,
                                          batch_sharding=self.batch_sharding)
        seconds = time.perf_counter() - start
        return Translations(decoded, decoded.translations(self.tokenizer), seconds)


class RunEvaluation:
    """What a training run reports of its parameters: the dev loss, dev BLEU (which may save the best checkpoint,
    through `on_dev_bleu(step, bleu)`), and the scores of its end and report marks; each written to the metrics
    (`writer`), the console (`progress`) and, for translations, to workdir/translations_<split>_<prefix>step<N>.txt
    (process 0)."""

    def __init__(self, evaluator: Evaluator, workdir: str, writer: metrics.MetricWriter, progress: metrics.Progress,
                 on_dev_bleu: Callable[[int, float], None]):
        self.evaluator, self.workdir, self.writer, self.progress = evaluator, workdir, writer, progress
        self.on_dev_bleu = on_dev_bleu
        self.warned_cut: set[str] = set()  # the splits whose cut sources have been named in the log

    def loss(self, params, step: int) -> dict[str, float]:
        scores = self.evaluator.loss(params, "valid")
        self.writer.write(step, scores, "valid")
        self.progress.write(f"step {step}: valid loss {scores['loss']:.4f} accuracy {scores['accuracy']:.3f} "
                            f"perplexity {scores['perplexity']:.2f}{router_line(scores)}")
        return scores

    def bleu(self, params, step: int, splits: list[str], train_seconds: float, prefix: str = ""
             ) -> dict[str, dict[str, Any]]:
        """BLEU of each split's translations; the dev set's chooses the best checkpoint (not the averaged
        parameters', `prefix` avg_), the test set's never does."""
        scores = {split: self.split_bleu(params, step, split, prefix) for split in splits}
        if "valid" in scores and not prefix:
            self.on_dev_bleu(step, scores["valid"]["bleu"])
        for split, score in scores.items():
            self.writer.write(step, {"bleu": score["bleu"], "decode_seconds": score["decode_seconds"],
                                     "train_seconds": train_seconds, "inputs_cut": score["inputs_cut"]},
                              f"{prefix}{split}_bleu")
            self.writer.write_samples(step, f"{prefix}{split}_bleu", score.pop("samples"))
            self.progress.write(f"step {step}: {prefix}{split} BLEU {score['bleu']:.2f} ({score['signature']}), "
                                f"decoded in {score['decode_seconds']:.1f}s")
        return scores

    def split_bleu(self, params, step: int, split: str, prefix: str) -> dict[str, Any]:
        sources, references = zip(*self.evaluator.pairs[split])
        # A source past the bound is cut, so that evaluation always finishes; said once per split and run.
        translated = self.evaluator.translate(params, list(sources), None if split in self.warned_cut else split)
        self.warned_cut.add(split)
        hypotheses = translated.hypotheses
        score = metrics.bleu(hypotheses, list(references), target_lang=self.evaluator.settings.data.target_lang)
        score.update(inputs_cut=translated.decoded.cut, decode_seconds=translated.seconds,
                     samples=list(zip(sources, references, hypotheses))[:SAMPLE_TRANSLATIONS])
        if jax.process_index() == 0:
            path = os.path.join(self.workdir, f"translations_{split}_{prefix}step{step}.txt")
            files.write_text(path, "".join(h + "\n" for h in hypotheses))
        return score

    def masked(self, params, step: int, splits: list[str], prefix: str) -> dict[str, dict[str, float]]:
        """encoder_only's scores in place of BLEU: masked-token accuracy and perplexity on each split."""
        scores = {}
        for split in splits:
            scores[split] = self.evaluator.loss(params, split)
            self.writer.write(step, scores[split], f"{prefix}{split}_masked")
            self.progress.write(f"step {step}: {prefix}{split} masked accuracy {scores[split]['accuracy']:.3f} "
                                f"perplexity {scores[split]['perplexity']:.2f} over {scores[split]['target_tokens']:.0f} "
                                "masked tokens")
        return scores

    def final(self, params, averaged: list[int], step: int, train_seconds: float) -> dict[str, Any]:
        """What the end of the run reports, also at each train.report_minutes mark: `params` (the mean of the last
        checkpoints of `averaged` steps, or the final ones), scored on decode.bleu_splits. Nothing here feeds back
        into training, so scoring the test split at a mark is as safe as at the end."""
        prefix = "avg_" if averaged else ""
        splits = self.evaluator.settings.decode.splits
        report = {"step": step, "train_seconds": train_seconds, "averaged_steps": averaged}
        if self.evaluator.search is None:
            return {**report, "masked": self.masked(params, step, splits, prefix)}
        return {**report, "bleu": self.bleu(params, step, splits, train_seconds, prefix)}


def router_line(summary: dict[str, float]) -> str:
    """A mixture of experts' part of a log line: its router losses, the share of assignments dropped for capacity
    and the busiest expert's load (1: balanced); empty without one."""
    if "router_balance" not in summary:
        return ""
    return (f"; experts: dropped {summary['expert_dropped']:.3f} load_max {summary['expert_load_max']:.2f} "
            f"balance {summary['router_balance']:.3f} z {summary['router_z']:.3f}")
