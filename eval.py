"""Evaluate a trained workdir: restore the latest (or --step) checkpoint, decode, write, score.

    python eval.py --workdir=runs/demo                       # the valid and test splits of the run's data
    python eval.py --workdir=runs/demo --split=test --step=2000
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
    hypotheses = decode.translate(restored.search_fn(), restored.params, restored.tokenizer, source_sentences,
                                  batch_size, restored.model_config.position_limit)
    seconds = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    with open(output_path, "w", encoding="utf-8") as handle:
        handle.writelines(h + "\n" for h in hypotheses)
    result = {"name": name, "step": restored.step, "sentences": len(hypotheses), "output": output_path,
              "decode_seconds": seconds, "sentences_per_second": len(hypotheses) / max(seconds, 1e-9)}
    if references is not None:
        result.update(metrics.bleu(hypotheses, references, target_lang=restored.settings.data.target_lang))
        print(f"{name} BLEU {result['bleu']:.2f}  {result['signature']}")
    return result


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO; --verbosity=0 shows it
        logging.set_verbosity(logging.WARNING)
    restored = trainer.restore(FLAGS.workdir, FLAGS.step)
    out_dir = os.path.join(FLAGS.workdir, "eval")
    results = []
    if FLAGS.input:
        source_sentences, references = read_lines(FLAGS.input), None
        if FLAGS.reference:
            references = read_lines(FLAGS.reference)
            if len(references) != len(source_sentences):
                raise sources.DataError(f"{len(source_sentences)} lines in --input={FLAGS.input} but "
                                        f"{len(references)} lines in --reference={FLAGS.reference}")
        output = FLAGS.output or os.path.join(out_dir, f"{os.path.basename(FLAGS.input)}.step{restored.step}.txt")
        results.append(evaluate(restored, FLAGS.input, source_sentences, references, output))
    else:
        for split in FLAGS.split:
            pairs = data.read_split(restored.settings.data, split)
            output = os.path.join(out_dir, f"{split}.step{restored.step}.txt")
            results.append(evaluate(restored, split, [s for s, _ in pairs], [t for _, t in pairs], output))
    os.makedirs(out_dir, exist_ok=True)
    scores_path = os.path.join(out_dir, f"scores.step{restored.step}.json")
    with open(scores_path, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
    print(f"wrote {scores_path}")


if __name__ == "__main__":
    app.run(main)
