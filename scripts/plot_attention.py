"""Attention maps of one sentence: translate it, then draw the cross-attention (each layer and head, and their
average) and the decoder self-attention as heatmaps with the tokens on the axes, and print the source token
each target token attends to most (averaged over layers and heads).

    pip install -e ".[plot]"
    python scripts/plot_attention.py --workdir=runs/demo --source="The black cat sleeps in the garden."

Writes `--output_dir` (default workdir/attention): cross_attention.png, decoder_self_attention.png and
attention.npz (the weights: cross [layers, heads, target, source], decoder_self [layers, heads, target, target]).

The weights come from one teacher-forced pass over the translation, recorded by wrapping
`transformer.model.attention.dot_product_attention` for that pass: the model itself is unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from transformer import console, decode
from transformer.model import attention as attention_lib, unstack_layer_params
from transformer.plan import model_graphdef
from transformer.restore import Restored, restore


def define_flags() -> None:
    """Defined only when run as a script, so that tests can import several scripts into one process."""
    flags.DEFINE_string("workdir", None, "A directory written by train.py.", required=True)
    flags.DEFINE_string("source", None, "The source sentence.", required=True)
    flags.DEFINE_string("output_dir", None, "Where to write the PNGs and weights (default: workdir/attention).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_integer("beam_size", None, "Beam size of the translation (default: the config's).")


FLAGS = flags.FLAGS


@contextlib.contextmanager
def recorded_attention():
    """Every call of dot_product_attention inside appends its weights [batch, heads, q_length, k_length]."""
    original, weights = attention_lib.dot_product_attention, []

    def recording(query, key, value, mask, dropout, *, deterministic, rngs):
        logits = jnp.einsum("bqhd,bkhd->bhqk", query / jnp.sqrt(query.shape[-1]), key,
                            preferred_element_type=jnp.float32)
        weights.append(np.asarray(jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min), axis=-1)))
        return original(query, key, value, mask, dropout, deterministic=deterministic, rngs=rngs)

    attention_lib.dot_product_attention = recording
    try:
        yield weights
    finally:
        attention_lib.dot_product_attention = original


def attention_maps(restored: Restored, source: str) -> dict:
    """Translate `source`; its tokens and the attention weights of a teacher-forced pass over the translation."""
    search = restored.settings.decode.search_fn(restored.graphdef, restored.settings.seed,
                                                model_config=restored.model_config)
    [target_ids] = decode.search_sentences(search, restored.params, restored.tokenizer, [source], 1,
                                           restored.model_config.position_limit).best_ids()
    if not len(target_ids):
        raise ValueError("the source sentence is empty: there is nothing to attend to")
    [source_ids] = restored.tokenizer.encode([source])
    graphdef, params = restored.graphdef, restored.params
    if restored.model_config.scan_layers:  # the recording needs one attention call per layer, not one scan
        graphdef = model_graphdef(dataclasses.replace(restored.model_config, scan_layers=False))
        params = unstack_layer_params(params)
    model = nnx.merge(graphdef, params)
    decoder_inputs = np.concatenate([[0], target_ids[:-1]])[None]
    with recorded_attention() as weights:
        model(jnp.asarray(source_ids)[None], jnp.asarray(decoder_inputs))
    config = restored.model_config
    if len(weights) != config.num_encoder_layers + 2 * config.num_decoder_layers:
        raise RuntimeError(f"recorded {len(weights)} attention calls; expected {config.num_encoder_layers} encoder "
                           f"and 2 x {config.num_decoder_layers} decoder ones (has the attention code changed?)")
    decoder = weights[config.num_encoder_layers:]
    return dict(source_tokens=restored.tokenizer.pieces(source_ids), target_tokens=restored.tokenizer.pieces(target_ids),
                translation=restored.tokenizer.decode(target_ids),
                decoder_self=np.stack([w[0] for w in decoder[0::2]]), cross=np.stack([w[0] for w in decoder[1::2]]))


def draw(weights: np.ndarray, rows: list[str], columns: list[str], title: str, path: str) -> None:
    """One heatmap per layer and head, plus each layer's average over heads: [layers, heads, rows, columns]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, heads = weights.shape[:2]
    size = 0.25 * max(len(rows), len(columns)) + 1.5
    figure, axes = plt.subplots(layers, heads + 1, figsize=(size * (heads + 1), size * layers), squeeze=False)
    for layer in range(layers):
        for head in range(heads + 1):
            ax = axes[layer, head]
            image = weights[layer, head] if head < heads else weights[layer].mean(axis=0)
            ax.imshow(image, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            ax.set_title(f"layer {layer + 1} " + (f"head {head + 1}" if head < heads else "average"), fontsize=8)
            ax.set_xticks(range(len(columns)), columns, rotation=90, fontsize=7)
            ax.set_yticks(range(len(rows)), rows, fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_attention(restored: Restored, source: str, output_dir: str) -> dict:
    maps = attention_maps(restored, source)
    os.makedirs(output_dir, exist_ok=True)
    draw(maps["cross"], maps["target_tokens"], maps["source_tokens"], "cross-attention (rows: target, columns: "
         "source)", os.path.join(output_dir, "cross_attention.png"))
    draw(maps["decoder_self"], maps["target_tokens"], maps["target_tokens"], "decoder self-attention",
         os.path.join(output_dir, "decoder_self_attention.png"))
    np.savez(os.path.join(output_dir, "attention.npz"), **maps)
    return maps


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.route_libraries()  # absl's records (orbax, grain, the data pipeline) in the console's format
    restored = restore(FLAGS.workdir, FLAGS.step, decode_overrides={"beam_size": FLAGS.beam_size})
    output_dir = FLAGS.output_dir or os.path.join(FLAGS.workdir, "attention")
    maps = plot_attention(restored, FLAGS.source, output_dir)
    print(f"translation: {maps['translation']}")
    strongest = maps["cross"].mean(axis=(0, 1)).argmax(axis=-1)  # averaged over layers and heads
    for target, source in zip(maps["target_tokens"], strongest):
        print(f"{target:>16} <- {maps['source_tokens'][source]}")
    print(f"wrote {output_dir}/cross_attention.png, decoder_self_attention.png, attention.npz")


if __name__ == "__main__":
    define_flags()
    app.run(main)
