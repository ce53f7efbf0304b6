"""Throughput benchmarks on random-init models at fixed shapes (speed targets are checked here, not in tests).

    PYTHONPATH=. python scripts/benchmark.py --mode=decode --shape=small,base

--mode=decode: beam search of `--batch` random source sentences of `--source_length` tokens, every sentence
decoding exactly `--new_tokens` tokens (early stopping off, as the peers' `generate(eos_token_id=None)`), in
float32; reports sentences/s and new tokens/s (of the returned hypothesis: batch * new_tokens / time, as the
peers count them), and the speed-up of caching the cross-attention keys/values against recomputing them at
every step (flax examples/wmt's way). Median of --repeats timed runs after one compiling run.
"""

import functools
import json
import statistics
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from transformer.decode import beam_search
from transformer.model import ModelConfig, Transformer

flags.DEFINE_enum("mode", "decode", ["decode"], "What to measure.")
flags.DEFINE_list("shape", ["small"], "Model shapes (DECODE_SHAPES): small, base.")
flags.DEFINE_integer("batch", 64, "Source sentences per batch.")
flags.DEFINE_integer("source_length", 32, "Tokens per source sentence (all real, no padding).")
flags.DEFINE_integer("new_tokens", 40, "Tokens decoded per sentence (no early stop).")
flags.DEFINE_integer("beam_size", 4, "Beam size.")
flags.DEFINE_integer("repeats", 3, "Timed runs (the median is reported).")
flags.DEFINE_bool("compare_recompute", True, "Also time recomputing cross-attention keys/values at every step.")
flags.DEFINE_string("json_out", None, "Also write the results here as JSON.")
FLAGS = flags.FLAGS

# The shapes of /work/shared/peers/bench_common.py CONFIGS (copied: that folder is not part of the project).
DECODE_SHAPES = {
    "small": dict(emb_dim=256, num_layers=3, num_heads=4, mlp_dim=1024, vocab_size=8000),
    "base": dict(emb_dim=512, num_layers=6, num_heads=8, mlp_dim=2048, vocab_size=32000),
}


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first, compiling, call; seconds of each of `repeats` further calls)."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, times


def run_decode(shape: str, *, batch: int, source_length: int, new_tokens: int, beam_size: int, repeats: int,
               compare_recompute: bool) -> dict:
    s = DECODE_SHAPES[shape]
    config = ModelConfig(vocab_size=s["vocab_size"], emb_dim=s["emb_dim"], num_heads=s["num_heads"],
                         num_encoder_layers=s["num_layers"], num_decoder_layers=s["num_layers"],
                         mlp_dim=s["mlp_dim"], dropout_rate=0.0)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    inputs = np.random.default_rng(1).integers(3, config.vocab_size, size=(batch, source_length)).astype(np.int32)
    # Every sentence may produce source_length + max_extra_length = new_tokens tokens, and without early stopping
    # every sentence runs to that limit.
    max_extra_length = new_tokens - source_length
    result = dict(mode="decode", shape=shape, model=s, batch=batch, source_length=source_length,
                  new_tokens=new_tokens, beam_size=beam_size, dtype="float32", backend=jax.default_backend(),
                  devices=str(jax.devices()), jax=jax.__version__)
    variants = {"cached": False, "recomputed": True} if compare_recompute else {"cached": False}
    for name, recompute in variants.items():
        search = jax.jit(functools.partial(beam_search, graphdef=graphdef, beam_size=beam_size, alpha=0.6,
                                           max_extra_length=max_extra_length, early_stopping=False,
                                           recompute_cross_attention=recompute))
        first, times = timed(lambda: search(params, inputs)[0], repeats)
        sequences = np.asarray(search(params, inputs)[0][:, 0])
        median = statistics.median(times)
        result[name] = dict(first_call_seconds=first, seconds=times, median_seconds=median,
                            sentences_per_second=batch / median, tokens_per_second=batch * new_tokens / median,
                            decoded_length=int(np.max(np.sum(sequences != 0, axis=1))))
        print(f"{shape} {name}: {batch / median:.1f} sentences/s, {batch * new_tokens / median:.0f} tokens/s "
              f"(median of {[round(t, 3) for t in times]} s; first call {first:.1f} s)", flush=True)
    if compare_recompute:
        result["cached_speedup"] = result["recomputed"]["median_seconds"] / result["cached"]["median_seconds"]
        print(f"{shape}: caching cross-attention keys/values is {result['cached_speedup']:.2f}x faster", flush=True)
    return result


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    unknown = sorted(set(FLAGS.shape) - set(DECODE_SHAPES))
    if unknown:
        raise app.UsageError(f"--shape: unknown {unknown}; known: {sorted(DECODE_SHAPES)}")
    if FLAGS.new_tokens < FLAGS.source_length:
        raise app.UsageError(f"--new_tokens={FLAGS.new_tokens} must be >= --source_length={FLAGS.source_length}: "
                             "an output may have at most source length + max_extra_length tokens")
    results = [run_decode(shape, batch=FLAGS.batch, source_length=FLAGS.source_length, new_tokens=FLAGS.new_tokens,
                          beam_size=FLAGS.beam_size, repeats=FLAGS.repeats, compare_recompute=FLAGS.compare_recompute)
               for shape in FLAGS.shape]
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    app.run(main)
