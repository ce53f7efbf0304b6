"""Shared by the tests: a tiny config (a small model on a slice of the built-in corpus, fast on 2 CPU
cores), a digest of a directory's files (to show that a failed start left a workdir untouched), a run's
metrics.jsonl records, a script of scripts/ loaded as a module, and the BLEU of a file of translations scored
again."""

import hashlib
import importlib.util
import json
import os

from configs import default

# Dotted overrides of configs/default.py; the same list drives train.py on the command line.
TINY_OVERRIDES = {
    "data.builtin_train_size": 2000, "data.builtin_valid_size": 64, "data.builtin_test_size": 64,
    "data.vocab_size": 300, "data.max_length": 48, "data.tokens_per_batch": 384,
    "model.emb_dim": 32, "model.num_heads": 2, "model.num_encoder_layers": 1, "model.num_decoder_layers": 1,
    "model.mlp_dim": 64, "optimizer.warmup_steps": 10, "train.num_train_steps": 6, "train.log_every_steps": 2,
    "train.eval_every_steps": 3, "train.checkpoint_every_steps": 3, "train.keep_checkpoints": 5,
    "decode.batch_size": 32, "decode.max_extra_length": 4,
}


def make_tiny_config(**overrides):
    config = default.get_config()
    for key, value in {**TINY_OVERRIDES, **overrides}.items():
        *sections, field = key.split(".")
        node = config
        for section in sections:
            node = node[section]
        node[field] = value
    return config


def tree_digest(directory) -> str:
    """A hash of every file's path and bytes under directory."""
    digest = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(path.encode())
            with open(path, "rb") as handle:
                digest.update(handle.read())
    return digest.hexdigest()


def metric_records(workdir) -> list[dict]:
    """The records of workdir/metrics.jsonl, in order."""
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def load_script(name: str):
    """scripts/<name>.py as a module (its `if __name__ == "__main__"` part does not run)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_incrementally(model, inputs, targets, **cache_options):
    """The logits [batch, hypotheses, length, vocab] of feeding targets [batch, hypotheses, length] one position at
    a time through model.decode_step (each hypothesis its own history): what the teacher-forced pass must equal."""
    import jax.numpy as jnp

    cache = model.init_cache(model.encode(inputs), inputs, targets.shape[-1], hypotheses=targets.shape[1],
                             **cache_options)
    logits = []
    for index in range(targets.shape[-1]):
        step_logits, cache = model.decode_step(targets[..., index], jnp.int32(index), cache)
        logits.append(step_logits)
    return jnp.stack(logits, axis=2)


def assert_beam_scores_are_teacher_forced_log_probs(model, inputs, beam_size=3, alpha=0.6):
    """Beam search's final scores of each source row of inputs equal its hypotheses' log-probabilities under the
    teacher-forced pass over their tokens (up to and including EOS), divided by the length penalty: what a search
    that mixed up its beams' caches when reordering them could not give."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from transformer.decode import beam_search, length_penalty
    from transformer.tokenizer import EOS_ID

    graphdef, params = nnx.split(model)
    search = jax.jit(beam_search, static_argnames=("graphdef", "beam_size", "alpha", "max_extra_length"))
    sequences, scores = search(nnx.to_pure_dict(params), inputs, graphdef=graphdef, beam_size=beam_size, alpha=alpha,
                               max_extra_length=6)
    forced = nnx.jit(lambda model, source, target: model(source, target))
    for row in range(inputs.shape[0]):
        outputs = np.asarray(sequences[row])
        lengths = np.array([list(s).index(EOS_ID) + 1 if EOS_ID in s else len(s) for s in outputs])
        decoder_inputs = jnp.pad(jnp.asarray(outputs), ((0, 0), (1, 0)))[:, :-1]
        logits = forced(model, jnp.repeat(inputs[row:row + 1], beam_size, axis=0), decoder_inputs)
        token_log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(outputs)[..., None], -1)[..., 0]
        log_probs = np.array([float(token_log_probs[i, :lengths[i]].sum()) for i in range(beam_size)])
        np.testing.assert_allclose(scores[row], log_probs / length_penalty(lengths, alpha), rtol=1e-5, atol=1e-5)


def rescored_bleu(workdir, translations, split: str) -> dict[str, float]:
    """sacreBLEU (its defaults: 13a tokens, cased, as the runs score) of a file of translations, one a line, scored
    here against the references of `split` read again from the workdir's config -> the score and the corpus's
    hypothesis and reference lengths in tokens, which a run or eval.py that wrote the file must have reported. (A
    tiny run's translations may all be empty, BLEU 0: the reference length still tells the split apart.)"""
    import sacrebleu

    from transformer import data
    from transformer.restore import load_workdir_config
    from transformer.settings import Settings

    settings = Settings.from_config(load_workdir_config(str(workdir)))
    references = [target for _, target in data.read_split(settings.data, split)]
    with open(translations, encoding="utf-8") as handle:
        hypotheses = handle.read().split("\n")[:-1]  # each line ends in a newline; an empty one is a translation
    assert len(hypotheses) == len(references), (len(hypotheses), len(references))
    score = sacrebleu.corpus_bleu(hypotheses, [references])
    return {"bleu": score.score, "hypothesis_length": score.sys_len, "reference_length": score.ref_len}
