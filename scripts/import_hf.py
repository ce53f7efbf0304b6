"""Import a Hugging Face `MarianMTModel` directory (an OPUS-MT model as it ships: config.json, the weights,
source.spm, target.spm, vocab.json, tokenizer_config.json) as a workdir that eval.py, transformer.translate,
scripts/export.py and train.py (fine-tuning: configs/finetune.py) read as their own.

    pip install -e ".[export]"
    python scripts/import_hf.py --model=opus-mt-en-de --workdir=runs/opus-en-de
    python eval.py --workdir=runs/opus-en-de --input=newstest.en --reference=newstest.de
    python train.py --config=configs/finetune.py:runs/opus-en-de --workdir=runs/opus-ft \
        --config.data.source=text --config.data.text_dir=DATA

The workdir gets config.json (our settings for Marian's model: post-LN, sinusoids, scaled embeddings,
model.activation, model.projection_bias, model.output_bias for final_logits_bias), vocab.model (a *pair*
vocabulary, transformer/tokenizer.py: both sentencepiece models with vocab.json's table), run.json and
checkpoints/0 (the parameters only).

How Marian's model becomes ours (the inverse of scripts/export.py's mapping):
  * the ids are renumbered so that pad is 0 (also the decoder's start symbol: Marian starts from pad too), EOS 1
    and unk 2, every other id keeping Marian's order; the embedding rows and final_logits_bias follow;
  * Marian's sinusoids put every sine before every cosine, ours interleave them: one permutation of the model
    dimension, applied to every weight that touches it, maps one onto the other exactly;
  * torch's weights [out, in] become our kernels [in, out].
Refused, naming the setting, before anything is written: what our model cannot represent (unscaled
embeddings, a decoder vocabulary of its own, other heads or widths per stack, an activation we lack, a start
symbol that is not pad). An existing non-empty --workdir is never written to.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from absl import app, flags

from transformer import config_files, console, defaults, errors, files
from transformer import workdir as workdirs
from transformer.checkpoint import Checkpointer
from transformer.marian import ACTIVATIONS, LAYER_NORM_EPSILON, model_dimension_order
from transformer.optim import make_optimizer
from transformer.plan import abstract_train_state
from transformer.settings import Settings
from transformer.tokenizer import EOS_ID, PAD_ID, UNK_ID, write_pair

CHECKPOINT_STEP = 0  # the imported parameters' step: a fine-tune starts its own count


class ImportRefused(errors.ReportedError, ValueError):
    """A model directory or workdir the import refuses; the message says why."""


def define_flags() -> None:
    """Defined only when run as a script, so that tests can import several scripts into one process."""
    flags.DEFINE_string("model", None, "A local MarianMTModel directory (config.json, weights, source.spm, "
                        "target.spm, vocab.json).", required=True)
    flags.DEFINE_string("workdir", None, "The workdir to write; must not exist, or be empty.", required=True)
    flags.DEFINE_string("source_lang", None, "The source language (default: the tokenizer config's, else 'src').")
    flags.DEFINE_string("target_lang", None, "The target language (default: the tokenizer config's, else 'tgt').")
    flags.DEFINE_string("text_dir", None, "Make data.source=text with this folder of {split}.{lang} files, so that "
                        "eval.py scores its splits and a fine-tune trains on them (default: no data of its own).")


FLAGS = flags.FLAGS


# ----------------------------------------------------------------------------------------------------
# Marian's settings as ours


def model_settings(marian: dict, where: str) -> dict:
    """config.model for a MarianConfig (as config.json holds it); every setting we cannot represent is named."""
    problems = []
    def same(a, b):
        if marian.get(a) != marian.get(b):
            problems.append(f"{a}={marian.get(a)} but {b}={marian.get(b)}: our stacks share one value")
    same("encoder_attention_heads", "decoder_attention_heads")
    same("encoder_ffn_dim", "decoder_ffn_dim")
    activation = marian.get("activation_function", "swish")
    if activation not in ACTIVATIONS:
        problems.append(f"activation_function={activation!r}: model.activation has {sorted(set(ACTIVATIONS))}")
    if not marian.get("scale_embedding", False):
        problems.append("scale_embedding=false: our embeddings are scaled by sqrt(d_model)")
    if marian.get("decoder_vocab_size") not in (None, marian["vocab_size"]):
        problems.append(f"decoder_vocab_size={marian['decoder_vocab_size']} differs from vocab_size="
                        f"{marian['vocab_size']}: our source and target share one id table")
    if marian.get("decoder_start_token_id", marian.get("pad_token_id")) != marian.get("pad_token_id"):
        problems.append(f"decoder_start_token_id={marian.get('decoder_start_token_id')} is not pad_token_id="
                        f"{marian.get('pad_token_id')}: our decoder starts from pad")
    if marian.get("model_type", "marian") != "marian":
        problems.append(f"model_type={marian.get('model_type')!r}: only Marian's is imported")
    if problems:
        raise ImportRefused(f"cannot import {where}: " + "; ".join(problems))
    return {"emb_dim": marian["d_model"], "num_heads": marian["encoder_attention_heads"],
            "num_encoder_layers": marian["encoder_layers"], "num_decoder_layers": marian["decoder_layers"],
            "mlp_dim": marian["encoder_ffn_dim"], "dropout_rate": float(marian.get("dropout", 0.1)),
            "attention_dropout_rate": float(marian.get("attention_dropout", 0.0)),
            "relu_dropout_rate": float(marian.get("activation_dropout", 0.0)),
            "activation": ACTIVATIONS[activation], "positional_encoding": "sinusoidal", "layer_norm": "post",
            "layer_norm_epsilon": LAYER_NORM_EPSILON, "projection_bias": True,
            "output_bias": True, "share_embeddings": bool(marian.get("share_encoder_decoder_embeddings", True)),
            "tie_output_embedding": bool(marian.get("tie_word_embeddings", True)),
            "init_std": float(marian.get("init_std", 0.02))}


def id_order(vocab: dict[str, int], specials: dict[str, str], size: int, where: str) -> np.ndarray:
    """Our id i is Marian's id order[i]: pad, eos, unk first (ours 0, 1, 2), the rest in Marian's order."""
    ids = {}
    for name, ours in (("pad", PAD_ID), ("eos", EOS_ID), ("unk", UNK_ID)):
        piece = specials[name]
        if piece not in vocab:
            raise ImportRefused(f"cannot import {where}: its {name} token {piece!r} is not in vocab.json")
        ids[ours] = vocab[piece]
    if sorted(vocab.values()) != list(range(size)):
        raise ImportRefused(f"cannot import {where}: vocab.json's ids are not 0..{size - 1} (vocab_size={size})")
    first = [ids[PAD_ID], ids[EOS_ID], ids[UNK_ID]]
    return np.array(first + [i for i in range(size) if i not in first])


# ----------------------------------------------------------------------------------------------------
# Marian's weights as ours


def our_params(state: dict[str, np.ndarray], model: dict, order: np.ndarray) -> dict:
    """MarianMTModel's state_dict (float32 numpy) -> our parameters (TrainState.params, layers unscanned)."""
    inverse = np.argsort(model_dimension_order(model["emb_dim"]))  # ours[k] = Marian's[inverse[k]]

    def kernel(name, model_in, model_out):
        weight = np.asarray(state[f"{name}.weight"], np.float32).T  # [in, out]
        if model_in:
            weight = weight[inverse]
        if model_out:
            weight = weight[:, inverse]
        return np.ascontiguousarray(weight)

    def bias(name, model_out):
        value = np.asarray(state[f"{name}.bias"], np.float32)
        return np.ascontiguousarray(value[inverse] if model_out else value)

    def linear(name, model_in, model_out):
        return {"kernel": kernel(name, model_in, model_out), "bias": bias(name, model_out)}

    def norm(name):
        return {"norm": {"scale": np.ascontiguousarray(np.asarray(state[f"{name}.weight"], np.float32)[inverse]),
                         "bias": bias(name, True)}}

    def attention(name):
        return {"query": linear(f"{name}.q_proj", True, False), "key": linear(f"{name}.k_proj", True, False),
                "value": linear(f"{name}.v_proj", True, False), "output": linear(f"{name}.out_proj", False, True)}

    def layer(prefix, decoder):
        layer = {"self_attention": attention(f"{prefix}.self_attn"),
                 "self_attention_residual": norm(f"{prefix}.self_attn_layer_norm"),
                 "feed_forward": {"hidden": linear(f"{prefix}.fc1", True, False),
                                  "output": linear(f"{prefix}.fc2", False, True)},
                 "feed_forward_residual": norm(f"{prefix}.final_layer_norm")}
        if decoder:
            layer["cross_attention"] = attention(f"{prefix}.encoder_attn")
            layer["cross_attention_residual"] = norm(f"{prefix}.encoder_attn_layer_norm")
        return layer

    def table(name):
        return {"embedding": {"embedding": np.ascontiguousarray(
            np.asarray(state[name], np.float32)[order][:, inverse])}}

    params = {f"{stack}_layers": {i: layer(f"model.{stack}.layers.{i}", stack == "decoder")
                                  for i in range(model[f"num_{stack}_layers"])} for stack in ("encoder", "decoder")}
    # One shared Embedder is held once, under the name nnx meets first (the target's: see Transformer.__init__).
    if model["share_embeddings"]:
        params["source_embedder"] = table("model.encoder.embed_tokens.weight")
    else:
        params["source_embedder"] = table("model.encoder.embed_tokens.weight")
        params["target_embedder"] = table("model.decoder.embed_tokens.weight")
    if not model["tie_output_embedding"]:
        params["output_projection"] = {"kernel": np.ascontiguousarray(
            np.asarray(state["lm_head.weight"], np.float32)[order][:, inverse].T)}
    params["output_bias"] = np.ascontiguousarray(np.asarray(state["final_logits_bias"], np.float32).reshape(-1)[order])
    return params


