"""A block kind defined in this file alone: registered, named by a per-layer pattern, it trains through the run,
restores from its checkpoint and beam-decodes, cached decoding equal to teacher forcing, with no change to the
package. And the registry's side of the config: a pattern builds the kinds it names in the layers it names; an
unknown kind, or one a family cannot use, is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiny import decode_incrementally, make_tiny_config, rescored_bleu
from transformer import decode, steps, trainer
from transformer.model import Block, ModelConfig, build, register
from transformer.restore import restore
from transformer.tokenizer import EOS_ID


@register("self_attention", "mean")
class CausalMean(Block):
    """Each position reads the mean of the values of the positions its mask shows it (in the decoder: its own and
    the earlier ones of its sentence), through a learned projection. Decoding keeps each hypothesis's running sum
    and count, a per-hypothesis state that beam search must move to follow each hypothesis's parent."""

    def __init__(self, config, field, *, rngs):
        self.emb_dim = config.emb_dim
        self.value = nnx.Linear(config.emb_dim, config.emb_dim, rngs=rngs)
        self.output = nnx.Linear(config.emb_dim, config.emb_dim, use_bias=False, rngs=rngs)

    @staticmethod
    def prepare(inputs):
        return inputs.replace(self_mask=inputs.self_mask.formed())  # the stack's mask formed once

    def __call__(self, x, inputs, *, deterministic, rngs):
        shown = inputs.self_mask.dense()[:, 0].astype(x.dtype)  # [batch, length, length]
        weights = shown / jnp.maximum(jnp.sum(shown, axis=-1, keepdims=True), 1.0)
        return self.output(jnp.einsum("bqk,bkd->bqd", weights, self.value(x))), {}

    def init_cache(self, setup):
        shape = (setup.batch, setup.hypotheses)
        return {"sum": jnp.zeros((*shape, self.emb_dim)), "count": jnp.zeros((*shape, 1))}

    def decode_step(self, x, cache, step):
        cache = {"sum": cache["sum"] + self.value(x), "count": cache["count"] + 1.0}
        return self.output(cache["sum"] / cache["count"]), cache

    def reorder(self, cache, parents):
        return {name: jnp.take_along_axis(state, parents[..., None], axis=1) for name, state in cache.items()}


