"""Sharded training on 8 fake CPU devices. Needs XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX
starts, so sharding_test.py runs this module in a subprocess; in the ordinary 1-device session it is skipped.

Fast: an accumulated step on (2,2,2) equals the big batch on (1,1,1), and so does a step of performer and of the
ssm mixer, one of minimum risk training, and one of a mixture of experts split over an expert axis of 4;
parameters are born sharded; a checkpoint saved on one mesh restores onto another. Slow: one step with dropout on
(8,1,1), (2,4,1), (2,2,2) equals (1,1,1); local and linformer attention, and each model family, on (2,2,2);
accumulation over 4 slices on (2,1,1); bfloat16 trains.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (run by sharding_test.py)")

from transformer import sharding  # noqa: E402
from transformer.checkpoint import Checkpointer  # noqa: E402
from transformer.model import ModelConfig  # noqa: E402
from transformer.model.config import ATTENTION_FIELDS, allowed_kinds  # noqa: E402
from transformer.optim import OptimizerConfig, make_optimizer  # noqa: E402
from transformer.plan import abstract_train_state, create_train_state, make_steps, model_graphdef, state_shardings
from transformer.settings import Settings, TrainConfig

# swish, not the paper's ReLU: a pre-activation within rounding of ReLU's kink takes the other side under another
# reduction order or codegen, and one such unit moved grad_norm by 1e-3 (performer, at LayerNorm eps 1e-5); a smooth
# activation keeps one step's results within 1e-7, so 1e-5 measures the sharding alone.
MODEL = ModelConfig(vocab_size=64, emb_dim=32, num_heads=4, num_encoder_layers=1, num_decoder_layers=1, mlp_dim=64,
                    dropout_rate=0.1, activation="swish")
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 1, 1)]


def make_batch(rows=8, length=12, seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(3, 64, (rows, length)).astype(np.int32)
    targets = rng.integers(3, 64, (rows, length)).astype(np.int32)
    for row in range(rows):  # padded tails of different lengths
        inputs[row, length - row:] = 0
        targets[row, length - (row + 3) % length:] = 0
    return {"inputs": inputs, "targets": targets}


def setup(mesh_sizes, model=MODEL, num_microbatches=1, objective="mle"):
    mesh_config = sharding.MeshConfig(*mesh_sizes)
    devices = jax.devices()[:int(np.prod(mesh_sizes))]
    mesh = sharding.make_mesh(mesh_config, devices)
    # Adam's first update is lr g / (|g| + eps), whose slope lr / (4 eps) at |g| ~ eps turns the rounding of another
    # reduction order (~1e-9 on a gradient) into ~1e-5 on a parameter at the paper's eps=1e-9 (seen here even at 1e-6).
    # eps=1e-3 keeps that slope near 1, so 1e-5 measures the sharding and accumulation, not that amplification.
    optimizer, schedule = make_optimizer(OptimizerConfig(warmup_steps=10, adam_eps=1e-3), model.emb_dim)
    shardings = state_shardings(model, optimizer, mesh, mesh_config)
    batch_sharding = sharding.batch_sharding(mesh, mesh_config)
    train, _ = make_steps(model_graphdef(model), optimizer, schedule,
                          TrainConfig(num_microbatches=num_microbatches, objective=objective, risk_candidates=4),
                          shardings, batch_sharding)
    state = create_train_state(model, optimizer, seed=0, shardings=shardings)
    return state, train, batch_sharding, shardings, optimizer


@functools.cache
def one_step(mesh_sizes, num_microbatches=1, dropout_rate=0.1, kind="dense", experts=0, family="encoder_decoder",
             objective="mle"):
    kinds = {field: kind if kind in allowed_kinds(field) else "dense" for field in ATTENTION_FIELDS}
    model = dataclasses.replace(MODEL, dropout_rate=dropout_rate, local_window=3, performer_features=16, ssm_state=16,
                                ssm_head_dim=16, ssm_chunk=5, **kinds)
    if family != "encoder_decoder":  # the two stacks' layers as one stack of the family
        stack = "num_decoder_layers" if family == "decoder_only" else "num_encoder_layers"
        model = dataclasses.replace(model, family=family, masked_side="both",
                                    **{"num_encoder_layers": 0, "num_decoder_layers": 0, stack: 2})
    if experts:  # every layer a mixture, top-2, with room for every token (capacity = k x row / E x E / k)
        model = dataclasses.replace(model, num_experts=experts, experts_per_token=2, expert_every=1,
                                    capacity_factor=experts / 2)
    state, train, batch_sharding, _, _ = setup(mesh_sizes, model, num_microbatches, objective)
    born = jax.tree.map(lambda x: (x.sharding, x.addressable_shards[0].data.shape), state)  # before donation
    state, metrics = train(state, sharding.place_batch(make_batch(), batch_sharding))
    return jax.device_get(state.params), jax.device_get(metrics), born


def assert_same_step(result, expected):
    (params, metrics, _), (expected_params, expected_metrics, _) = result, expected
    for key in ("loss", "nll", "correct", "denominator", "source_tokens", "grad_norm"):
        np.testing.assert_allclose(metrics[key], expected_metrics[key], rtol=1e-5, err_msg=key)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(expected_params)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_an_accumulated_step_on_2x2x2_equals_the_big_batch_on_one_device():
    """The fast check (two compilations): sharding over data, fsdp and tensor, and accumulation over 2 slices."""
    assert_same_step(one_step((2, 2, 2), num_microbatches=2, dropout_rate=0.0),
                     one_step((1, 1, 1), dropout_rate=0.0))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_sizes", MESHES[:3])
def test_one_step_with_dropout_on_a_mesh_equals_one_device(mesh_sizes):
    assert_same_step(one_step(mesh_sizes), one_step((1, 1, 1)))


# performer (sums over every sublayer) and ssm (a scan between chunks) by default; local and linformer, whose parts
# are plain einsums, are slow
@pytest.mark.parametrize("kind", [pytest.param("local", marks=pytest.mark.slow),
                                  pytest.param("linformer", marks=pytest.mark.slow), "performer", "ssm"])
def test_each_attention_kind_steps_on_2x2x2_as_on_one_device(kind):
    """Rows of 12 tokens (one sentence each) against a window of 3, a projection to 32 rows, 16 random features
    (performer in all three sublayers) or chunks of 5 (ssm, the decoder's mixer): the kind's own computation (local's
    blocks, linformer's projection, performer's sums, the mixer's chunked scan with its inner width over tensor),
    sharded over data, fsdp and tensor, gives the one-device step."""
    sharded = one_step((2, 2, 2), dropout_rate=0.0, kind=kind)
    assert_same_step(sharded, one_step((1, 1, 1), dropout_rate=0.0, kind=kind))
    if kind == "ssm":  # [embed, inner]: embed over fsdp, the inner width (the heads' channels) over tensor
        in_x = sharded[2].params["decoder_layers"][0]["self_attention"]["in_x"]["kernel"]
        assert tuple(in_x[0].spec) == ("fsdp", "tensor") and in_x[1] == (16, 32), in_x


@pytest.mark.slow
@pytest.mark.parametrize("family", ["decoder_only", "encoder_only"])
def test_each_family_steps_on_2x2x2_as_on_one_device(family):
    """decoder_only's joined stream and prefix mask, encoder_only's masking (drawn in the step from its key, the same
    tokens on any mesh) over the joined pair, sharded over data, fsdp and tensor, give the one-device step."""
    sharded = one_step((2, 2, 2), dropout_rate=0.0, family=family)
    assert_same_step(sharded, one_step((1, 1, 1), dropout_rate=0.0, family=family))
    assert sharded[1]["denominator"] > 0


def test_a_risk_step_on_2x2x2_with_two_slices_equals_one_device():
    """Minimum risk training: the 4 candidates of each of the 8 rows, sampled inside the step, their BLEU and their
    expected risk, with the rows sharded over data, fsdp and tensor and the gradient accumulated over 2 slices, give
    the one-device step: the samples are drawn from each row's own key, whatever device holds the row."""
    sharded = one_step((2, 2, 2), num_microbatches=2, dropout_rate=0.0, objective="risk")
    single = one_step((1, 1, 1), dropout_rate=0.0, objective="risk")
    assert_same_step(sharded, single)
    for key in ("risk", "reward", "sentences"):
        np.testing.assert_allclose(sharded[1][key], single[1][key], rtol=1e-5, err_msg=key)
    assert single[1]["sentences"] == 8 and 0 < single[1]["risk"] / 8 <= 1


def test_experts_split_over_an_expert_axis_of_4_step_as_on_one_device():
    """(data, fsdp, tensor, expert) = (2, 1, 1, 4): each device holds one of the 4 experts of every layer and a
    quarter of the rows of the data shard; with capacity for every token, the step is the one-device step, the
    router's losses and loads included."""
    sharded, single = one_step((2, 1, 1, 4), dropout_rate=0.0, experts=4), one_step((1, 1, 1), dropout_rate=0.0,
                                                                                      experts=4)
    assert_same_step(sharded, single)
    for key in ("router_balance", "router_z", "expert_dropped", "expert_load_max"):
        np.testing.assert_allclose(sharded[1][key], single[1][key], rtol=1e-5, err_msg=key)
    assert single[1]["expert_dropped"] == 0
    expert_sharding, expert_shard = sharded[2].params["encoder_layers"][0]["feed_forward"]["hidden"]
    assert expert_sharding.spec[0] == "expert" and expert_shard == (1, 32, 64)  # [experts, embed, mlp]


def test_parameters_and_moments_are_born_sharded_by_their_logical_names():
    _, _, born = one_step((2, 2, 2), num_microbatches=2, dropout_rate=0.0)
    kernel_sharding, kernel_shard = born.params["encoder_layers"][0]["feed_forward"]["hidden"]["kernel"]
    assert kernel_sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")  # [embed, mlp]
    assert kernel_shard == (16, 32)
    table_sharding, _ = born.params["source_embedder"]["embedding"]["embedding"]  # [vocab, embed]
    assert table_sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    moment_sharding, _ = born.opt_state[0].mu["encoder_layers"][0]["feed_forward"]["hidden"]["kernel"]
    assert moment_sharding == kernel_sharding
    assert born.step[0].is_fully_replicated


@pytest.mark.slow
def test_gradient_accumulation_equals_the_big_batch():
    model = dataclasses.replace(MODEL, dropout_rate=0.0)
    results = []
    for num_microbatches in (1, 4):
        state, train, batch_sharding, _, _ = setup((2, 1, 1), model, num_microbatches)
        state, metrics = train(state, sharding.place_batch(make_batch(), batch_sharding))
        results.append((jax.device_get(state.params), jax.device_get(metrics)))
    (big_params, big_metrics), (accumulated_params, accumulated_metrics) = results
    for key in ("loss", "nll", "correct", "denominator", "source_tokens"):
        np.testing.assert_allclose(accumulated_metrics[key], big_metrics[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(accumulated_metrics["grad_norm"], big_metrics["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(accumulated_params), jax.tree.leaves(big_params)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_checkpoint_saved_on_one_mesh_restores_onto_another(tmp_path):
    state, _, _, _, optimizer = setup((2, 2, 2))
    saver = Checkpointer(str(tmp_path / "checkpoints"), save_every_steps=1, keep=1, use_async=False)
    saver.save(1, state)
    saver.wait()
    saver.close()
    mesh_config = sharding.MeshConfig(1, 4, 2)
    mesh = sharding.make_mesh(mesh_config)
    shardings = state_shardings(MODEL, optimizer, mesh, mesh_config)
    reader = Checkpointer(str(tmp_path / "checkpoints"), save_every_steps=1, keep=1, use_async=False, read_only=True)
    restored = reader.restore(abstract_train_state(MODEL, optimizer, 0, shardings), 1)
    reader.close()
    for a, b, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert a.sharding == s
        np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b))
    kernel = restored.params["decoder_layers"][0]["feed_forward"]["output"]["kernel"]  # [mlp, embed]
    assert kernel.addressable_shards[0].data.shape == (32, 8)  # mlp / tensor 2, embed / fsdp 4


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_parameters_and_trains():
    model = dataclasses.replace(MODEL, dtype="bfloat16")
    state, train, batch_sharding, _, _ = setup((2, 2, 2), model)
    batch = sharding.place_batch(make_batch(), batch_sharding)
    losses = []
    for _ in range(25):
        state, metrics = train(state, batch)
        losses.append(float(metrics["loss"] / metrics["denominator"]))
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state.params))
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim)
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0]


