"""Translate from the command line with a trained workdir: the model is loaded and compiled once, sentences
are read from stdin (or --input), translated in batches of --batch_size lines, and written one per line.

    echo "The black cat sleeps." | python -m transformer.translate --workdir=runs/demo
    python -m transformer.translate --workdir=runs/base --average_last=5 --input=src.en --output=hyp.de
    python -m transformer.translate --workdir=runs/base --nbest=4 --input=src.en --output=hyp.nbest

An empty line gives an empty line, and N lines in give N lines out. Text is read as training reads it (a byte
order mark and CR dropped); invalid UTF-8 in --input is an error naming its line, and on stdin it is replaced with
U+FFFD and its lines counted in a warning, so no valid line is lost. An input longer than the bound (the run's data.max_length, capped by a
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
from collections.abc import Iterable, Iterator
from typing import TextIO

from absl import app, flags

import jax

from transformer import batching, cli, console, decode, errors, files, sharding, sources
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


def chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    lines = iter(lines)
    while chunk := list(itertools.islice(lines, size)):
        yield chunk


def one_line(text: str) -> str:
    """A translation as one output line: a newline the vocabulary can spell would break N lines in, N out."""
    return " ".join(text.splitlines()) if "\n" in text or "\r" in text else text


def translate_stream(restored: Restored, lines: Iterable[str], out: TextIO, batch_size: int, nbest: int = 0,
                     name: str = "stdin") -> int:
    """Translate every line of `lines` (sources.decode_lines' text) into `out`, a batch at a time (batch_size rounded up to whole rows per
    device); with nbest, write each line's n-best list instead. Inputs longer than the bound are cut, with one
    warning at the end naming `name` and the lines. Returns the number of lines."""
    count = 0
    for chunk, written in translated_batches(restored, lines, batch_size, nbest, name):
        if jax.process_index() == 0:  # every process holds every translation
            out.writelines(line + "\n" for line in written)
            out.flush()
        count += len(chunk)
    return count


def translated_batches(restored: Restored, lines: Iterable[str], batch_size: int, nbest: int = 0,
                       name: str = "stdin", start: int = 0) -> Iterator[tuple[list[str], list[str]]]:
    """(input lines, output lines) a batch at a time, every process getting all of them; `start`: the lines
    before `lines` (a resumed job's), which number the n-best lists and pin sampling's call index to
    start // rows + batch, so a job resumed at a batch boundary samples as if it had never stopped."""
    settings = restored.settings.decode
    search = settings.search_fn(restored.graphdef, restored.settings.seed, scores=nbest > 0,
                                model_config=restored.model_config)
    bound = restored.input_bound
    batch_sharding = restored.batch_sharding
    rows, count, cut_lines = batching.device_rows(batch_size, batch_sharding), start, []
    for chunk in chunks(lines, rows):
        decoded = decode.search_sentences(search, restored.params, restored.tokenizer, chunk, rows, bound,
                                          name=None, max_tokens_per_batch=settings.max_tokens_per_batch,
                                          batch_sharding=batch_sharding, call=count // rows)
        if nbest:
            written = decode.nbest_lines(decoded.nbest(nbest), restored.tokenizer, first_index=count)
        else:
            written = [one_line(text) for text in decoded.translations(restored.tokenizer)]
        yield chunk, written
        cut_lines += [count + line for line in decoded.cut_lines]
        count += len(chunk)
    batching.warn_cut(name, cut_lines, count - start, bound)


def main(argv):
    if len(argv) > 1:
        raise errors.ConfigError(f"unexpected arguments {argv[1:]}: every option is a --flag=value")
    console.route_libraries()  # absl's records (orbax, grain, the data pipeline) in the console's format
    files.check_storage(FLAGS.workdir, "--workdir")
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
    # Read as bytes and decoded as training reads text: a file's invalid UTF-8 is an error naming its line; on
    # stdin, where stopping would lose the lines already read, it is replaced (U+FFFD) and counted.
    source = files.open_file(FLAGS.input, "rb") if FLAGS.input else sys.stdin.buffer
    replaced: list[int] | None = None if FLAGS.input else []
    out = files.open_file(FLAGS.output, "w") if FLAGS.output and jax.process_index() == 0 else sys.stdout
    try:
        name = FLAGS.input or "stdin"
        translate_stream(restored, sources.decode_lines(name, source, replaced), out,
                         restored.settings.decode.batch_size, FLAGS.nbest, name)
    finally:
        for handle in (source, out):
            if handle not in (sys.stdin.buffer, sys.stdout):
                handle.close()
    if replaced:
        shown = ", ".join(map(str, replaced[:10])) + (", ..." if len(replaced) > 10 else "")
        console.log.warning("stdin: %d line(s) held invalid UTF-8, translated with U+FFFD in its place: line(s) %s",
                            len(replaced), shown)


if __name__ == "__main__":
    app.run(errors.main_with_messages(main))
