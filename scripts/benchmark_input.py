"""How fast the training input pipeline delivers packed batches, and how much of them is padding.

    PYTHONPATH=. python scripts/benchmark_input.py --text_dir=$DATA/europarl-20k --workdir=$SCRATCH/bench

Reads a line-aligned corpus (e.g. a 20k-pair Europarl v7 sample of WMT14 en-de training data), trains a
sentencepiece vocabulary (once, in --workdir), tokenizes it into the token cache (timed, with each worker
count), then draws --num_batches packed batches of the base config's shape (rows of --max_length,
--tokens_per_batch per step) with each worker count, and again as a data.mixture of --mixture_sources equal parts of
the corpus (the mixture's cost: gathering each chunk's pairs from several sources). Per core = tokens / CPU seconds of the process and its
workers (so it does not depend on how busy the machine's other cores are). One H200 training the base model
at 40% MFU consumes about 1.1M target tokens/s: the last line says how many cores that takes.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer import data, mixture, sources, token_cache  # noqa: E402

flags.DEFINE_string("text_dir", None, "Folder of the corpus.", required=True)
flags.DEFINE_string("prefix", "europarl-v7-first20k", "File prefix: <prefix>.<lang> in --text_dir.")
flags.DEFINE_string("source_lang", "en", "Source language.")
flags.DEFINE_string("target_lang", "de", "Target language.")
flags.DEFINE_string("workdir", None, "Where the vocabulary and token cache go.", required=True)
flags.DEFINE_integer("vocab_size", 8000, "Sentencepiece vocabulary size.")
flags.DEFINE_integer("max_length", 256, "Tokens per packed row (base.py: 256).")
flags.DEFINE_integer("tokens_per_batch", 25_600, "Token budget per step (base.py: 25600 = 100 rows).")
flags.DEFINE_integer("num_batches", 200, "Batches drawn per measurement.")
flags.DEFINE_list("workers", ["0", "1", "2"], "grain worker counts to measure.")
flags.DEFINE_integer("copies", 1, "Tokenize this many copies of the corpus (amortizes worker start-up).")
flags.DEFINE_integer("mixture_sources", 3, "Also draw the batches as a data.mixture of this many equal-weight sources "
                     "(the corpus cut in as many parts), against one source: the mixture's overhead (0: not).")
flags.DEFINE_string("output", "", "Also write the results as JSON here.")
FLAGS = flags.FLAGS
H200_TARGET_TOKENS_PER_SECOND = 1.1e6


def cpu_seconds() -> float:
    """CPU time of this process and its finished (waited-for) children, e.g. grain workers."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure_cache(pairs, tokenizer, workers: int) -> dict:
    directory = os.path.join(FLAGS.workdir, f"cache_w{workers}")
    shutil.rmtree(directory, ignore_errors=True)
    wall, cpu = time.perf_counter(), cpu_seconds()
    cache = token_cache.TokenCache.build(pairs, tokenizer.path, directory, num_workers=workers)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    tokens = int(cache.lengths("targets").sum())
    return {"stage": "tokenize into cache", "workers": workers, "pairs": len(pairs), "target_tokens": tokens,
            "seconds": wall, "target_tokens_per_second": tokens / wall, "cpu_seconds": cpu,
            "target_tokens_per_cpu_second": tokens / cpu}