def check_params(params: dict, abstract: dict) -> None:
    """Our model's tree and shapes, exactly: a name or shape the mapping got wrong is refused here, not at restore."""
    import jax

    def shapes(tree):
        return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(
            tree)}
    ours, theirs = shapes(params), shapes(abstract)
    if ours != theirs:
        wrong = sorted(set(ours.items()) ^ set(theirs.items()))
        raise RuntimeError(f"the imported parameters are not our model's: {wrong[:6]}")


# ----------------------------------------------------------------------------------------------------
# The workdir


def read_model(directory: str) -> tuple[dict, dict[str, np.ndarray], dict]:
    """(config.json, the state_dict as float32 numpy, tokenizer_config.json) of a MarianMTModel directory."""
    for name in ("config.json", "source.spm", "target.spm", "vocab.json"):
        if not os.path.exists(os.path.join(directory, name)):
            raise ImportRefused(f"--model={directory} holds no {name}: it must be a MarianMTModel directory as "
                               "OPUS-MT ships it")
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as handle:
        marian = json.load(handle)
    model_settings(marian, directory)  # refuse before loading the weights
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()
    model = transformers.MarianMTModel.from_pretrained(directory, dtype=torch.float32)
    state = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    tokenizer_config = {}
    path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            tokenizer_config = json.load(handle)
    return marian, state, tokenizer_config


