"""Translate from the command line with a trained workdir: the model is loaded and compiled once, sentences
are read from stdin (or --input), translated in batches of --batch_size lines, and written one per line.

    echo "The black cat sleeps." | python -m transformer.translate --workdir=runs/demo
    python -m transformer.translate --workdir=runs/base --average_last=5 --input=src.en --output=hyp.de
    python -m transformer.translate --workdir=runs/base --nbest=4 --input=src.en --output=hyp.nbest

An empty line gives an empty line. An input longer than the bound (the run's data.max_length, capped by a
learned-position table; decode.max_input_length sets another) is cut to it, keeping its EOS, and one warning at
the end names the lines cut; batches hold at most decode.max_tokens_per_batch lines x padded length. Output lines stay aligned with input lines (with --nbest,
each hypothesis is a line of Moses' n-best format, `index ||| translation ||| LogProb= log P ||| score`, the
index counting input lines from 0). Every decoding flag left unset takes the workdir config's decode value, as
in eval.py. Each batch is split over every device (transformer/decode.py). Exit status: 0 done, 1 an error printed
as `error: <message>` (--traceback for its traceback).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from typing import TextIO

from absl import app, flags

import jax

from transformer import cli, console, decode, errors, files, sharding
from transformer.restore import Restored, workdir_family

cli.define_command_line_flags("lines")
flags.adopt_module_key_flags(cli)
flags.DEFINE_integer("batch_size", None, "Lines translated together, rounded up to whole rows per device; output "
                     "is written after each batch (default: the config's decode.batch_size).")
flags.DEFINE_integer("nbest", 0, "Write the N best hypotheses of each line (N <= beam size) in Moses' n-best "
                     "format instead of the translations (0: the best translation only).")
flags.DEFINE_string("input", None, "A file of source sentences, one per line (default: stdin).")
flags.DEFINE_string("output", None, "Where to write the translations (default: stdout).")
sharding.define_distributed_flags()  # several hosts: each decodes its share of every batch, process 0 writes
flags.adopt_module_key_flags(sharding)
FLAGS = flags.FLAGS


def chunks(lines: TextIO, size: int) -> Iterator[list[str]]:
    while chunk := [line.rstrip("\n") for line in itertools.islice(lines, size)]:
        yield chunk


def translate_stream(restored: Restored, lines: TextIO, out: TextIO, batch_size: int, nbest: int = 0,
                     name: str = "stdin") -> int:
    """Translate every line of `lines` into `out`, a batch at a time (batch_size rounded up to whole rows per
    device); with nbest, write each line's n-best list instead. Inputs longer than the bound are cut, with one
    warning at the end naming `name` and the lines. Returns the number of lines."""
    settings = restored.settings.decode
    search = settings.search_fn(restored.graphdef, restored.settings.seed, scores=nbest > 0)
    bound = restored.input_bound
    batch_sharding = restored.batch_sharding
    rows, count, cut_lines = decode.device_rows(batch_size, batch_sharding), 0, []
    for chunk in chunks(lines, rows):
        decoded = decode.search_sentences(search, restored.params, restored.tokenizer, chunk, rows, bound,
                                          name=None, max_tokens_per_batch=settings.max_tokens_per_batch,
                                          batch_sharding=batch_sharding)
        if nbest:
            written = decode.nbest_lines(decoded.nbest(nbest), restored.tokenizer, first_index=count)
        else:
            written = decoded.translations(restored.tokenizer)
        if jax.process_index() == 0:  # every process holds every translation
            out.writelines(line + "\n" for line in written)
            out.flush()
        cut_lines += [count + line for line in decoded.cut_lines]
        count += len(chunk)
    decode.warn_cut(name, cut_lines, count, bound)
    return count


def main(argv):
    if len(argv) > 1:
        raise errors.ConfigError(f"unexpected arguments {argv[1:]}: every option is a --flag=value")
    console.route_libraries()  # absl's records (orbax, grain, the data pipeline) in the console's format
    sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    if jax.process_count() > 1 and not FLAGS.input:
        raise errors.ConfigError("several processes read the same lines: give them --input (a file), not stdin")
    with errors.as_config_error():  # a bad flag or saved setting is named before anything is restored
        if workdir_family(FLAGS.workdir) == "encoder_only":
            raise ValueError(f"{FLAGS.workdir} holds an encoder_only model, which has no decoder to translate with "
                             "(eval.py scores its masked tokens; transformer.features gives its encoder's outputs)")
        restored = cli.restore_for_command_line(
            FLAGS.workdir, FLAGS.step, average_last=FLAGS.average_last, best=FLAGS.best, nbest=FLAGS.nbest,
            **{name: FLAGS[name].value for name in cli.COMMAND_LINE_OVERRIDES})
    source = files.open_file(FLAGS.input) if FLAGS.input else sys.stdin
    out = files.open_file(FLAGS.output, "w") if FLAGS.output and jax.process_index() == 0 else sys.stdout
    try:
        translate_stream(restored, source, out, restored.settings.decode.batch_size, FLAGS.nbest,
                         FLAGS.input or "stdin")
    finally:
        for handle in (source, out):
            if handle not in (sys.stdin, sys.stdout):
                handle.close()


if __name__ == "__main__":
    app.run(errors.main_with_messages(main))
