"""Evaluate a trained workdir: restore the latest (or --step) checkpoint, or the average of the last N, or
the best on the dev set; decode with the config's search (or --beam_size/--alpha/...); write; score.

    python eval.py --workdir=runs/demo                       # the valid and test splits of the run's data
    python eval.py --workdir=runs/demo --split=test --step=2000
    python eval.py --workdir=runs/base --average_last=5 --beam_size=4 --alpha=0.6   # the paper's method
    python eval.py --workdir=runs/demo --input=src.txt --reference=ref.txt --output=hyp.txt
    python eval.py --workdir=runs/base --split=valid --nbest=4 --length_penalty=fairseq --alpha=1.0

On several hosts run it on each, as train.py (`--coordinator_address=host0:1234 --num_processes=N --process_id=i`,
or none under SLURM / a TPU slice): each process decodes its share and process 0 writes.

An encoder_only workdir (model.family) has no decoder: eval.py reports each split's masked-token accuracy and
perplexity instead, over the tokens its run's evaluation masked, to scores.<splits>.<model>.masked.json.

Every decoding flag left unset takes the workdir config's decode value, as in `python -m transformer.translate`.
Decoding splits each batch over every device (transformer/decode.py). Each evaluation writes its own files under
workdir/eval/, named by what it decoded, the model and the search: `<split>.<model>.<search>.txt` and
`scores.<splits or input file>.<model>.<search>.json` (e.g. scores.valid+test.step750.greedy-extra50.json; an
--input file's name is followed by a hash of its absolute path, `src.txt-1a2b3c4d`, so no two inputs collide), each
written whole or not at all; it reads only committed checkpoints, so it can run beside train.py on the same
workdir. Exit status: 0 done, 1 an error printed as `error: <message>` (--traceback for its traceback).
"""

import hashlib
import json
import os

import jax
from absl import app, flags

from transformer import cli, console, decode, errors, files, metrics, sharding, sources
from transformer.evaluation import Evaluator
from transformer.restore import Restored, workdir_family

cli.define_command_line_flags("sentences")
flags.adopt_module_key_flags(cli)
flags.DEFINE_list("split", ["valid", "test"], "Splits of the run's own data to decode and score.")
flags.DEFINE_string("input", None, "A text file of source sentences to translate instead of the splits.")
flags.DEFINE_string("reference", None, "With --input: a line-aligned file of references to score against.")
flags.DEFINE_string("output", None, "With --input: where to write the translations (default: workdir/eval/).")
flags.DEFINE_integer("batch_size", None, "Sentences per decoding batch, rounded up to whole rows per device "
                     "(default: the config's decode.batch_size).")
flags.DEFINE_integer("nbest", 0, "Also write the N best hypotheses of each sentence (N <= beam size) in Moses' "
                     "n-best format `index ||| translation ||| LogProb= log P ||| score` to <output>.nbest<N>.txt.")
sharding.define_distributed_flags()  # as train.py: each process decodes its share of every batch, process 0 writes
flags.adopt_module_key_flags(sharding)
FLAGS = flags.FLAGS


def read_lines(path: str) -> list[str]:
    """Every line as training reads its text (sources.decode_lines: BOM and CR dropped, invalid UTF-8 named by
    file and line), empty ones too, so the output stays line-aligned with the input."""
    try:
        with files.open_file(path, "rb") as file:
            return list(sources.decode_lines(path, file))
    except OSError as error:
        raise sources.DataError(f"cannot read {path}: {error}") from error


def write_lines(path: str, lines: list[str]) -> None:
    """Process 0 writes (every process holds every translation), whole and renamed into place: a reader, or a
    kill, never sees half a file."""
    if jax.process_index() == 0:
        files.make_dirs(os.path.dirname(files.absolute(path)))
        files.write_text(path, "".join(line + "\n" for line in lines))


def say(line: str) -> None:
    if jax.process_index() == 0:  # one console for a multi-process evaluation
        print(line)


def nbest_path(output_path: str, nbest: int) -> str:
    root, extension = os.path.splitext(output_path)
    return f"{root}.nbest{nbest}{extension or '.txt'}"


def evaluate(restored: Restored, evaluator: Evaluator, name: str, source_sentences: list[str],
             references: list[str] | None, output_path: str, nbest: int = 0) -> dict:
    """Decode (the best hypothesis, and with nbest the n-best list too), write, score. Sources longer than the
    bound are cut to it (one warning naming `name`), still scored, and counted in the result's inputs_cut."""
    settings = restored.settings.decode
    bound = evaluator.input_bound
    translated = evaluator.translate(restored.params, source_sentences, name)
    decoded, hypotheses, seconds = translated.decoded, translated.hypotheses, translated.seconds
    ids = decoded.best_ids()
    write_lines(output_path, hypotheses)
    output_tokens = sum(len(x) for x in ids)
    result = {"name": name, "model": restored.name, "step": restored.step, "averaged_steps": restored.averaged_steps,
              "search": settings.search_tag, "beam_size": settings.beam_size, "alpha": settings.alpha,
              "length_penalty": settings.length_penalty, "max_extra_length": settings.max_extra_length,
              "batch_size": settings.batch_size, "max_tokens_per_batch": settings.max_tokens_per_batch,
              "max_input_length": bound, "inputs_cut": decoded.cut, "devices": jax.device_count(),
              "sentences": len(hypotheses), "output": output_path, "decode_seconds": seconds,
              "sentences_per_second": len(hypotheses) / max(seconds, 1e-9), "output_tokens": output_tokens,
              "tokens_per_second": output_tokens / max(seconds, 1e-9)}
    if nbest:
        result["nbest"], result["nbest_output"] = nbest, nbest_path(output_path, nbest)
        write_lines(result["nbest_output"], decode.nbest_lines(decoded.nbest(nbest), restored.tokenizer))
    if references is not None:
        result.update(metrics.all_scores(hypotheses, references, target_lang=restored.settings.data.target_lang))
        say(f"{name} BLEU {result['bleu']:.2f}  {result['signature']}")
        say(f"{name} chrF {result['chrf']:.2f}  {result['chrf_signature']}")
        say(f"{name} {metrics.paper_bleu_name(restored.settings.data.target_lang)} {result['paper_bleu']:.2f}")
    cut = f"; {decoded.cut} cut to {bound} tokens" if decoded.cut else ""
    say(f"{name}: {len(hypotheses)} sentences in {seconds:.1f}s ({result['sentences_per_second']:.1f} sentences/s, "
          f"{result['tokens_per_second']:.0f} tokens/s{cut})")
    return result


