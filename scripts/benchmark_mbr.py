"""MBR decoding's two costs, apart: the device drawing N candidates per sentence, and the host's utility matrix
(transformer/mbr.py), for each N, on the first sentences of a trained workdir's split.

    python scripts/benchmark_mbr.py --workdir=runs/multi30k --split=valid --sentences=200 --candidates=8,16,32,64

Prints one JSON line per (N, utility): sentences, candidates, the device's seconds (compilation apart, timed on a
second pass), the host ranking's seconds, the mean number of distinct candidates per sentence, and the host's
share of the total when the two run one after the other (search_sentences overlaps them batch by batch).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_string("workdir", None, "A directory written by train.py.", required=True)
flags.DEFINE_string("split", "valid", "The run's split whose sources are decoded.")
flags.DEFINE_integer("sentences", 200, "The first this many sentences of the split.")
flags.DEFINE_list("candidates", ["8", "16", "32", "64"], "The N to measure.")
flags.DEFINE_list("utilities", ["chrf", "bleu"], "The utilities to time.")
flags.DEFINE_float("epsilon", 0.02, "Epsilon sampling's threshold for the candidates.")
FLAGS = flags.FLAGS


def draw(search, restored, sentences: list[str], count: int, bound: int):
    """search_sentences without a utility: each sentence's candidates in the device's order -> (them, seconds)."""
    from transformer import decode

    settings = restored.settings.decode
    # The batches of decode.search=mbr: search_sentences divides them only for a search with a utility.
    rows, max_tokens = decode.candidate_batches(settings.batch_size, settings.max_tokens_per_batch, count)
    start = time.perf_counter()
    found = decode.search_sentences(search, restored.params, restored.tokenizer, sentences, rows, bound,
                                    name=None, max_tokens_per_batch=max_tokens, call=0)
    return found, time.perf_counter() - start


def main(argv):
    del argv
    from transformer import data, decode, mbr
    from transformer.restore import restore

    restored = restore(FLAGS.workdir)
    settings = restored.settings.decode
    sentences = [source for source, _ in data.SplitPairs(restored.settings.data)[FLAGS.split]][:FLAGS.sentences]
    bound = settings.input_bound(restored.settings.data.max_length, restored.model_config.position_limit)
    for count in map(int, FLAGS.candidates):
        search = decode.make_search(restored.graphdef, max_extra_length=settings.max_extra_length, temperature=1.0,
                                    epsilon=FLAGS.epsilon, seed=restored.settings.seed, candidates=count)
        _, first = draw(search, restored, sentences, count, bound)  # compiles each batch shape
        found, device_seconds = draw(search, restored, sentences, count, bound)
        texts = [[restored.tokenizer.decode(h.ids) for h in hypotheses] for hypotheses in found.hypotheses]
        for utility in FLAGS.utilities:
            start = time.perf_counter()
            for candidates in texts:
                if candidates:
                    mbr.ranking(candidates, utility)
            host_seconds = time.perf_counter() - start
            print(json.dumps({
                "candidates": count, "utility": utility, "sentences": len(sentences),
                "device_seconds": round(device_seconds, 3), "compile_and_first_seconds": round(first, 3),
                "host_seconds": round(host_seconds, 3),
                "distinct_per_sentence": round(sum(len(set(c)) for c in texts) / max(1, len(texts)), 2),
                "host_share": round(host_seconds / (host_seconds + device_seconds), 3)}), flush=True)


if __name__ == "__main__":
    app.run(main)
