"""transformer.throughput and the step's attention-pair counts: the analytic model FLOPs behind MFU, the peak
FLOP/s table and the cached CPU peak."""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer import throughput, trainer
from transformer.model import ModelConfig, Transformer
from transformer.steps import attention_pairs

SHAPES = {  # the two benchmark shapes: config, batch rows, source length, target length
    "small": (ModelConfig(vocab_size=8000, emb_dim=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3,
                          mlp_dim=1024), 64, 32, 32),
    "base": (ModelConfig(vocab_size=32000), 32, 32, 32),
}


def flops_from_the_parameters(config: ModelConfig, rows: int, source_length: int, target_length: int) -> float:
    """The peer reference's count, with the matmul parameters read off a real model rather than written out: 6 x (each
    kernel's size x the tokens it sees: the encoder's and the cross-attention's keys and values see the source)
    + 12 x d_model x rows x layers x (S^2 + T^2 + T S) + 6 x vocab x d_model x rows x T."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    dense = 0
    leaves, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    for path, leaf in leaves:
        names = [str(getattr(key, "key", getattr(key, "idx", key))) for key in path]
        if "kernel" not in names:
            continue
        on_source = names[0] == "encoder_layers" or ("cross_attention" in names and
                                                     ("key" in names or "value" in names))
        dense += 6 * int(np.prod(leaf.shape)) * rows * (source_length if on_source else target_length)
    assert config.num_encoder_layers == config.num_decoder_layers  # the peer's formula has one layer count
    attention = (12 * config.emb_dim * rows * config.num_encoder_layers
                 * (source_length**2 + target_length**2 + target_length * source_length))
    output = 6 * config.vocab_size * config.emb_dim * rows * target_length
    return float(dense + attention + output)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_model_flops_count_each_kernel_on_the_tokens_it_sees(shape):
    config, rows, source_length, target_length = SHAPES[shape]
    assert throughput.model_flops_of_shape(config, rows, source_length, target_length) == pytest.approx(
        flops_from_the_parameters(config, rows, source_length, target_length), rel=1e-12)
    # Unequal lengths: a source term counted on target tokens (or the reverse) would show here.
    assert throughput.model_flops_of_shape(config, rows, 40, 24) == pytest.approx(
        flops_from_the_parameters(config, rows, 40, 24), rel=1e-12)


def test_the_base_step_is_the_figure_in_the_benchmarks():
    config, rows, source_length, target_length = SHAPES["base"]
    assert throughput.model_flops_of_shape(config, rows, source_length, target_length) == 374_870_114_304


def test_attention_pairs_count_each_packed_sentence_square():
    # One row of two packed sentences (sources of 2 and 3 tokens, targets of 3 and 1), then padding; a second,
    # unpacked row (no segmentation: the non-zero tokens are one sentence).
    packed = {"inputs": jnp.array([[5, 6, 7, 8, 9, 0]]), "inputs_segmentation": jnp.array([[1, 1, 2, 2, 2, 0]]),
              "targets": jnp.array([[4, 4, 4, 3, 0, 0]]), "targets_segmentation": jnp.array([[1, 1, 1, 2, 0, 0]])}
    pairs = {key: float(value) for key, value in attention_pairs(packed).items()}
    assert pairs == {"encoder_pairs": 2 * 2 + 3 * 3, "decoder_pairs": 3 * 3 + 1 * 1, "cross_pairs": 3 * 2 + 1 * 3}
    plain = {"inputs": jnp.array([[5, 6, 7, 0]]), "targets": jnp.array([[4, 4, 0, 0]])}
    pairs = {key: float(value) for key, value in attention_pairs(plain).items()}
    assert pairs == {"encoder_pairs": 9, "decoder_pairs": 4, "cross_pairs": 6}


def test_throughput_metrics_divide_the_counted_flops_by_time_and_peak():
    config, rows, source_length, target_length = SHAPES["small"]
    summary = {"source_tokens": rows * source_length, "target_tokens": rows * target_length,
               "encoder_pairs": rows * source_length**2, "decoder_pairs": rows * target_length**2,
               "cross_pairs": rows * source_length * target_length}
    two_steps = {key: 2 * value for key, value in summary.items()}
    out = trainer.throughput_metrics(two_steps, config, seconds=4.0, steps=2, peak_flops=1e11)
    flops = 2 * throughput.model_flops_of_shape(config, rows, source_length, target_length)
    assert out["tokens_per_second"] == 2 * rows * target_length / 4.0
    assert out["all_tokens_per_second"] == 2 * rows * (source_length + target_length) / 4.0
    assert out["steps_per_second"] == 0.5
    assert out["mfu"] == pytest.approx(flops / 4.0 / (1e11 * jax.device_count()))
    assert "mfu" not in trainer.throughput_metrics(two_steps, config, seconds=4.0, steps=2, peak_flops=None)


def test_accelerator_peaks_come_from_the_table_by_device_kind():
    def device(platform, kind):
        return types.SimpleNamespace(platform=platform, device_kind=kind)
    assert throughput.device_peak_flops(device("gpu", "NVIDIA H200")) == 989e12
    assert throughput.device_peak_flops(device("gpu", "NVIDIA A100-SXM4-80GB"), dtype="float32") == 156e12
    assert throughput.device_peak_flops(device("tpu", "TPU v5 lite")) == 197e12
    assert throughput.device_peak_flops(device("tpu", "TPU v4")) == 275e12
    assert throughput.device_peak_flops(device("gpu", "NVIDIA L4")) == 121e12
    assert throughput.device_peak_flops(device("gpu", "NVIDIA L40S")) == 362e12  # not the L4's
    assert throughput.device_peak_flops(device("gpu", "NVIDIA GH200 480GB")) == 989e12
    assert throughput.device_peak_flops(device("tpu", "TPU v5p")) == 459e12  # not "TPU v5" (v5e's kind is "lite")
    assert throughput.device_peak_flops(device("tpu", "TPU v6 lite")) == 918e12
    assert throughput.device_peak_flops(device("gpu", "Tesla V100S-PCIE-32GB")) == 130e12
    assert throughput.device_peak_flops(device("gpu", "Tesla V100-SXM2-16GB")) == 125e12
    assert throughput.device_peak_flops(device("gpu", "a GPU nobody listed")) is None


def test_the_cpu_peak_is_measured_once_then_read_from_its_cache(tmp_path, monkeypatch):
    measured = []

    def measure(*args, **kwargs):
        measured.append(args)
        return 1e11 + len(measured)
    monkeypatch.setattr(throughput, "measure_matmul_flops", measure)
    cache = tmp_path / "transformer" / "cpu_peak_flops.json"
    assert throughput.cpu_peak_flops(str(cache)) == 1e11 + 1
    assert throughput.cpu_peak_flops(str(cache)) == 1e11 + 1 and len(measured) == 1  # read back, not measured
    assert os.listdir(cache.parent) == [cache.name]  # written whole, then renamed: no partial file is left
    cache.write_text(json.dumps({"key": "another machine or JAX version", "peak_flops": 5.0}))
    assert throughput.cpu_peak_flops(str(cache)) == 1e11 + 2
    cache.write_text('{"key": ')  # a torn or foreign file is measured again, not an error
    assert throughput.cpu_peak_flops(str(cache)) == 1e11 + 3
    not_a_directory = tmp_path / "a_file"
    not_a_directory.write_text("")
    assert throughput.cpu_peak_flops(str(not_a_directory / "peak.json")) == 1e11 + 4  # unwritable: measured only


def test_the_tests_keep_their_cpu_peak_out_of_the_users_cache():
    # tests/conftest.py: a peak measured while the other test worker runs would be too low for the user's runs.
    assert throughput.CACHE_FILE.startswith(os.environ["TRANSFORMER_TESTS_DIR"] + os.sep)
