"""Export a trained workdir as a Hugging Face `MarianMTModel` directory: config.json, generation_config.json,
model.safetensors and a MarianTokenizer (source.spm, target.spm, vocab.json, tokenizer_config.json), which
`from_pretrained` (MarianMTModel, AutoModelForSeq2SeqLM, AutoTokenizer) reads as it reads any Marian model.

    pip install -e ".[export]"
    python scripts/export.py --workdir=runs/demo --format=hf            # -> runs/demo/export/hf.step750
    python scripts/export.py --workdir=runs/base --format=hf --output=base-hf --step=100000 --average_last=5

The parameters are restored as eval.py restores them (the latest checkpoint, or --step, or --best; averaged over
the config's decode.average_last checkpoints unless --average_last says otherwise), and the export computes the
same function: HF's greedy `generate(num_beams=1, do_sample=False)`, the generation config's default, gives our
greedy search's tokens, and its logits agree with ours to float32 rounding (tests/export_test.py). Beam search
(`num_beams=4`) is HF's own, with its own length penalty and stopping rule, not ours.

How our model becomes Marian's, both being the paper's post-LN Transformer with sqrt(d_model)-scaled embeddings,
ReLU feed-forward and softmax(QK^T / sqrt(d_k)) attention:
  * our sinusoids interleave sin and cos along the model dimension, Marian's put every sine first: one
    permutation of the model dimension, applied to every weight that touches it (the embeddings, each projection's
    model-side axis, LayerNorm scales and biases), maps one onto the other exactly, since LayerNorm, residuals and
    the tied output layer are all indifferent to the order of the features;
  * Marian's biases that we do not have (the attention projections', final_logits_bias) are zeros;
  * the ids are ours: pad 0 (also the decoder's start symbol, as Marian starts from pad), EOS 1, unk 2;
    vocab.json maps every sentencepiece piece to its id, and the joint sentencepiece model is both source.spm
    and target.spm;
  * untied embeddings (model.share_embeddings, model.tie_output_embedding) map to Marian's
    share_encoder_decoder_embeddings and tie_word_embeddings; scanned layers are unstacked.
Refused, with the reason, before anything is written: pre-LN, learned positions, and a LayerNorm epsilon other
than 1e-5 (torch's default, fixed in Marian's layers; --allow_layer_norm_epsilon_change exports anyway, a model
that differs from ours by that epsilon). An existing non-empty --output is never written to: the export is
written beside it and renamed into place whole.

transformers 5 has no translation pipeline (its text-generation pipeline loads Marian's decoder alone): translate
with AutoTokenizer, AutoModelForSeq2SeqLM and `generate`. CTranslate2's Marian converter assumes Marian C++'s
conventions, which this model does not share: pad is the last id (it drops that row, and so refuses this export's
vocabulary) and the decoder starts from a zero embedding (ours starts from the pad row).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
from absl import app, flags

from transformer import console, errors, marian
from transformer.cli import restore_for_command_line
from transformer.restore import Restored, load_workdir_config
from transformer.settings import Settings
from transformer.model import ModelConfig, unstack_layer_params
from transformer.tokenizer import EOS_ID, PAD_ID, UNK_ID, Tokenizer

FORMATS = ("hf", "ctranslate2")
MARIAN_LAYER_NORM_EPSILON = marian.LAYER_NORM_EPSILON
MIN_POSITIONS = 1024  # Marian's sinusoid table: at least this long, though ours have no limit
# The ModelConfig fields the export maps or checks (compute dtype, attention kernel, remat and init change neither
# the parameters nor the function). A field added later is refused when it is not at its default, until mapped.
MAPPED_FIELDS = frozenset({
    "vocab_size", "emb_dim", "num_heads", "num_encoder_layers", "num_decoder_layers", "mlp_dim", "dropout_rate",
    "attention_dropout_rate", "relu_dropout_rate", "activation", "projection_bias", "output_bias", "positional_encoding", "max_length", "layer_norm",
    "layer_norm_epsilon", "share_embeddings", "tie_output_embedding", "dtype", "attention", "remat", "scan_layers",
    "init_std"})


class ExportError(errors.ReportedError, ValueError):
    """A model or output directory the export refuses; the message says why."""


def define_flags() -> None:
    """Defined only when run as a script, so that tests can import several scripts into one process."""
    flags.DEFINE_string("workdir", None, "A directory written by train.py.", required=True)
    flags.DEFINE_enum("format", None, list(FORMATS), "hf: a Hugging Face MarianMTModel directory; ctranslate2: a "
                      "CTranslate2 model (ctranslate2.Translator).", required=True)
    flags.DEFINE_string("output", None, "The directory to write; must not exist, or be empty "
                        "(default: workdir/export/<format>.<model>, e.g. hf.step750 or hf.avg5_step750).")
    flags.DEFINE_integer("step", None, "Checkpoint step to restore (default: the latest).")
    flags.DEFINE_integer("average_last", None, "Average the parameters of the last N checkpoints up to --step "
                         "(default: the config's decode.average_last, none with --best; 0 or 1: no averaging).")
    flags.DEFINE_bool("best", False, "Use the checkpoint of the best dev BLEU (workdir/best_checkpoint).")
    flags.DEFINE_bool("allow_layer_norm_epsilon_change", False, "Export a model whose model.layer_norm_epsilon is "
                      f"not {MARIAN_LAYER_NORM_EPSILON:g}: Marian's LayerNorms then use {MARIAN_LAYER_NORM_EPSILON:g}, "
                      "so its outputs differ slightly from ours.")


FLAGS = flags.FLAGS


# ----------------------------------------------------------------------------------------------------
# What can be exported, and where


def check_exportable(model_config: ModelConfig, allow_epsilon_change: bool = False) -> None:
    """Raise ExportError naming every setting a MarianMTModel cannot express."""
    problems = []
    if model_config.layer_norm != "post":
        problems.append(f"model.layer_norm={model_config.layer_norm!r}: Marian normalises after each residual "
                        "(post-LN) and has no final LayerNorm")
    if model_config.positional_encoding != "sinusoidal":
        problems.append(f"model.positional_encoding={model_config.positional_encoding!r}: Marian's positions are "
                        "fixed sinusoids")
    if model_config.layer_norm_epsilon != MARIAN_LAYER_NORM_EPSILON and not allow_epsilon_change:
        problems.append(f"model.layer_norm_epsilon={model_config.layer_norm_epsilon:g}: Marian's LayerNorms use "
                        f"{MARIAN_LAYER_NORM_EPSILON:g} (--allow_layer_norm_epsilon_change exports it anyway, "
                        "with that epsilon)")
    inert = unused_fields(model_config)
    for field in dataclasses.fields(model_config):
        value = getattr(model_config, field.name)
        if field.name not in MAPPED_FIELDS | inert and value != field.default:
            problems.append(f"model.{field.name}={value!r}: the export does not know how Marian would express it")
    if problems:
        raise ExportError("cannot export as a Hugging Face MarianMTModel: " + "; ".join(problems))


def unused_fields(model_config: ModelConfig) -> set[str]:
    """The fields of features this model does not use, which change neither its parameters nor its function: the
    seed (it draws only performer's features), the experts' settings without experts, each attention kind's own
    setting without that kind, the other families' settings."""
    kinds = {kind for field in ("encoder_attention", "decoder_attention", "cross_attention")
             for kind in getattr(model_config, field).split(",")}
    unused = set()
    for kind, fields in (("performer", ("seed", "performer_features")), ("local", ("local_window",)),
                         ("linformer", ("linformer_length",)),
                         ("ssm", ("ssm_state", "ssm_expand", "ssm_head_dim", "ssm_conv", "ssm_chunk"))):
        if kind not in kinds:
            unused.update(fields)
    if not model_config.num_experts:
        unused.update(("expert_every", "experts_per_token", "capacity_factor", "eval_capacity_factor",
                       "router_balance_weight", "router_z_weight"))
    if model_config.family == "encoder_decoder":
        unused.update(("prefix_lm", "masked_side", "mask_rate"))
    return unused


def check_output(output: str) -> None:
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ExportError(f"--output={output} exists and is not empty: an export never overwrites; "
                          "choose a new directory")


def saved_model_config(workdir: str) -> ModelConfig:
    """The workdir's model as config.json describes it (its vocabulary size included): read before any restore."""
    config = load_workdir_config(workdir)
    with errors.as_config_error():
        return Settings.from_config(config).model_config(int(config["data"]["vocab_size"]))


# ----------------------------------------------------------------------------------------------------
# Our parameters as Marian's


model_dimension_order = marian.model_dimension_order


def linear_weight(kernel, input_order: np.ndarray | None, output_order: np.ndarray | None) -> np.ndarray:
    """Our kernel [in, out] (y = x K) -> torch's weight [out, in] (y = x W^T), each side on the model dimension
    in Marian's feature order."""
    weight = np.asarray(kernel, np.float32).T
    if output_order is not None:
        weight = weight[output_order]
    if input_order is not None:
        weight = weight[:, input_order]
    return np.ascontiguousarray(weight)


def attention_weights(prefix: str, ours: dict, order: np.ndarray) -> dict[str, np.ndarray]:
    """q/k/v read the model dimension and write heads (the same head-major layout in both); out_proj the reverse."""
    def bias(name, model_side):  # zeros where our model has none (model.projection_bias=False)
        if "bias" not in ours[name]:
            return np.zeros((len(order),), np.float32)
        value = np.asarray(ours[name]["bias"], np.float32)
        return np.ascontiguousarray(value[order] if model_side else value)
    weights = {}
    for theirs, name in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
        weights[f"{prefix}.{theirs}.weight"] = linear_weight(ours[name]["kernel"], order, None)
        weights[f"{prefix}.{theirs}.bias"] = bias(name, False)
    weights[f"{prefix}.out_proj.weight"] = linear_weight(ours["output"]["kernel"], None, order)
    weights[f"{prefix}.out_proj.bias"] = bias("output", True)
    return weights


def norm_weights(prefix: str, ours: dict, order: np.ndarray) -> dict[str, np.ndarray]:
    return {f"{prefix}.weight": np.asarray(ours["norm"]["scale"], np.float32)[order],
            f"{prefix}.bias": np.asarray(ours["norm"]["bias"], np.float32)[order]}


def feed_forward_weights(prefix: str, ours: dict, order: np.ndarray) -> dict[str, np.ndarray]:
    hidden, output = ours["hidden"], ours["output"]
    return {f"{prefix}.fc1.weight": linear_weight(hidden["kernel"], order, None),
            f"{prefix}.fc1.bias": np.asarray(hidden["bias"], np.float32),
            f"{prefix}.fc2.weight": linear_weight(output["kernel"], None, order),
            f"{prefix}.fc2.bias": np.asarray(output["bias"], np.float32)[order]}


def layer_weights(prefix: str, layer: dict, order: np.ndarray, decoder: bool) -> dict[str, np.ndarray]:
    weights = {**attention_weights(f"{prefix}.self_attn", layer["self_attention"], order),
               **norm_weights(f"{prefix}.self_attn_layer_norm", layer["self_attention_residual"], order),
               **feed_forward_weights(prefix, layer["feed_forward"], order),
               **norm_weights(f"{prefix}.final_layer_norm", layer["feed_forward_residual"], order)}
    if decoder:
        weights.update(attention_weights(f"{prefix}.encoder_attn", layer["cross_attention"], order))
        weights.update(norm_weights(f"{prefix}.encoder_attn_layer_norm", layer["cross_attention_residual"], order))
    return weights


def embedding_weights(params: dict, model_config: ModelConfig, order: np.ndarray) -> dict[str, np.ndarray]:
    """Every name torch's MarianMTModel gives an embedding or the output layer, tied names included (each with
    the value it must hold), and the zero final_logits_bias."""
    # One shared Embedder appears once in the parameters, under whichever name nnx met first.
    source = params.get("source_embedder", params.get("target_embedder"))
    target = params.get("target_embedder", source)
    if not model_config.share_embeddings and source is target:
        raise ValueError("model.share_embeddings=False, but the parameters hold one embedding table")
    def table(embedder):
        return np.ascontiguousarray(np.asarray(embedder["embedding"]["embedding"], np.float32)[:, order])
    bias = (np.asarray(params["output_bias"], np.float32)[None] if model_config.output_bias else
            np.zeros((1, model_config.vocab_size), np.float32))
    weights = {"model.encoder.embed_tokens.weight": table(source), "model.decoder.embed_tokens.weight": table(target),
               "final_logits_bias": np.ascontiguousarray(bias)}
    if model_config.share_embeddings:
        weights["model.shared.weight"] = weights["model.encoder.embed_tokens.weight"]
    if model_config.tie_output_embedding:
        weights["lm_head.weight"] = weights["model.decoder.embed_tokens.weight"]
    else:  # our kernel [embed, vocab] reads the model dimension
        weights["lm_head.weight"] = linear_weight(params["output_projection"]["kernel"], order, None)
    return weights


def marian_state_dict(params: dict, model_config: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters (TrainState.params, scanned or not) -> float32 arrays named as MarianMTModel's state_dict,
    every entry but the sinusoid tables (which Marian computes, and never saves)."""
    params = jax.device_get(unstack_layer_params(params) if model_config.scan_layers else params)
    order = model_dimension_order(model_config.emb_dim)
    weights = embedding_weights(params, model_config, order)
    for stack, decoder in (("encoder", False), ("decoder", True)):
        layers = params[f"{stack}_layers"]
        for index in range(len(layers)):
            weights.update(layer_weights(f"model.{stack}.layers.{index}", layers[index], order, decoder))
    return weights


# ----------------------------------------------------------------------------------------------------
# The Hugging Face directory


def longest_output(restored: Restored) -> int:
    """The most tokens our search writes for one sentence (EOS included): the input bound plus the extra length."""
    return restored.input_bound + restored.settings.decode.max_extra_length


def marian_config(model_config: ModelConfig, longest: int) -> dict:
    """MarianConfig's fields for our model (the dropout rates too, for fine-tuning); `longest`: longest_output."""
    return dict(
        vocab_size=model_config.vocab_size, decoder_vocab_size=model_config.vocab_size, d_model=model_config.emb_dim,
        encoder_layers=model_config.num_encoder_layers, decoder_layers=model_config.num_decoder_layers,
        encoder_attention_heads=model_config.num_heads, decoder_attention_heads=model_config.num_heads,
        encoder_ffn_dim=model_config.mlp_dim, decoder_ffn_dim=model_config.mlp_dim, activation_function=marian.HF_ACTIVATIONS[model_config.activation],
        dropout=model_config.dropout_rate, attention_dropout=model_config.attention_dropout_rate,
        activation_dropout=model_config.relu_dropout_rate, init_std=model_config.init_std or 0.02,
        max_position_embeddings=max(MIN_POSITIONS, longest + 1), scale_embedding=True,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, decoder_start_token_id=PAD_ID, forced_eos_token_id=EOS_ID,
        bos_token_id=None, share_encoder_decoder_embeddings=model_config.share_embeddings,
        tie_word_embeddings=model_config.tie_output_embedding)


def generation_config(longest: int):
    """Greedy search, as ours: start from pad, stop at EOS, and at the last position allow only EOS (ours allows
    only EOS at each sentence's own limit; HF's max_length is one bound for the batch, the start token counted)."""
    import transformers
    return transformers.GenerationConfig(
        decoder_start_token_id=PAD_ID, pad_token_id=PAD_ID, eos_token_id=EOS_ID, forced_eos_token_id=EOS_ID,
        max_length=longest + 1, num_beams=1, do_sample=False)


def marian_model(params: dict, model_config: ModelConfig, longest: int):
    """A torch MarianMTModel holding our parameters; every weight is checked to hold what we wrote, so a tie we
    did not expect (one name overwriting another) cannot pass silently."""
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()  # the script says in one line what it wrote
    model = transformers.MarianMTModel(transformers.MarianConfig(**marian_config(model_config, longest)))
    model.generation_config = generation_config(longest)
    weights = marian_state_dict(params, model_config)
    state = model.state_dict()
    expected = {name for name in state if ".embed_positions." not in name}
    if set(weights) != expected:
        raise RuntimeError(f"MarianMTModel's weights are not those the export writes: missing "
                           f"{sorted(expected - set(weights))}, unknown {sorted(set(weights) - expected)}")
    with torch.no_grad():
        for name, value in weights.items():
            state[name].copy_(torch.as_tensor(np.array(value)))  # a copy: device_get gives read-only arrays
    for name, value in weights.items():
        if not np.array_equal(state[name].numpy(), value):
            raise RuntimeError(f"{name} does not hold its weight after the export (an unexpected tie?)")
    return model.eval()


def write_tokenizer(tokenizer: Tokenizer, directory: str, source_lang: str, target_lang: str,
                    input_bound: int) -> None:
    """A MarianTokenizer over our sentencepiece model(s): the joint one as both source.spm and target.spm, or a
    pair vocabulary's two (an imported model's), with vocab.json giving our own ids."""
    import transformers
    vocab = {tokenizer.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
    if len(vocab) != tokenizer.vocab_size:
        raise ExportError(f"{tokenizer.path} names two ids with one piece: vocab.json cannot map them")
    vocab_path = os.path.join(directory, "vocab.json")
    with open(vocab_path, "w", encoding="utf-8") as handle:
        json.dump(vocab, handle, ensure_ascii=False, indent=0)
    models = []
    for side, processor in (("source", tokenizer.processor), ("target", tokenizer.target_processor)):
        models.append(os.path.join(directory, f".{side}.model"))  # MarianTokenizer copies it to {side}.spm
        with open(models[-1], "wb") as handle:
            handle.write(processor.serialized_model_proto())
    piece = tokenizer.id_to_piece
    hf_tokenizer = transformers.MarianTokenizer(
        source_spm=models[0], target_spm=models[1], vocab=vocab_path, source_lang=source_lang,
        target_lang=target_lang, unk_token=piece(UNK_ID), eos_token=piece(EOS_ID), pad_token=piece(PAD_ID),
        model_max_length=input_bound)
    ids = (hf_tokenizer.pad_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.unk_token_id)
    if ids != (PAD_ID, EOS_ID, UNK_ID):
        raise RuntimeError(f"MarianTokenizer's pad, eos, unk ids are {ids}, not ours {(PAD_ID, EOS_ID, UNK_ID)}")
    hf_tokenizer.save_pretrained(directory)
    for model in models:
        os.remove(model)


def give_files_the_umask_mode(directory: str) -> None:
    """transformers writes model.safetensors readable by its owner alone; an export is for sharing, so each file
    gets the mode a plain open() would give it."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~umask)


def write_hf(restored: Restored, output: str) -> None:
    """Write the directory beside `output` and rename it into place: a failure leaves no half-written export."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f".{os.path.basename(os.path.abspath(output))}.partial-{os.getpid()}")
    try:
        model = marian_model(restored.params, restored.model_config, longest_output(restored))
        model.save_pretrained(partial)  # config.json, generation_config.json, model.safetensors
        data_config = restored.settings.data
        write_tokenizer(restored.tokenizer, partial, data_config.source_lang, data_config.target_lang,
                        restored.input_bound)
        give_files_the_umask_mode(partial)
        check_output(output)  # again: another process may have filled it meanwhile
        os.replace(partial, output)  # a directory replaces an empty one, or none
    finally:
        shutil.rmtree(partial, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# CTranslate2


def ctranslate2_spec(restored: Restored):
    """CTranslate2's TransformerSpec of our model, filled by its own Marian loader from the MarianMTModel the HF
    export builds, with the three Marian C++ conventions its loader assumes and we do not share undone: our pad
    row stays (it is id 0, not the last), the decoder starts from the pad row's embedding (not a zero vector),
    and the vocabulary is our id table."""
    from ctranslate2.converters import transformers as loaders

    tokenizer = restored.tokenizer

    class OurMarianLoader(loaders.MarianMTLoader):
        def get_model_spec(self, model):
            model.config.normalize_before = False
            model.config.normalize_embedding = False
            return loaders.BartLoader.get_model_spec(self, model)  # without MarianMTLoader's pad-row removal

        def set_decoder(self, spec, decoder):
            loaders.BartLoader.set_decoder(self, spec, decoder)  # start_from_zero_embedding stays False

        def get_vocabulary(self, model, hf_tokenizer):
            return [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]

        def set_config(self, config, model, hf_tokenizer):
            config.bos_token = config.decoder_start_token = tokenizer.id_to_piece(PAD_ID)
            config.eos_token, config.unk_token = tokenizer.id_to_piece(EOS_ID), tokenizer.id_to_piece(UNK_ID)

    model = marian_model(restored.params, restored.model_config, longest_output(restored))
    spec = OurMarianLoader()(model, None)
    spec.validate()
    spec.optimize(quantization=None)  # float32 on disk: Translator(compute_type="int8") quantizes at load
    return spec


def write_ctranslate2(restored: Restored, output: str) -> None:
    """model.bin, config.json, shared_vocabulary.json (CTranslate2's) and source.spm, target.spm (the
    sentencepiece models a server segments with), written beside `output` and renamed into place whole."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f".{os.path.basename(os.path.abspath(output))}.partial-{os.getpid()}")
    try:
        os.makedirs(partial)
        ctranslate2_spec(restored).save(partial)
        tokenizer = restored.tokenizer
        for side, processor in (("source", tokenizer.processor), ("target", tokenizer.target_processor)):
            with open(os.path.join(partial, f"{side}.spm"), "wb") as handle:
                handle.write(processor.serialized_model_proto())
        give_files_the_umask_mode(partial)
        check_output(output)
        os.replace(partial, output)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def export(workdir: str, output: str | None = None, *, output_format: str = "hf", step: int | None = None,
           average_last: int | None = None, best: bool = False, allow_epsilon_change: bool = False
           ) -> tuple[str, Restored]:
    """Export `workdir`'s model (restored as eval.py restores it) to `output` (default: workdir/export/
    <format>.<model>) -> (the output directory, what was restored). Every refusal comes before anything is
    written."""
    if output_format not in FORMATS:
        raise ExportError(f"--format={output_format!r} is not one of {FORMATS}")
    check_exportable(saved_model_config(workdir), allow_epsilon_change)
    if output is not None:
        check_output(output)
    with errors.as_config_error():
        restored = restore_for_command_line(workdir, step, average_last=average_last, best=best, nbest=0)
    check_exportable(restored.model_config, allow_epsilon_change)
    output = output or os.path.join(workdir, "export", f"{output_format}.{restored.name}")
    check_output(output)
    (write_hf if output_format == "hf" else write_ctranslate2)(restored, output)
    return output, restored


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.route_libraries()  # absl's records (orbax, grain, the data pipeline) in the console's format
    output, restored = export(FLAGS.workdir, FLAGS.output, output_format=FLAGS.format, step=FLAGS.step,
                              average_last=FLAGS.average_last, best=FLAGS.best,
                              allow_epsilon_change=FLAGS.allow_layer_norm_epsilon_change)
    averaged = f" (the average of steps {restored.averaged_steps})" if restored.averaged_steps else ""
    if FLAGS.format == "ctranslate2":
        print(f"wrote a CTranslate2 model of {restored.name}{averaged} to {output}: model.bin, config.json, "
              f"shared_vocabulary.json ({restored.tokenizer.vocab_size} pieces), source.spm, target.spm")
        return
    print(f"wrote a Hugging Face MarianMTModel of {restored.name}{averaged} to {output}: config.json, "
          f"generation_config.json, model.safetensors, source.spm, target.spm, vocab.json "
          f"({restored.tokenizer.vocab_size} pieces)")


if __name__ == "__main__":
    define_flags()
    app.run(errors.main_with_messages(main))