def evaluate_masked(restored: Restored, evaluator: Evaluator) -> None:
    """An encoder_only model has no decoder: each split's masked-token accuracy and perplexity instead of BLEU,
    over the same masked tokens as the run's own evaluation (Evaluator.masked_scores)."""
    results = []
    for split in FLAGS.split:
        result = {"name": split, "model": restored.name, "step": restored.step,
                  "averaged_steps": restored.averaged_steps, **evaluator.masked_scores(restored.params, split)}
        say(f"{split} masked accuracy {result['accuracy']:.4f}  perplexity {result['perplexity']:.3f}  "
            f"({result['masked_tokens']:.0f} masked tokens of {result['pairs']} pairs)")
        results.append(result)
    scores_path = os.path.join(FLAGS.workdir, "eval", f"scores.{'+'.join(FLAGS.split)}.{restored.name}.masked.json")
    write_lines(scores_path, [json.dumps(results, indent=2)])
    say(f"wrote {scores_path}")


def main(argv):
    if len(argv) > 1:
        raise errors.ConfigError(f"unexpected arguments {argv[1:]}: every option is a --flag=value")
    console.route_libraries()  # absl's records (orbax, grain, the data pipeline) in the console's format
    files.check_storage(FLAGS.workdir, "--workdir")
    # Checked before the model is restored and decoded, where the first write would come after the work.
    files.check_writable(os.path.join(FLAGS.workdir, "eval"), "--workdir", "eval.py writes its scores (and "
                         "translations) in the workdir's eval/ folder; `python -m transformer.translate` only reads")
    if FLAGS.output:
        files.check_writable(os.path.dirname(files.absolute(FLAGS.output)), "--output", "the translations go there")
    sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    with errors.as_config_error():  # a bad flag or saved setting is named before anything is restored
        if FLAGS.input and workdir_family(FLAGS.workdir) == "encoder_only":
            raise ValueError("--input translates, and this workdir's model is encoder_only (no decoder): use "
                             "--split, or transformer.features for its encoder's outputs")
        restored = cli.restore_for_command_line(
            FLAGS.workdir, FLAGS.step, average_last=FLAGS.average_last, best=FLAGS.best, nbest=FLAGS.nbest,
            **{name: FLAGS[name].value for name in cli.COMMAND_LINE_OVERRIDES})
    if restored.averaged_steps:
        say(f"averaged the parameters of steps {restored.averaged_steps}")
    # One search for every split: compiled once per input shape (and sampling's call count goes on).
    evaluator = Evaluator.of(restored, scores=FLAGS.nbest > 0)
    if restored.model_config.family == "encoder_only":
        return evaluate_masked(restored, evaluator)
    out_dir = os.path.join(FLAGS.workdir, "eval")
    # What was decoded, by which model and search: another evaluation of the same model writes other files.
    tag = f"{restored.name}.{restored.settings.decode.search_tag}"
    results = []
    if FLAGS.input:
        source_sentences, references = read_lines(FLAGS.input), None
        if not source_sentences:
            raise sources.DataError(f"--input={FLAGS.input} is empty: no sentence to translate")
        if FLAGS.reference:
            references = read_lines(FLAGS.reference)
            if len(references) != len(source_sentences):
                raise sources.DataError(f"{len(source_sentences)} lines in --input={FLAGS.input} but "
                                        f"{len(references)} lines in --reference={FLAGS.reference}")
        # The basename and a hash of the absolute path: two inputs called test.en in different folders, or one
        # called like a split, never write over each other's translations and scores.
        where = hashlib.sha1(files.absolute(FLAGS.input).encode()).hexdigest()[:8]
        evaluated = f"{os.path.basename(FLAGS.input)}-{where}"
        output = FLAGS.output or os.path.join(out_dir, f"{evaluated}.{tag}.txt")
        results.append(evaluate(restored, evaluator, FLAGS.input, source_sentences, references, output, FLAGS.nbest))
    else:
        evaluated = "+".join(FLAGS.split)
        for split in FLAGS.split:
            pairs = evaluator.pairs[split]
            output = os.path.join(out_dir, f"{split}.{tag}.txt")
            results.append(evaluate(restored, evaluator, split, [s for s, _ in pairs], [t for _, t in pairs], output,
                                    FLAGS.nbest))
    scores_path = os.path.join(out_dir, f"scores.{evaluated}.{tag}.json")
    write_lines(scores_path, [json.dumps(results, indent=2)])
    say(f"wrote {scores_path}")


if __name__ == "__main__":
    app.run(errors.main_with_messages(main))
