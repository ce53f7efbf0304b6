"""BLEU by source length: one test set's translations from several runs, scored on groups of sentences cut by the
source's length in tokens (sentencepiece pieces + EOS: what data.max_length counts), so that a run trained on short
sentences shows how it does past its training lengths.

    python scripts/bleu_by_length.py --source=$DATA/multi30k/test2016.en --reference=$DATA/multi30k/test2016.de \
        --vocab=W/dense/vocab.model --edges=16,20,24 --target_lang=de \
        --run=dense=W/dense/translations_test_step900.txt --run=hybrid=W/hybrid/translations_test_step800.txt

Prints a Markdown table: per group its sentence count and each run's sacreBLEU (the project's signature), with the
whole set last. Groups are (0, e1], (e1, e2], ..., (e_last, inf); an empty one is left out.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from transformer import metrics, sources  # noqa: E402
from transformer.tokenizer import Tokenizer  # noqa: E402

flags.DEFINE_string("source", None, "The source side, one sentence per line.", required=True)
flags.DEFINE_string("reference", None, "The reference translations, line-aligned with --source.", required=True)
flags.DEFINE_string("vocab", None, "The sentencepiece model whose pieces measure a source's length.", required=True)
flags.DEFINE_list("edges", ["16", "20", "24"], "Upper bounds (tokens, EOS included) of the groups but the last.")
flags.DEFINE_multi_string("run", [], "NAME=FILE: a run's translations, line-aligned with --source (repeatable).")
flags.DEFINE_string("target_lang", None, "The target language, for BLEU's tokenizer (as data.target_lang).")
FLAGS = flags.FLAGS


def read(path: str) -> list[str]:
    with open(path, "rb") as file:
        return list(sources.decode_lines(path, file))


def groups(lengths: list[int], edges: list[int]) -> list[tuple[str, list[int]]]:
    """(label, line indices) per length group, in order; empty groups dropped."""
    bounds = [0, *edges, None]
    found = []
    for low, high in zip(bounds, bounds[1:]):
        members = [i for i, n in enumerate(lengths) if n > low and (high is None or n <= high)]
        if members:
            found.append((f"{low + 1}-{high}" if high is not None else f"{low + 1}+", members))
    return found


def main(argv):
    del argv
    sources_, references = read(FLAGS.source), read(FLAGS.reference)
    if len(sources_) != len(references):
        sys.exit(f"error: {FLAGS.source} has {len(sources_)} lines and {FLAGS.reference} {len(references)}")
    runs = {}
    for spec in FLAGS.run:
        name, separator, path = spec.partition("=")
        if not separator or not name:
            sys.exit(f"error: --run={spec!r} must be NAME=FILE")
        runs[name] = read(path)
        if len(runs[name]) != len(sources_):
            sys.exit(f"error: {path} has {len(runs[name])} lines; {FLAGS.source} has {len(sources_)}")
    if not runs:
        sys.exit("error: give at least one --run=NAME=FILE")
    lengths = [len(ids) for ids in Tokenizer(FLAGS.vocab).encode(sources_)]
    edges = sorted({int(edge) for edge in FLAGS.edges})
    if not edges or edges[0] < 1:
        sys.exit(f"error: --edges={','.join(FLAGS.edges)} must be token counts >= 1")
    rows = groups(lengths, edges) + [("all", list(range(len(sources_))))]
    print("| source tokens | sentences | " + " | ".join(runs) + " |")
    print("|---|---:|" + "---:|" * len(runs))
    for label, members in rows:
        cells = []
        for hypotheses in runs.values():
            score = metrics.bleu([hypotheses[i] for i in members], [references[i] for i in members],
                                 target_lang=FLAGS.target_lang)
            cells.append(f"{score['bleu']:.2f}")
        print(f"| {label} | {len(members)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    app.run(main)
