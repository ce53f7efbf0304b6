"""transformer.throughput and the step's attention-pair counts: the analytic model FLOPs behind MFU (against the
peer's count and against the matrix products of the traced train step), the peak FLOP/s table and the cached CPU
peak."""

import functools
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import ClosedJaxpr, Jaxpr

from transformer import throughput
from transformer.model import ModelConfig, build
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.steps import attention_pairs, train_step
from transformer.plan import abstract_train_state, model_graphdef

SHAPES = {  # the two benchmark shapes: config, batch rows, source length, target length
    "small": (ModelConfig(vocab_size=8000, emb_dim=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3,
                          mlp_dim=1024), 64, 32, 32),
    "base": (ModelConfig(vocab_size=32000, emb_dim=512, num_heads=8, num_encoder_layers=6, num_decoder_layers=6,
                         mlp_dim=2048), 32, 32, 32),
}


def flops_from_the_parameters(config: ModelConfig, rows: int, source_length: int, target_length: int) -> float:
    """The peer reference's count, with the matmul parameters read off a real model rather than written out: 6 x (each
    kernel's size x the tokens it sees: the encoder's and the cross-attention's keys and values see the source)
    + 12 x d_model x rows x layers x (S^2 + T^2 + T S) + 6 x vocab x d_model x rows x T."""
    model = nnx.eval_shape(lambda: build(config, rngs=nnx.Rngs(0)))
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


def subjaxprs(value):
    """The jaxprs an equation's parameter holds (a call's body, a scan's body, a custom_jvp's function)."""
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from subjaxprs(item)


def matmul_flops(jaxpr) -> int:
    """2 x M x N x K of every dot_general the traced computation runs (a scan's body once per iteration)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[d] for d in contracting]))
        assert eqn.primitive.name not in ("while", "cond"), eqn.primitive  # run counts a trace cannot tell
        for value in eqn.params.values():
            total += eqn.params.get("length", 1) * sum(matmul_flops(sub) for sub in subjaxprs(value))
    return total


def test_model_flops_are_the_matmul_flops_the_traced_train_step_runs():
    """An independent count: every matrix product in the jaxpr of the real train step (forward, backward through
    autodiff, optimizer), shapes read off the trace. Unequal layer counts and lengths, and dropout on, so that a term
    counted on the wrong side, with the wrong layer count or the wrong forward/backward factor would show."""
    config = ModelConfig(vocab_size=2000, emb_dim=128, num_heads=4, num_encoder_layers=2, num_decoder_layers=1,
                         mlp_dim=512, dropout_rate=0.1)
    rows, source_length, target_length = 8, 40, 24
    optimizer, schedule = make_optimizer(OptimizerConfig(), config.emb_dim)
    step = functools.partial(train_step, graphdef=model_graphdef(config), optimizer=optimizer,
                             schedule=schedule, label_smoothing=0.1)
    batch = {"inputs": jax.ShapeDtypeStruct((rows, source_length), jnp.int32),
             "targets": jax.ShapeDtypeStruct((rows, target_length), jnp.int32)}
    jaxpr = jax.make_jaxpr(step)(abstract_train_state(config, optimizer, 0), batch)
    assert matmul_flops(jaxpr.jaxpr) == throughput.model_flops_of_shape(config, rows, source_length, target_length)


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


def test_throughput_metrics_are_rates_of_the_whole_window_and_mfu_a_share_of_the_peak():
    config, rows, source_length, target_length = SHAPES["small"]
    step = {"source_tokens": rows * source_length, "target_tokens": rows * target_length,
            "encoder_pairs": rows * source_length**2, "decoder_pairs": rows * target_length**2,
            "cross_pairs": rows * source_length * target_length}
    one = throughput.window_metrics(step, config, seconds=2.0, steps=1, peak_flops=1e11)
    # A window of two such steps in twice the time has the same rates: its sums are divided by its seconds.
    two = throughput.window_metrics({key: 2 * value for key, value in step.items()}, config, seconds=4.0, steps=2,
                                     peak_flops=1e11)
    assert two == pytest.approx(one, rel=1e-12)
    faster = throughput.window_metrics(step, config, seconds=1.0, steps=1, peak_flops=1e11)
    assert faster == pytest.approx({key: 2 * value for key, value in one.items()}, rel=1e-12)
    assert one["all_tokens_per_second"] > one["tokens_per_second"] > 0  # target tokens alone, then both sides
    # MFU is the share of the peak: a doubled peak halves it and moves nothing else; no peak, no MFU.
    higher_peak = throughput.window_metrics(step, config, seconds=2.0, steps=1, peak_flops=2e11)
    assert higher_peak == pytest.approx({**one, "mfu": one["mfu"] / 2}, rel=1e-12)
    assert "mfu" not in throughput.window_metrics(step, config, seconds=2.0, steps=1, peak_flops=None)
    # The same tokens in shorter (packed) sentences attend over fewer pairs: fewer FLOPs in the same seconds.
    packed = throughput.window_metrics({**step, **{key: step[key] / 4 for key in ("encoder_pairs", "decoder_pairs",
                                                                                     "cross_pairs")}},
                                        config, seconds=2.0, steps=1, peak_flops=1e11)
    assert packed["tokens_per_second"] == one["tokens_per_second"]
    assert packed["model_flops_per_second"] < one["model_flops_per_second"]


def test_accelerator_peaks_are_found_by_the_device_kind_jax_reports():
    def peak(platform, kind, dtype="bfloat16"):
        return throughput.device_peak_flops(types.SimpleNamespace(platform=platform, device_kind=kind), dtype=dtype)
    table = dict(throughput.PEAK_BF16_FLOPS)
    for kind, flops in throughput.PEAK_BF16_FLOPS:  # no row is shadowed by another that matches its name first
        assert peak("gpu", kind) == flops and peak("gpu", kind, "float32") == flops / 2, kind
    # device_kind as JAX spells it -> the row of that chip, also where the name contains another chip's name.
    for kind, row in [("NVIDIA H200", "H200"), ("NVIDIA GH200 480GB", "GH200"), ("NVIDIA A100-SXM4-80GB", "A100"),
                      ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("Tesla V100-SXM2-16GB", "V100"),
                      ("Tesla V100S-PCIE-32GB", "V100S"), ("TPU v4", "TPU v4"), ("TPU v5 lite", "TPU v5 lite"),
                      ("TPU v5", "TPU v5p"), ("TPU v6 lite", "TPU v6")]:
        assert peak("tpu" if kind.startswith("TPU") else "gpu", kind) == table[row], kind
    assert table["L4"] != table["L40S"] and table["V100"] != table["V100S"] and table["TPU v5 lite"] != table["TPU v5p"]
    assert peak("gpu", "a GPU nobody listed") is None


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