def test_compile_only_reports_the_memory_per_device_of_a_mesh_before_anything_is_allocated():
    """scripts/benchmark.py --compile_only compiles train.py's own batch and vocabulary for the config: with fsdp=8
    each device holds an eighth of the parameters and the optimizer state, which the reported arguments show; a
    batch the mesh cannot split is compiled as train.py would change it, and the change is said."""
    from configs import default
    from tiny import load_script

    benchmark = load_script("benchmark")
    config = default.get_config()
    config.model.emb_dim, config.model.num_heads, config.model.mlp_dim = 32, 4, 64
    config.model.num_encoder_layers = config.model.num_decoder_layers = 1
    config.mesh.data, config.mesh.fsdp = 1, 8
    config.data.vocab_size, config.data.max_length, config.data.tokens_per_batch = 64, 12, 96
    sizes = dict(batch=99, source_length=99, target_length=99, vocab_size=99)  # the --batch flags: not used here

    result = benchmark.run_compile_only(config, sizes)
    memory = result["memory"]
    assert result["mode"] == "compile_only" and result["devices"] == 8
    assert result["mesh"] == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    assert (result["batch"], result["source_length"], result["vocab_size"], result["tokens_per_step"]) == (8, 12, 64, 96)
    assert memory["total_per_device_bytes"] == (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
                                                - memory["alias_size_in_bytes"] + memory["temp_size_in_bytes"])
    assert memory["alias_size_in_bytes"] > 0  # the state is donated
    settings = Settings.from_config(config)
    model_config = settings.model_config(64)
    optimizer, _ = make_optimizer(settings.optimizer, model_config.emb_dim)
    state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(
        abstract_train_state(model_config, optimizer, 0)))
    # An eighth of the state (and of the batch) per device, plus the replicated scalars: well under a quarter.
    assert memory["argument_size_in_bytes"] < 0.25 * state_bytes
    config.mesh.data, config.mesh.fsdp = 8, 1
    config.data.tokens_per_batch = 144  # 12 rows: the nearest multiple of 8 above and below tie; the larger wins
    result = benchmark.run_compile_only(config, sizes)
    assert result["batch"] == 16 and "training on 16 rows = 192 tokens" in result["batch_note"]
