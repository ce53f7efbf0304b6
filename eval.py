"""Evaluate a trained workdir: restore the latest (or --step) checkpoint, or the average of the last N, or
the best on the dev set; decode with the config's search (or --beam_size/--alpha); write; score.

    python eval.py --workdir=runs/demo                       # the valid and test splits of the run's data
    python eval.py --workdir=runs/demo --split=test --step=2000
    python eval.py --workdir=runs/base --average_last=5 --beam_size=4 --alpha=0.6   # the paper's method
    python eval.py --workdir=runs/demo --input=src.txt --reference=ref.txt --output=hyp.txt
"""

import json
import os
import time

from absl import app, flags, logging

from transformer import data, decode, metrics, sources, trainer

flags.DEFINE_string("workdir", None, "A directory written by train.py.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step to restore (default: the latest).")
flags.DEFINE_list("split", ["valid", "test"], "Splits of the run's own data to decode and score.")
flags.DEFINE_string("input", None, "A text file of source sentences to translate instead of the splits.")
flags.DEFINE_string("reference", None, "With --input: a line-aligned file of references to score against.")
flags.DEFINE_string("output", None, "With --input: where to write the translations (default: workdir/eval/).")
flags.DEFINE_integer("batch_size", None, "Sentences per decoding batch (default: the config's).")
flags.DEFINE_integer("average_last", None, "Average the parameters of the last N checkpoints up to --step "
                     "(default: the config's decode.average_last; 0 or 1: no averaging).")
flags.DEFINE_bool("best", False, "Restore the checkpoint of the best dev BLEU (workdir/best_checkpoint).")
flags.DEFINE_integer("beam_size", None, "Beam size (default: the config's decode.beam_size; 1 = greedy).")
flags.DEFINE_float("alpha", None, "Length penalty alpha of beam search (default: the config's decode.alpha).")
FLAGS = flags.FLAGS


def read_lines(path: str) -> list[str]:
    """Every line (empty ones too, so the output stays line-aligned with the input)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return [line.strip() for line in handle]
    except (OSError, UnicodeDecodeError) as error:
        raise sources.DataError(f"cannot read {path}: {error}") from error


def evaluate(restored: trainer.Restored, name: str, source_sentences: list[str], references: list[str] | None,
             output_path: str) -> dict:
    batch_size = FLAGS.batch_size or restored.settings.decode.batch_size
    if batch_size <= 0:
        raise app.UsageError(f"--batch_size={batch_size} must be positive")
    start = time.perf_counter()
    ids = decode.search_ids(restored.search_fn(), restored.params, restored.tokenizer, source_sentences, batch_size,
                            restored.model_config.position_limit)
    seconds = time.perf_counter() - start  # includes the compilation of each new input shape
    hypotheses = [restored.tokenizer.decode(x) for x in ids]
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    with open(output_path, "w", encoding="utf-8") as handle:
        handle.writelines(h + "\n" for h in hypotheses)
    search = restored.settings.decode
    output_tokens = sum(len(x) for x in ids)
    result = {"name": name, "model": restored.name, "step": restored.step, "averaged_steps": restored.averaged_steps,
              "beam_size": search.beam_size, "alpha": search.alpha, "max_extra_length": search.max_extra_length,
              "sentences": len(hypotheses), "output": output_path, "decode_seconds": seconds,
              "sentences_per_second": len(hypotheses) / max(seconds, 1e-9), "output_tokens": output_tokens,
              "tokens_per_second": output_tokens / max(seconds, 1e-9)}
    if references is not None:
        result.update(metrics.all_scores(hypotheses, references, target_lang=restored.settings.data.target_lang))
        print(f"{name} BLEU {result['bleu']:.2f}  {result['signature']}")
        print(f"{name} chrF {result['chrf']:.2f}  {result['chrf_signature']}")
        print(f"{name} paper BLEU (tokenized, compound-split) {result['paper_bleu']:.2f}")
    print(f"{name}: {len(hypotheses)} sentences in {seconds:.1f}s ({result['sentences_per_second']:.1f} sentences/s, "
          f"{result['tokens_per_second']:.0f} tokens/s)")
    return result


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO; --verbosity=0 shows it
        logging.set_verbosity(logging.WARNING)
    if FLAGS.best and (FLAGS.step is not None or FLAGS.average_last):
        raise app.UsageError("--best chooses one checkpoint: it goes with neither --step nor --average_last")
    if FLAGS.average_last is not None and FLAGS.average_last < 0:
        raise app.UsageError(f"--average_last={FLAGS.average_last} must be >= 0")
    overrides = {"beam_size": FLAGS.beam_size, "alpha": FLAGS.alpha}
    average_last = FLAGS.average_last
    if average_last is None and not FLAGS.best:
        average_last = trainer.load_workdir_config(FLAGS.workdir).decode.get("average_last", 0)
    restored = trainer.restore(FLAGS.workdir, FLAGS.step, average_last=average_last or 0, best=FLAGS.best,
                               decode_overrides=overrides)
    if restored.averaged_steps:
        print(f"averaged the parameters of steps {restored.averaged_steps}")
    out_dir = os.path.join(FLAGS.workdir, "eval")
    results = []
    if FLAGS.input:
        source_sentences, references = read_lines(FLAGS.input), None
        if FLAGS.reference:
            references = read_lines(FLAGS.reference)
            if len(references) != len(source_sentences):
                raise sources.DataError(f"{len(source_sentences)} lines in --input={FLAGS.input} but "
                                        f"{len(references)} lines in --reference={FLAGS.reference}")
        output = FLAGS.output or os.path.join(out_dir, f"{os.path.basename(FLAGS.input)}.{restored.name}.txt")
        results.append(evaluate(restored, FLAGS.input, source_sentences, references, output))
    else:
        for split in FLAGS.split:
            pairs = data.read_split(restored.settings.data, split)
            output = os.path.join(out_dir, f"{split}.{restored.name}.txt")
            results.append(evaluate(restored, split, [s for s, _ in pairs], [t for _, t in pairs], output))
    os.makedirs(out_dir, exist_ok=True)
    scores_path = os.path.join(out_dir, f"scores.{restored.name}.json")
    with open(scores_path, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
    print(f"wrote {scores_path}")


if __name__ == "__main__":
    app.run(main)