def special_pieces(tokenizer_config: dict) -> dict[str, str]:
    def piece(name, default):
        value = tokenizer_config.get(f"{name}_token", default)
        return value.get("content", default) if isinstance(value, dict) else value
    return {"pad": piece("pad", "<pad>"), "eos": piece("eos", "</s>"), "unk": piece("unk", "<unk>")}


def import_model(model_dir: str, workdir: str, source_lang: str | None = None, target_lang: str | None = None,
                 text_dir: str | None = None) -> dict:
    """Write `workdir` from the MarianMTModel at `model_dir` -> the workdir's config. Every refusal comes before
    anything is written; the workdir is written beside its place and renamed into it whole."""
    if files.exists(workdir) and (not files.is_dir(workdir) or files.list_dir(workdir)):
        raise ImportRefused(f"--workdir={workdir} exists and is not empty: an import never overwrites; choose a "
                           "new directory")
    marian, state, tokenizer_config = read_model(model_dir)
    model = model_settings(marian, model_dir)
    with open(os.path.join(model_dir, "vocab.json"), encoding="utf-8") as handle:
        vocab = json.load(handle)
    size = int(marian["vocab_size"])
    specials = special_pieces(tokenizer_config)
    order = id_order(vocab, specials, size, model_dir)
    pieces = {i: piece for piece, i in vocab.items()}
    config = config_files.plain(defaults.get_config())
    config["model"].update(model)
    config["data"].update(vocab_size=size, source_lang=source_lang or tokenizer_config.get("source_lang") or "src",
                          target_lang=target_lang or tokenizer_config.get("target_lang") or "tgt")
    if text_dir:
        config["data"].update(source="text", text_dir=text_dir)
    with errors.as_config_error():
        settings = Settings.from_config(config)
    model_config = settings.model_config(size)
    optimizer, _ = make_optimizer(settings.optimizer, model_config.emb_dim)
    params = our_params(state, model, order)
    check_params(params, abstract_train_state(model_config, optimizer, settings.seed).params)

    parent = os.path.dirname(os.path.abspath(workdir))
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f".{os.path.basename(os.path.abspath(workdir))}.partial-{os.getpid()}")
    try:
        os.makedirs(partial)
        vocabulary = os.path.join(partial, workdirs.VOCABULARY_FILE)
        # Specials: pad, eos, unk, and every piece the sentencepiece models cannot produce as text (none, usually).
        tokenizer = write_pair(vocabulary, os.path.join(model_dir, "source.spm"), os.path.join(model_dir, "target.spm"),
                               [pieces[int(i)] for i in order], (PAD_ID, EOS_ID, UNK_ID))
        files.write_json(os.path.join(partial, workdirs.CONFIG_FILE), config)
        files.write_json(os.path.join(partial, workdirs.RUN_FILE), {
            "vocabulary": workdirs.vocabulary_record(vocabulary, tokenizer.vocab_size),
            "imported": {"model": os.path.abspath(model_dir), "format": "MarianMTModel",
                         "architectures": marian.get("architectures"), "step": CHECKPOINT_STEP}})
        target = Checkpointer(os.path.join(partial, workdirs.CHECKPOINTS_DIR), save_every_steps=1, keep=1,
                              use_async=False)
        target.save(CHECKPOINT_STEP, {"params": params}, force=True)  # what evaluation and warm starts read
        target.wait()
        target.close()
        if files.exists(workdir) and files.list_dir(workdir):  # again: another process may have filled it
            raise ImportRefused(f"--workdir={workdir} was filled during the import; the import is not written")
        if files.exists(workdir):
            os.rmdir(workdir)
        os.replace(partial, workdir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return config


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.route_libraries()
    config = import_model(FLAGS.model, FLAGS.workdir, FLAGS.source_lang, FLAGS.target_lang, FLAGS.text_dir)
    model = config["model"]
    print(f"imported {FLAGS.model} into {FLAGS.workdir}: {model['num_encoder_layers']}+{model['num_decoder_layers']} "
          f"layers, d_model {model['emb_dim']}, {config['data']['vocab_size']} pieces, activation "
          f"{model['activation']}; checkpoints/{CHECKPOINT_STEP} holds its parameters")


if __name__ == "__main__":
    define_flags()
    app.run(errors.main_with_messages(main))