PATTERN = {"model.decoder_attention": "dense,mean", "model.num_decoder_layers": 2, "decode.beam_size": 2}
INPUTS = jnp.array([[5, 6, 7, 8, 9, 1, 0], [9, 10, 1, 0, 0, 0, 0]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("blocks") / "mean"
    result = trainer.Run(make_tiny_config(**PATTERN), str(workdir)).train()
    return workdir, result


def test_a_kind_registered_in_a_test_trains_and_restores_from_its_checkpoint(trained):
    workdir, result = trained
    # The run's beam-2 translations of the test split, scored again here, give the score it reported.
    rescored = rescored_bleu(workdir, workdir / "translations_test_step6.txt", "test")
    assert {key: result["bleu"]["test"][key] for key in rescored} == pytest.approx(rescored)
    restored = restore(str(workdir))
    assert restored.step == 6 and restored.model_config.decoder_attention == "dense,mean"
    layers = restored.params["decoder_layers"]
    assert set(layers[1]["self_attention"]) == {"value", "output"}  # the kind's own parameters, by role
    assert "query" in layers[0]["self_attention"]
    earlier = restore(str(workdir), 3).params["decoder_layers"][1]["self_attention"]["value"]["kernel"]
    assert np.abs(np.asarray(layers[1]["self_attention"]["value"]["kernel"]) - np.asarray(earlier)).max() > 0


def test_the_kinds_cached_decoding_and_beam_search_equal_teacher_forcing(trained):
    """Three hypotheses decoded together equal each one's teacher-forced pass; beam search (which reorders the
    hypotheses through CausalMean.reorder) scores each output with its teacher-forced log-probability."""
    restored = restore(str(trained[0]))
    model = nnx.merge(restored.graphdef, restored.params)
    inputs = jnp.minimum(INPUTS, restored.model_config.vocab_size - 1)
    targets = jnp.array([[0, 11, 12, 13, 14, 1], [0, 15, 16, 1, 0, 0]])
    hypotheses = jnp.stack([targets, targets[::-1], targets.at[:, 2:].set(7)], axis=1)
    together = nnx.jit(decode_incrementally)(model, inputs, hypotheses)
    forced = nnx.jit(lambda model, inputs, decoder_inputs: model(inputs, decoder_inputs))
    for hypothesis in range(3):
        np.testing.assert_allclose(together[:, hypothesis], forced(model, inputs, hypotheses[:, hypothesis]),
                                   atol=1e-4)

    search = jax.jit(decode.beam_search, static_argnames=("graphdef", "beam_size", "alpha", "max_extra_length"))
    sequences, scores = search(restored.params, inputs, graphdef=restored.graphdef, beam_size=3, alpha=0.6,
                               max_extra_length=4)
    for row in range(inputs.shape[0]):
        outputs = np.asarray(sequences[row])
        lengths = np.array([list(s).index(EOS_ID) + 1 if EOS_ID in s else len(s) for s in outputs])
        log_probs = jax.nn.log_softmax(forced(model, jnp.repeat(inputs[row:row + 1], 3, axis=0),
                                              steps.shift_right(jnp.asarray(outputs))))
        picked = np.take_along_axis(np.asarray(log_probs), outputs[..., None], -1)[..., 0]
        expected = [picked[i, :lengths[i]].sum() / decode.length_penalty(lengths[i], 0.6) for i in range(3)]
        np.testing.assert_allclose(scores[row], expected, rtol=1e-5, atol=1e-5)


SHAPE = dict(vocab_size=40, emb_dim=16, num_heads=2, mlp_dim=32, num_encoder_layers=3, num_decoder_layers=3)


def test_a_pattern_builds_the_kinds_it_names_in_the_layers_it_names():
    config = ModelConfig(**SHAPE, encoder_attention="local, linformer", decoder_attention="mean,dense,performer",
                         cross_attention="performer,dense", num_experts=2, expert_every=3)
    model = nnx.eval_shape(lambda: build(config, rngs=nnx.Rngs(0)))
    def kinds(stack, role):
        return [getattr(layer, role).kind for layer in getattr(model, f"{stack}_layers")]
    assert kinds("encoder", "self_attention") == ["local", "linformer", "local"]
    assert kinds("decoder", "self_attention") == ["mean", "dense", "performer"]
    assert kinds("decoder", "cross_attention") == ["performer", "dense", "performer"]
    assert kinds("encoder", "feed_forward") == ["dense", "dense", "experts"]
    assert [layer.roles for layer in model.decoder_layers][0] == ("self_attention", "cross_attention",
                                                                   "feed_forward")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert [("key_projection" in layer["self_attention"]) for layer in params["encoder_layers"].values()] == [
        False, True, False]
    assert config.row_mixing[0][:2] == ("encoder_attention", "local, linformer")


@pytest.mark.parametrize("fields, message", [
    (dict(decoder_attention="dense,bogus"),
     r"decoder_attention='dense,bogus': 'bogus' is not one of \('dense', 'local', 'performer', 'ssm', 'mean'\)"),
    (dict(encoder_attention="bogus"), r"encoder_attention='bogus' is not one of \('dense', 'local', 'linformer', "),
    (dict(cross_attention="mean"), r"cross_attention='mean' is not one of \('dense', 'performer'\)"),
    (dict(decoder_attention="dense,"), r"decoder_attention='dense,': '' is not one of"),
    (dict(decoder_attention="dense,mean", scan_layers=True),
     "scan_layers=True stacks identical layers, and decoder_attention='dense,mean' cycles 2 kinds"),
    (dict(family="decoder_only", num_encoder_layers=0, decoder_attention="mean"),
     "which 'mean' cannot: decoder_attention='mean' must be 'dense' or 'ssm'"),
])
def test_a_kind_the_registry_or_its_place_refuses_is_named_with_the_known_kinds(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**SHAPE, **fields})


def test_a_kinds_name_is_registered_once():
    with pytest.raises(ValueError, match="self_attention kind 'dense' is registered already"):
        register("self_attention", "dense")(type("Other", (Block,), {}))
    with pytest.raises(ValueError, match="role 'mixer' is not one of"):
        register("mixer", "mean")
