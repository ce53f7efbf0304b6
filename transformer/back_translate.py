"""Back-translation (Sennrich et al. 2016): a monolingual text translated by a reverse-direction workdir into a
text folder that a training mixture reads as a synthetic source (data.mixture's `synthetic:DIR`).

    python -m transformer.back_translate --workdir=runs/multi30k_de_en --input=mono.de --output_dir=runs/bt_de \
        --temperature=1                 # unrestricted sampling, Edunov et al. 2018's best; --beam_size=4: beam

The reverse model translates from its source language (the monolingual text's) into its target language. The
folder gets `{split}.{target_lang}`, the translations (the synthetic side, the forward model's source), and
`{split}.{source_lang}`, the input lines themselves (the real side), line-aligned: N lines in, N lines out (an empty
line gives an empty pair, which training skips), and `back_translation.json`, what made them (workdir, checkpoint,
decoding settings, input, lines done, sentences per second). Decoding is sharded over devices and hosts as
transformer.translate's is (the same flags). Resumable by line: a restart with the same flags keeps the lines
both files already hold whole (a kill mid-write leaves a partial line or one file a batch ahead; both are cut back
to the lines complete in both) and goes on from there; sampling's keys depend on the line's batch, so a job
resumed at a batch boundary writes what an uninterrupted one would have. The folder must be on a local or mounted
file system: the files are appended to and truncated.
"""

from __future__ import annotations

import itertools
import json
import os
import time

from absl import app, flags

import jax

from transformer import console, errors, files, sharding, sources, translate
from transformer.cli import COMMAND_LINE_OVERRIDES, restore_for_command_line
from transformer.restore import workdir_family

flags.DEFINE_string("output_dir", None, "The text folder written: {split}.{source and target language of the "
                    "reverse workdir} and back_translation.json.")
flags.DEFINE_string("split", "train", "The files' stem, as data.train_split names a text folder's training files.")
FLAGS = flags.FLAGS
MANIFEST = "back_translation.json"


def complete_lines(path: str) -> int:
    """The number of newline-terminated lines of `path` (0 if it does not exist)."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as handle:
        return sum(block.count(b"\n") for block in iter(lambda: handle.read(1 << 20), b""))


def cut_to(path: str, lines: int) -> None:
    """Truncate `path` (made if missing) after its first `lines` lines: what a killed job wrote past them."""
    with open(path, "ab+") as handle:
        handle.seek(0)
        position = sum(len(handle.readline()) for _ in range(lines))
        handle.truncate(position)


def output_paths(output_dir: str, split: str, source_lang: str, target_lang: str) -> tuple[str, str]:
    """(The translations' file, the inputs' copy): the forward model's source and target files."""
    return os.path.join(output_dir, f"{split}.{target_lang}"), os.path.join(output_dir, f"{split}.{source_lang}")


def resume_point(paths: tuple[str, str], is_writer: bool) -> int:
    """The lines already done: complete in both files; the writer cuts both back to them. Every process counts
    before its first batch, which no process finishes without the others, so none sees the writer's new lines."""
    done = min(complete_lines(path) for path in paths)
    if is_writer:
        for path in paths:
            cut_to(path, done)
    return done


def write_manifest(output_dir: str, record: dict) -> None:
    temporary = os.path.join(output_dir, MANIFEST + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
    os.replace(temporary, os.path.join(output_dir, MANIFEST))


def back_translate(restored, workdir: str, input_path: str, output_dir: str, split: str, batch_size: int) -> dict:
    """Translate input_path's lines not yet done into output_dir (module docstring); returns the manifest."""
    data = restored.settings.data
    paths = output_paths(output_dir, split, data.source_lang, data.target_lang)
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(output_dir, exist_ok=True)
    done = resume_point(paths, writer)
    decoding = {key: getattr(restored.settings.decode, key) for key in
                ("search", "beam_size", "alpha", "temperature", "top_k", "top_p", "epsilon")}
    record = {"workdir": os.path.abspath(workdir) if files.is_local(workdir) else workdir,
              "model": restored.name, "input": os.path.abspath(input_path), "source_lang": data.source_lang,
              "target_lang": data.target_lang, "decode": decoding, "seed": restored.settings.seed,
              "devices": jax.device_count(), "processes": jax.process_count(), "lines": done, "complete": False}
    if done:
        console.log.info("%s: %d lines already translated in %s; going on from line %d", input_path, done,
                         output_dir, done + 1)
    start, translated = time.perf_counter(), 0
    with files.open_file(input_path, "rb") as source, \
            open(paths[0], "a", encoding="utf-8") if writer else open(os.devnull, "w") as translations, \
            open(paths[1], "a", encoding="utf-8") if writer else open(os.devnull, "w") as originals:
        lines = itertools.islice(sources.decode_lines(input_path, source), done, None)
        for chunk, written in translate.translated_batches(restored, lines, batch_size, name=input_path,
                                                           start=done):
            translated += len(chunk)
            if writer:
                translations.writelines(line + "\n" for line in written)
                originals.writelines(translate.one_line(line) + "\n" for line in chunk)
                for handle in (translations, originals):
                    handle.flush()
                    os.fsync(handle.fileno())
                seconds = time.perf_counter() - start
                write_manifest(output_dir, {**record, "lines": done + translated,
                                            "sentences_per_second": translated / max(seconds, 1e-9)})
    seconds = time.perf_counter() - start
    record.update(lines=done + translated, complete=True, sentences_per_second=translated / max(seconds, 1e-9))
    if writer:
        write_manifest(output_dir, record)
    console.log.info("back-translated %d lines in %.1fs (%.1f sentences/s) into %s and %s", translated, seconds,
                     record["sentences_per_second"], *paths)
    return record


def main(argv):
    if len(argv) > 1:
        raise errors.ConfigError(f"unexpected arguments {argv[1:]}: every option is a --flag=value")
    console.route_libraries()
    if not FLAGS.input or not FLAGS.output_dir:
        raise errors.ConfigError("back-translation needs --input (the monolingual text) and --output_dir")
    if not files.exists(FLAGS.input) or files.is_dir(FLAGS.input):
        raise errors.ConfigError(f"--input={FLAGS.input}: no such file (the monolingual text, one sentence per line)")
    if FLAGS.output or FLAGS.nbest:
        raise errors.ConfigError("--output and --nbest are translate's: back-translation writes --output_dir")
    if not files.is_local(FLAGS.output_dir):
        raise errors.ConfigError(f"--output_dir={FLAGS.output_dir}: back-translation appends to and truncates its "
                                 "files, which object storage cannot; give a local or mounted folder")
    files.check_storage(FLAGS.workdir, "--workdir")
    sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    with errors.as_config_error():
        if workdir_family(FLAGS.workdir) == "encoder_only":
            raise ValueError(f"{FLAGS.workdir} holds an encoder_only model, which has no decoder to translate with")
        restored = restore_for_command_line(FLAGS.workdir, FLAGS.step, average_last=FLAGS.average_last,
                                            best=FLAGS.best, nbest=0,
                                            **{name: FLAGS[name].value for name in COMMAND_LINE_OVERRIDES})
        if restored.settings.decode.search == "mbr":
            raise ValueError("--search=mbr: back-translation takes beam search or sampling (Edunov et al. 2018)")
    back_translate(restored, FLAGS.workdir, FLAGS.input, FLAGS.output_dir, FLAGS.split, restored.settings.decode.batch_size
                   if FLAGS.batch_size is None else FLAGS.batch_size)


if __name__ == "__main__":
    app.run(errors.main_with_messages(main))
