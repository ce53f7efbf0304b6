"""Model FLOPs (analytic) and peak FLOP/s of the devices, for the model-FLOPs utilization (MFU) in the logs
and in scripts/benchmark.py.

The count is the one of the reference benchmarks' model_flops_per_step (a PyTorch Marian model at the same shapes,
docs/benchmarks.md), so our MFU and theirs mean the same thing. For one training step (backward = 2 x forward, hence the factors 6 and 12):

  dense     = 6 x (matmul parameters x the tokens they see)
              encoder layer: 4 d^2 (q, k, v, o) + 2 d d_ff               on source tokens
              decoder layer: 4 d^2 (self) + 2 d^2 (cross q, o) + 2 d d_ff on target tokens
                             + 2 d^2 (cross k, v)                         on source tokens
              a mixture-of-experts layer's 2 d d_ff is k x 2 d d_ff + d E (the k experts each token is routed
              to, whether or not capacity drops it, and the router): only the active experts count
  attention = 12 x d x (N_enc x encoder pairs + N_dec x (decoder pairs + cross pairs))
              (QK^T and AV; a pair is a query and a key of the same sentence; causal self-attention counts
              the full square, since the dense masked matrix is computed; an unpadded batch has B S^2 ... pairs)
  output    = 6 x vocab x d x target tokens                               (the pre-softmax projection)

The other families (model.family) count the same parts of what they run: decoder_only's layer is an encoder
layer's 4 d^2 + 2 d d_ff on source and target tokens alike, and its joined stream's pairs are the encoder,
decoder and twice the cross pairs ((s + t)^2 per sentence); encoder_only's encoder runs on the stream it reads
(its source_tokens and encoder_pairs), and its output on every position of that stream (the masked language
model's head is not gathered to the masked tokens).

Embedding lookups, LayerNorm, softmax, dropout, the loss and the optimizer are not counted. Tokens and
pairs are the real (non-padding) ones of the batch, so a packed batch counts its sentences, not its rows.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time

import jax
import numpy as np

from transformer import files
from transformer.model import ModelConfig

# Dense bf16 peak FLOP/s per chip from the vendors' data sheets (no sparsity); float32 matmuls on GPUs run on
# TF32 tensor cores at half these. Matched as a whole word of jax.Device.device_kind ("L4" is not "L40S", "TPU v5"
# is not "TPU v5p", "H200" is not "GH200").
PEAK_BF16_FLOPS = (
    ("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("A100", 312e12), ("A10G", 125e12), ("L40S", 362e12),
    ("L40", 181e12), ("L4", 121e12),
    ("V100S", 130e12), ("V100", 125e12), ("TPU v6", 918e12), ("TPU v5p", 459e12), ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12), ("TPU v5", 459e12), ("TPU v4", 275e12), ("TPU v3", 123e12), ("TPU v2", 45e12),
)  # JAX names v5p "TPU v5", v5e "TPU v5 lite" and v6e "TPU v6 lite"; the v5p/v5e rows catch other spellings.
CACHE_FILE = os.path.join(files.cache_root(), "cpu_peak_flops.json")


def model_flops(config: ModelConfig, *, source_tokens: float, target_tokens: float, encoder_pairs: float,
                decoder_pairs: float, cross_pairs: float) -> float:
    """Training FLOPs (forward + backward) of the formula in the module docstring."""
    d, ff, vocab = config.emb_dim, config.mlp_dim, config.vocab_size
    expert_ff = config.experts_per_token * 2 * d * ff + d * config.num_experts - 2 * d * ff  # over a dense one
    encoder_layer = 4 * d * d + 2 * d * ff
    if config.family == "decoder_only":
        layers, tokens = config.num_decoder_layers, source_tokens + target_tokens
        return float(6 * (layers * encoder_layer + expert_ff * config.expert_layers(layers)) * tokens
                     + 12 * d * layers * (encoder_pairs + decoder_pairs + 2 * cross_pairs)
                     + 6 * vocab * d * target_tokens)
    if config.family == "encoder_only":
        layers = config.num_encoder_layers
        return float(6 * (layers * encoder_layer + expert_ff * config.expert_layers(layers)) * source_tokens
                     + 12 * d * layers * encoder_pairs + 6 * vocab * d * source_tokens)
    decoder_on_targets = 4 * d * d + 2 * d * d + 2 * d * ff
    decoder_on_sources = 2 * d * d
    dense = 6 * (config.num_encoder_layers * encoder_layer * source_tokens
                 + config.num_decoder_layers * (decoder_on_targets * target_tokens + decoder_on_sources * source_tokens)
                 + expert_ff * (config.expert_layers(config.num_encoder_layers) * source_tokens
                                + config.expert_layers(config.num_decoder_layers) * target_tokens))
    attention = 12 * d * (config.num_encoder_layers * encoder_pairs
                          + config.num_decoder_layers * (decoder_pairs + cross_pairs))
    output = 6 * vocab * d * target_tokens
    return float(dense + attention + output)


def model_flops_of_shape(config: ModelConfig, batch: int, source_length: int, target_length: int) -> float:
    """model_flops of a batch with no padding: batch rows of source_length and target_length tokens."""
    return model_flops(config, source_tokens=batch * source_length, target_tokens=batch * target_length,
                       encoder_pairs=batch * source_length**2, decoder_pairs=batch * target_length**2,
                       cross_pairs=batch * source_length * target_length)


def measure_matmul_flops(size: int = 4096, repeats: int = 5, best: bool = False) -> float:
    """The median (or best) FLOP/s of a jitted float32 size^3 matmul on the default device (the reference
    benchmarks' peak_matmul.py takes the median)."""
    matmul = jax.jit(lambda a, b: a @ b)
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), np.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (size, size), np.float32)
    matmul(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2.0 * size**3 / float(np.min(times) if best else np.median(times))


def cpu_peak_flops(cache_file: str = CACHE_FILE) -> float:
    """A measured float32 matmul peak of this CPU (2048^3, ~5 s the first time), cached per machine and JAX
    version, since no table knows a CPU's FLOP/s under its thread count. The best of 10 rather than the median:
    a peak measured while other jobs share the cores would be too low for every later run (MFU above 1)."""
    # The method is part of the key: a cache of the earlier median-of-5 measurement is measured again.
    key = (f"{platform.node()}|{platform.processor() or platform.machine()}|{os.cpu_count()}|jax {jax.__version__}"
           "|best of 10")
    try:
        with open(cache_file, encoding="utf-8") as handle:
            cached = json.load(handle)
        if cached.get("key") == key:
            return float(cached["peak_flops"])
    except (OSError, ValueError, KeyError):
        pass
    peak = measure_matmul_flops(2048, repeats=10, best=True)
    partial = f"{cache_file}.{os.getpid()}"  # then renamed: a process reading meanwhile sees a whole file
    try:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        with open(partial, "w", encoding="utf-8") as handle:
            json.dump({"key": key, "peak_flops": peak}, handle)
        os.replace(partial, cache_file)
    except OSError:  # a read-only home only costs the measurement next time
        if os.path.exists(partial):
            os.remove(partial)
    return peak


def device_peak_flops(device: jax.Device | None = None, dtype: str = "bfloat16") -> float | None:
    """Peak FLOP/s of one device: the table for accelerators (halved for float32), the cached measurement on
    CPU; None for an accelerator the table does not know (MFU is then not logged)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return cpu_peak_flops()
    for kind, flops in PEAK_BF16_FLOPS:
        if re.search(rf"(?<![a-z0-9]){re.escape(kind.lower())}(?![a-z0-9])", device.device_kind.lower()):
            return flops if dtype == "bfloat16" else flops / 2
    return None


def window_metrics(summary: dict[str, float], model_config: ModelConfig, seconds: float, steps: int,
                       peak_flops: float | None) -> dict[str, float]:
    """Tokens/s (real, non-padding tokens) and MFU over a logging window: analytic model FLOPs of the batches'
    real tokens and attention pairs (throughput.model_flops) / seconds / the devices' peak."""
    flops = model_flops(model_config, source_tokens=summary["source_tokens"],
                                   target_tokens=summary["target_tokens"], encoder_pairs=summary["encoder_pairs"],
                                   decoder_pairs=summary["decoder_pairs"], cross_pairs=summary["cross_pairs"])
    out = {"tokens_per_second": summary["target_tokens"] / seconds,
           "all_tokens_per_second": (summary["target_tokens"] + summary["source_tokens"]) / seconds,
           "steps_per_second": steps / seconds, "model_flops_per_second": flops / seconds}
    if peak_flops:
        out["mfu"] = flops / seconds / (peak_flops * jax.device_count())
    return out
