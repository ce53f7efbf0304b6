"""Translate from the command line with a trained workdir: the model is loaded and compiled once, sentences
are read from stdin (or --input), translated in batches of --batch_size lines, and written one per line.

    echo "The black cat sleeps." | python -m transformer.translate --workdir=runs/demo
    python -m transformer.translate --workdir=runs/base --average_last=5 --input=src.en --output=hyp.de

An empty line gives an empty line. An input longer than a learned-position model's table is truncated to it
with a warning (sinusoidal positions have no limit). Output lines stay aligned with input lines.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from typing import TextIO

from absl import app, flags, logging

from transformer import decode, trainer

flags.DEFINE_string("workdir", None, "A directory written by train.py.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step to restore (default: the latest).")
flags.DEFINE_integer("average_last", 0, "Average the parameters of the last N checkpoints up to --step.")
flags.DEFINE_bool("best", False, "Use the checkpoint of the best dev BLEU (workdir/best_checkpoint).")
flags.DEFINE_integer("beam_size", None, "Beam size (default: the config's decode.beam_size; 1 = greedy).")
flags.DEFINE_float("alpha", None, "Length penalty alpha (default: the config's decode.alpha).")
flags.DEFINE_integer("batch_size", 64, "Lines translated together (output is written after each batch).")
flags.DEFINE_string("input", None, "A file of source sentences, one per line (default: stdin).")
flags.DEFINE_string("output", None, "Where to write the translations (default: stdout).")
FLAGS = flags.FLAGS


def chunks(lines: TextIO, size: int) -> Iterator[list[str]]:
    while chunk := [line.rstrip("\n") for line in itertools.islice(lines, size)]:
        yield chunk


def translate_stream(restored: trainer.Restored, lines: TextIO, out: TextIO, batch_size: int) -> int:
    """Translate every line of `lines` into `out`, `batch_size` at a time; returns the number of lines."""
    search, count = restored.search_fn(), 0
    for chunk in chunks(lines, batch_size):
        for translation in decode.translate(search, restored.params, restored.tokenizer, chunk, batch_size,
                                            restored.model_config.position_limit):
            out.write(translation + "\n")
        out.flush()
        count += len(chunk)
    return count


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.batch_size <= 0:
        raise app.UsageError(f"--batch_size={FLAGS.batch_size} must be positive")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    restored = trainer.restore(FLAGS.workdir, FLAGS.step, average_last=FLAGS.average_last, best=FLAGS.best,
                               decode_overrides={"beam_size": FLAGS.beam_size, "alpha": FLAGS.alpha})
    source = open(FLAGS.input, encoding="utf-8") if FLAGS.input else sys.stdin
    out = open(FLAGS.output, "w", encoding="utf-8") if FLAGS.output else sys.stdout
    try:
        translate_stream(restored, source, out, FLAGS.batch_size)
    finally:
        for handle in (source, out):
            if handle not in (sys.stdin, sys.stdout):
                handle.close()


if __name__ == "__main__":
    app.run(main)