def measure_batches(cache, kept, workers: int, sources: int = 1) -> dict:
    """Packed batches of the kept pairs: one source, or `sources` equal parts of them as a weighted mixture."""
    rows = FLAGS.tokens_per_batch // FLAGS.max_length
    common = dict(seed=0, max_length=FLAGS.max_length, rows_per_batch=rows, num_workers=workers)
    if sources == 1:
        iterator = iter(data.train_dataset(cache, kept, **common))
    else:
        parts = [mixture.Source(f"part{i}", 1.0, cache, part) for i, part in enumerate(np.array_split(kept, sources))]
        iterator = iter(mixture.train_dataset(parts, **common))
    next(iterator)  # worker start-up is a one-off, not throughput
    wall, cpu = time.perf_counter(), cpu_seconds()
    stats = []
    for _ in range(FLAGS.num_batches):
        batch = next(iterator)
        stats.append({**data.packing_stats(batch), "target_tokens": int((batch["targets_segmentation"] > 0).sum()),
                      "source_tokens": int((batch["inputs_segmentation"] > 0).sum())})
    wall = time.perf_counter() - wall
    if hasattr(iterator, "close"):
        iterator.close()  # reaps the workers, so their CPU time is counted
    cpu = cpu_seconds() - cpu
    target_tokens = sum(s["target_tokens"] for s in stats)
    return {"stage": "packed batches" if sources == 1 else f"mixture of {sources}", "workers": workers,
            "sources": sources, "batches": len(stats), "rows": rows,
            "max_length": FLAGS.max_length, "seconds": wall, "target_tokens": target_tokens,
            "target_tokens_per_second": target_tokens / wall,
            "source_tokens_per_second": sum(s["source_tokens"] for s in stats) / wall,
            "cpu_seconds": cpu, "target_tokens_per_cpu_second": target_tokens / cpu,
            "targets_padding": float(np.mean([s["targets_padding"] for s in stats])),
            "inputs_padding": float(np.mean([s["inputs_padding"] for s in stats])),
            "pairs_per_batch": float(np.mean([s["pairs"] for s in stats]))}


def main(argv):
    del argv
    flags.FLAGS.mark_as_parsed()
    os.makedirs(FLAGS.workdir, exist_ok=True)
    base = os.path.join(FLAGS.text_dir, FLAGS.prefix)
    pairs = list(sources.iter_text_pair(f"{base}.{FLAGS.source_lang}", f"{base}.{FLAGS.target_lang}"))
    config = data.DataConfig(vocab_size=FLAGS.vocab_size, max_length=FLAGS.max_length,
                             tokens_per_batch=FLAGS.tokens_per_batch)
    tokenizer = data.load_or_train_tokenizer(config, pairs, FLAGS.workdir, process_index=0)
    results = [measure_cache(pairs * FLAGS.copies, tokenizer, int(w)) for w in FLAGS.workers]
    cache = data.load_or_build_token_cache(pairs, tokenizer, FLAGS.workdir, "train", process_index=0)
    length_filter = data.LengthFilter.of(cache, FLAGS.max_length)
    print(f"{len(cache)} pairs, {length_filter.too_long} longer than {FLAGS.max_length} tokens dropped; "
          f"mean target length {cache.lengths('targets').mean():.1f} tokens; {os.cpu_count()} cores")
    results += [measure_batches(cache, length_filter.kept, int(w)) for w in FLAGS.workers]
    if FLAGS.mixture_sources > 1:
        results += [measure_batches(cache, length_filter.kept, int(w), FLAGS.mixture_sources) for w in FLAGS.workers]
    for result in results:
        line = (f"{result['stage']:<20} workers={result['workers']}: {result['target_tokens_per_second']:>10,.0f} "
                f"target tokens/s per process, {result['target_tokens_per_cpu_second']:>10,.0f} per CPU-second")
        if "targets_padding" in result:
            line += (f", padding {100 * result['targets_padding']:.2f}% of target / "
                     f"{100 * result['inputs_padding']:.2f}% of source positions")
        print(line)
    one = {r["workers"]: r for r in results if r["stage"] == "packed batches"}
    for result in results:
        if result.get("sources", 1) > 1:
            print(f"mixture of {result['sources']} / one source, workers={result['workers']}: "
                  f"{result['target_tokens_per_cpu_second'] / one[result['workers']]['target_tokens_per_cpu_second']:.3f}"
                  " of the target tokens per CPU-second")
    best = max(r["target_tokens_per_cpu_second"] for r in results if r["stage"] == "packed batches")
    print(f"one H200 at 1.1M target tokens/s needs {H200_TARGET_TOKENS_PER_SECOND / best:.2f} cores of packing "
          f"(at {best:,.0f} target tokens per CPU-second), once the cache is built")
    if FLAGS.output:
        with open(FLAGS.output, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    app.run(main)
