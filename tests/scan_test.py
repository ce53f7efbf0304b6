"""model.scan_layers: each stack as one LayerStack applied by a lax.scan. The same model as the per-layer one (logits,
gradients under remat, greedy and beam search from the same parameters), dropout drawn per layer, a train step whose
traced program does not grow with depth, and checkpoints of the other layout refused by name."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer import decode
from transformer.steps import train_step
from transformer.checkpoint import CheckpointMismatchError, Checkpointer, abstract_like
from transformer.model import ModelConfig, build, stack_layer_params, unstack_layer_params
from transformer.model.blocks import Inputs
from transformer.model.layers import LayerStack
from transformer.model.masks import SelfMask, attention_mask
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.plan import abstract_train_state, count_params, create_train_state, model_graphdef

TINY = dict(vocab_size=40, emb_dim=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=3, mlp_dim=64)
INPUTS = jnp.array([[5, 6, 7, 8, 1, 0, 0], [9, 10, 1, 0, 0, 0, 0]])
DECODER_INPUTS = jnp.array([[0, 11, 12, 13, 14, 1], [0, 15, 16, 1, 0, 0]])


def params_of(model: nnx.Module) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def pair(**overrides):
    """A per-layer model and its scanned twin holding the same parameters (stack_layer_params of the first's):
    (graphdef, params) of each."""
    config = ModelConfig(**{**TINY, **overrides})
    graphdef, state = nnx.split(build(config, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    scanned_graphdef = model_graphdef(dataclasses.replace(config, scan_layers=True))
    return (graphdef, params), (scanned_graphdef, stack_layer_params(params))


@functools.partial(jax.jit, static_argnames="graphdef")
def logits_of(graphdef, params):
    return nnx.merge(graphdef, params)(INPUTS, DECODER_INPUTS)


def primitives(jaxpr) -> set[str]:
    """Names of the primitives of a jaxpr and of every jaxpr nested in it (scan bodies, remat, jit)."""
    names = set()
    for equation in jaxpr.eqns:
        names.add(equation.primitive.name)
        for value in equation.params.values():
            for inner in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    names |= primitives(inner)
    return names


def test_stacks_hold_each_parameter_once_with_a_leading_layer_axis_named_layers():
    config = ModelConfig(**TINY, scan_layers=True)
    model = build(config, rngs=nnx.Rngs(0))
    assert isinstance(model.encoder_layers, LayerStack) and len(model.decoder_layers) == 3
    kernel = model.decoder_layers.stacked.feed_forward.hidden.kernel
    assert kernel.shape == (3, 32, 64)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    assert tuple(specs["decoder_layers"]["stacked"]["feed_forward"]["hidden"]["kernel"]) == ("layers", "embed", "mlp")
    assert tuple(specs["encoder_layers"]["stacked"]["self_attention_residual"]["norm"]["scale"]) == ("layers", "embed")
    # Each layer of the stack is initialised from its own key, as the per-layer model's layers are.
    assert not np.allclose(kernel[0], kernel[1])
    # A layer's view is its slice, with its own (unstacked) axis names.
    layer = model.decoder_layers[1]
    np.testing.assert_array_equal(layer.feed_forward.hidden.kernel[...], kernel[1])
    assert tuple(layer.feed_forward.hidden.kernel.out_sharding) == ("embed", "mlp")
    assert tuple(kernel.out_sharding) == ("layers", "embed", "mlp")  # the stack's own metadata is untouched
    per_layer = params_of(build(ModelConfig(**TINY), rngs=nnx.Rngs(0)))
    stacked = params_of(model)
    assert jax.tree.structure(stack_layer_params(per_layer)) == jax.tree.structure(stacked)
    assert count_params(per_layer) == count_params(stacked)
    unstacked = unstack_layer_params(stack_layer_params(per_layer))
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, b), unstacked, per_layer)))


@pytest.mark.parametrize("overrides", [dict(), dict(layer_norm="pre", tie_output_embedding=False,
                                                     share_embeddings=False, positional_encoding="learned")])
def test_scanned_logits_equal_the_per_layer_models_for_the_same_parameters(overrides):
    (graphdef, params), (scanned_graphdef, scanned_params) = pair(**overrides)
    np.testing.assert_allclose(logits_of(scanned_graphdef, scanned_params), logits_of(graphdef, params),
                               atol=1e-5, rtol=1e-5)


def test_dropout_draws_a_key_per_layer():
    """Under dropout, the scanned encoder equals its layers applied one by one with the keys of one split per layer;
    with every layer holding the same parameters, sharing one key among them would give another output."""
    config = ModelConfig(**TINY, scan_layers=True, dropout_rate=0.3, relu_dropout_rate=0.2)
    model = build(config, rngs=nnx.Rngs(0))
    stack = model.encoder_layers.stacked
    graphdef, state = nnx.split(stack)
    nnx.update(stack, jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), state))  # identical layers
    key = jax.random.key(7)

    @nnx.jit
    def scanned(model, key):
        return model.encode(INPUTS, deterministic=False, rngs=nnx.Rngs(dropout=key))

    @nnx.jit(static_argnames="shared")
    def one_by_one(model, key, shared):
        segmentation = (INPUTS != 0).astype(jnp.int32)
        mask = attention_mask(segmentation, segmentation)
        rngs = nnx.Rngs(dropout=key)
        x = model.source_embedder(INPUTS, jnp.broadcast_to(jnp.arange(INPUTS.shape[1]), INPUTS.shape),
                                  deterministic=False, rngs=rngs)
        keys = jax.random.split(rngs.dropout(), len(model.encoder_layers))
        for index, layer in enumerate(model.encoder_layers):
            x, _ = layer(x, Inputs(self_mask=SelfMask(segmentation, matrix=mask), real=segmentation != 0),
                         deterministic=False, rngs=nnx.Rngs(dropout=keys[0 if shared else index]))
        return x

    out = scanned(model, key)
    np.testing.assert_allclose(out, one_by_one(model, key, shared=False), atol=1e-5)
    assert np.abs(out - one_by_one(model, key, shared=True)).max() > 1e-2
    np.testing.assert_allclose(scanned(model, key), out, atol=0)  # the same key, the same masks
    assert np.abs(scanned(model, jax.random.key(8)) - out).max() > 1e-2


@pytest.mark.slow  # two traces of deep stacks: ~10 s
def test_the_traced_train_step_does_not_grow_with_depth():
    """The jaxpr of the scanned step has as many equations at 2 layers as at 6 (the per-layer one grows)."""
    def equations(layers, scan):
        config = ModelConfig(**{**TINY, "num_encoder_layers": layers, "num_decoder_layers": layers},
                             scan_layers=scan, dropout_rate=0.1)
        optimizer, schedule = make_optimizer(OptimizerConfig(), config.emb_dim)
        state = abstract_train_state(config, optimizer, 0)
        step = functools.partial(train_step, graphdef=model_graphdef(config), optimizer=optimizer,
                                 schedule=schedule, label_smoothing=0.1)
        batch = {"inputs": INPUTS, "targets": DECODER_INPUTS}
        return len(jax.make_jaxpr(step)(state, batch).jaxpr.eqns)
    assert equations(2, True) == equations(6, True)
    assert equations(6, False) > equations(2, False)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_greedy_and_beam_search_of_the_scanned_model_equal_the_per_layer_models(beam_size):
    (graphdef, params), (scanned_graphdef, scanned_params) = pair()
    inputs = jnp.array([[4, 5, 6, 1, 0, 0], [7, 8, 9, 10, 11, 1]])
    results = []
    for g, p in ((graphdef, params), (scanned_graphdef, scanned_params)):
        search = decode.make_search(g, max_extra_length=5, beam_size=beam_size, scores=True)
        sequences, scores = search.run(p, inputs, decode.default_streams(inputs.shape[0]))
        results.append((np.asarray(sequences), np.asarray(scores)))
    (sequences, scores), (scanned_sequences, scanned_scores) = results
    np.testing.assert_array_equal(scanned_sequences, sequences)
    np.testing.assert_allclose(scanned_scores, scores, atol=1e-5)
    assert sequences.shape == (2, beam_size, 11)


def test_cached_decoding_of_the_scanned_model_equals_its_teacher_forced_pass():
    _, (graphdef, params) = pair()
    model = nnx.merge(graphdef, params)

    @nnx.jit
    def decode_all(model):
        cache = model.init_cache(model.encode(INPUTS), INPUTS, DECODER_INPUTS.shape[1])
        assert len(cache["layers"]) == 3  # one per layer: cached decoding reads the stack layer by layer
        steps = []
        for index in range(DECODER_INPUTS.shape[1]):
            step_logits, cache = model.decode_step(DECODER_INPUTS[:, index, None], jnp.int32(index), cache)
            steps.append(step_logits[:, 0])
        return jnp.stack(steps, axis=1)
    np.testing.assert_allclose(decode_all(model), logits_of(graphdef, params), atol=1e-4)


@pytest.mark.slow  # two train steps compiled with remat: ~40 s on 2 cores
def test_a_train_step_of_the_scanned_model_under_remat_equals_the_per_layer_models():
    """Same parameters in, same loss, gradient norm and updated parameters out: the scan's gradient through
    nnx.remat (model.remat) inside its body is the per-layer model's."""
    config = ModelConfig(**TINY, dropout_rate=0.0)
    scanned_config = dataclasses.replace(config, scan_layers=True, remat=True)
    optimizer, schedule = make_optimizer(OptimizerConfig(warmup_steps=10, adam_eps=1e-3), config.emb_dim)
    state = create_train_state(config, optimizer, seed=0)
    stacked = stack_layer_params(state.params)
    scanned_state = state.replace(params=stacked, opt_state=optimizer.init(stacked))
    batch = {"inputs": np.asarray(INPUTS[:, :6]), "targets": np.asarray(DECODER_INPUTS[:, 1:])}
    outputs, jaxprs = [], []
    for c, s in ((config, state), (scanned_config, scanned_state)):
        step = functools.partial(train_step, graphdef=model_graphdef(c), optimizer=optimizer,
                                 schedule=schedule, label_smoothing=0.1)
        outputs.append(jax.jit(step)(s, batch))
        jaxprs.append(primitives(jax.make_jaxpr(step)(s, batch).jaxpr))
    (new, metrics), (scanned_new, scanned_metrics) = outputs
    np.testing.assert_allclose(scanned_metrics["loss"], metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(scanned_metrics["grad_norm"], metrics["grad_norm"], rtol=1e-5)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(scanned_new.params)[0],
                                 jax.tree.leaves(stack_layer_params(new.params))):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert {"scan", "remat2"} & jaxprs[0] == set()
    assert {"scan", "remat2"} <= jaxprs[1]  # the layers' scan, its body under remat


@pytest.mark.parametrize("saved_scan", [False, True])
def test_a_checkpoint_of_the_other_layout_is_refused_by_name(tmp_path, saved_scan):
    shapes = dict(TINY, num_encoder_layers=1, num_decoder_layers=1)
    optimizer, _ = make_optimizer(OptimizerConfig(), shapes["emb_dim"])
    saved = create_train_state(ModelConfig(**shapes, scan_layers=saved_scan), optimizer, 0)
    checkpointer = Checkpointer(str(tmp_path), save_every_steps=1, keep=1)
    checkpointer.save(1, saved)
    checkpointer.wait()
    other = abstract_train_state(ModelConfig(**shapes, scan_layers=not saved_scan), optimizer, 0)
    missing = "stacked" if not saved_scan else "0"
    with pytest.raises(CheckpointMismatchError, match=rf"has no array 'params/decoder_layers/{missing}/"):
        checkpointer.restore(other)
    with pytest.raises(CheckpointMismatchError, match=rf"has no array 'params/decoder_layers/{missing}/"):
        checkpointer.restore_params(other.params, 1)
    restored = checkpointer.restore(abstract_like(saved))  # its own layout restores
    np.testing.assert_array_equal(jax.tree.leaves(restored.params)[0], jax.tree.leaves(saved.params)[0])
    checkpointer.close()


def test_scan_layers_needs_a_layer_in_each_stack():
    with pytest.raises(ValueError, match="scan_layers=True needs at least one layer per stack"):
        ModelConfig(**{**TINY, "num_encoder_layers": 0}, scan_layers=True)
