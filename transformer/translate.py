"""Translate from the command line with a trained workdir: the model is loaded and compiled once, sentences
are read from stdin (or --input), translated in batches of --batch_size lines, and written one per line.

    echo "The black cat sleeps." | python -m transformer.translate --workdir=runs/demo
    python -m transformer.translate --workdir=runs/base --average_last=5 --input=src.en --output=hyp.de
    python -m transformer.translate --workdir=runs/base --nbest=4 --input=src.en --output=hyp.nbest

An empty line gives an empty line. An input longer than a learned-position model's table is truncated to it
with a warning (sinusoidal positions have no limit). Output lines stay aligned with input lines (with --nbest,
each hypothesis is a line of Moses' n-best format, `index ||| translation ||| LogProb= log P ||| score`, the
index counting input lines from 0). Every decoding flag left unset takes the workdir config's decode value, as
in eval.py. Each batch is split over every device (transformer/decode.py).
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
flags.DEFINE_integer("average_last", None, "Average the parameters of the last N checkpoints up to --step "
                     "(default: the config's decode.average_last, none with --best; 0 or 1: no averaging).")
flags.DEFINE_bool("best", False, "Use the checkpoint of the best dev BLEU (workdir/best_checkpoint).")
flags.DEFINE_integer("beam_size", None, "Beam size (default: the config's decode.beam_size; 1 = greedy).")
flags.DEFINE_float("alpha", None, "Length penalty alpha of beam search (default: the config's decode.alpha).")
flags.DEFINE_enum("length_penalty", None, list(decode.PENALTIES), "gnmt: ((5 + length) / 6)^alpha; fairseq: "
                  "length^alpha (default: the config's decode.length_penalty).")
flags.DEFINE_integer("max_extra_length", None, "Outputs may have up to input length + this many tokens "
                     "(default: the config's decode.max_extra_length).")
flags.DEFINE_integer("batch_size", None, "Lines translated together, rounded up to whole rows per device; output "
                     "is written after each batch (default: the config's decode.batch_size).")
flags.DEFINE_integer("nbest", 0, "Write the N best hypotheses of each line (N <= beam size) in Moses' n-best "
                     "format instead of the translations (0: the best translation only).")
flags.DEFINE_string("input", None, "A file of source sentences, one per line (default: stdin).")
flags.DEFINE_string("output", None, "Where to write the translations (default: stdout).")
FLAGS = flags.FLAGS


def chunks(lines: TextIO, size: int) -> Iterator[list[str]]:
    while chunk := [line.rstrip("\n") for line in itertools.islice(lines, size)]:
        yield chunk


def translate_stream(restored: trainer.Restored, lines: TextIO, out: TextIO, batch_size: int, nbest: int = 0) -> int:
    """Translate every line of `lines` into `out`, a batch at a time (batch_size rounded up to whole rows per
    device); with nbest, write each line's n-best list instead. Returns the number of lines."""
    search = restored.settings.decode.search_fn(restored.graphdef, restored.settings.seed, scores=nbest > 0)
    batch_sharding = restored.batch_sharding
    rows, count = decode.rows_per_batch(batch_size, batch_sharding), 0
    for chunk in chunks(lines, rows):
        args = (search, restored.params, restored.tokenizer, chunk, rows, restored.model_config.position_limit)
        if nbest:
            found = decode.search_nbest(*args, nbest=nbest, batch_sharding=batch_sharding)
            written = decode.nbest_lines(found, restored.tokenizer, first_index=count)
        else:
            written = decode.translate(*args, batch_sharding=batch_sharding)
        out.writelines(line + "\n" for line in written)
        out.flush()
        count += len(chunk)
    return count


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    try:
        restored = trainer.restore_for_command_line(
            FLAGS.workdir, FLAGS.step, average_last=FLAGS.average_last, best=FLAGS.best, nbest=FLAGS.nbest,
            **{name: FLAGS[name].value for name in decode.COMMAND_LINE_OVERRIDES})
    except ValueError as error:
        raise app.UsageError(str(error)) from error
    source = open(FLAGS.input, encoding="utf-8") if FLAGS.input else sys.stdin
    out = open(FLAGS.output, "w", encoding="utf-8") if FLAGS.output else sys.stdout
    try:
        translate_stream(restored, source, out, restored.settings.decode.batch_size, FLAGS.nbest)
    finally:
        for handle in (source, out):
            if handle not in (sys.stdin, sys.stdout):
                handle.close()


if __name__ == "__main__":
    app.run(main)
