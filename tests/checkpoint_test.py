import functools

import jax
import numpy as np
import pytest

from tiny import tree_digest
from transformer.checkpoint import CheckpointMismatchError, Checkpointer, abstract_like, average_params
from transformer.model import ModelConfig
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.plan import create_train_state


SHAPES = dict(vocab_size=30, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, mlp_dim=32)


@functools.lru_cache(maxsize=None)  # states are immutable; each build compiles an init
def state_for(emb_dim, seed=0):
    optimizer, _ = make_optimizer(OptimizerConfig(), emb_dim)
    return create_train_state(ModelConfig(emb_dim=emb_dim, **SHAPES), optimizer, seed)


def test_round_trip_restores_every_array(tmp_path):
    state = state_for(16, seed=1).replace(step=np.int32(7))
    checkpointer = Checkpointer(str(tmp_path), save_every_steps=1, keep=2)
    checkpointer.save(7, state)
    checkpointer.wait()
    restored = checkpointer.restore(abstract_like(state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
    assert int(restored.step) == 7
    checkpointer.close()


def test_keeps_only_the_last_k(tmp_path):
    state = state_for(16)
    checkpointer = Checkpointer(str(tmp_path), save_every_steps=1, keep=2)
    for step in (1, 2, 3):
        checkpointer.save(step, state)
    checkpointer.wait()
    assert checkpointer.all_steps() == [2, 3]
    checkpointer.close()


def test_a_checkpoint_of_another_shape_fails_clearly_and_is_untouched(tmp_path):
    checkpointer = Checkpointer(str(tmp_path), save_every_steps=1, keep=2)
    checkpointer.save(1, state_for(16))
    checkpointer.wait()
    before = tree_digest(tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"params/.*has shape .*16.* expects .*32"):
        checkpointer.restore(abstract_like(state_for(32)))
    checkpointer.close()
    assert tree_digest(tmp_path) == before


def test_averaging_gives_the_mean_of_the_saved_params_from_states_and_snapshots_alike(tmp_path):
    base = state_for(16)
    rng = np.random.default_rng(0)
    saved = {}
    states = Checkpointer(str(tmp_path / "checkpoints"), save_every_steps=1, keep=5)
    snapshots = Checkpointer(str(tmp_path / "params"), save_every_steps=1, keep=5)
    for step in (1, 2, 3):
        params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), base.params)
        saved[step] = params
        states.save(step, base.replace(step=np.int32(step), params=params))
        snapshots.save(step, {"params": params})
    states.wait(), snapshots.wait()
    expected = jax.tree.map(lambda a, b: (a + b) / 2, saved[2], saved[3])
    for averaged in (average_params([(states, 2), (states, 3)], abstract_like(base.params)),
                     average_params([(states, 2), (snapshots, 3)], abstract_like(base.params))):
        assert jax.tree.structure(averaged) == jax.tree.structure(base.params)
        for a, b in zip(jax.tree.leaves(averaged), jax.tree.leaves(expected)):
            assert a.dtype == np.float32
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # One step is its own parameters, bit for bit, from either kind of checkpoint.
    for source in (states, snapshots):
        for a, b in zip(jax.tree.leaves(source.restore_params(abstract_like(base.params), 1)),
                        jax.tree.leaves(saved[1])):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 7"):
        average_params([(states, 3), (states, 7)], abstract_like(base.params))
    states.close(), snapshots.close()


def test_averaging_checkpoints_of_different_shapes_names_the_step_and_array(tmp_path):
    checkpointer = Checkpointer(str(tmp_path), save_every_steps=1, keep=5)
    checkpointer.save(1, state_for(16))
    checkpointer.save(2, state_for(32))
    checkpointer.wait()
    with pytest.raises(CheckpointMismatchError, match=r"cannot average step 2: .*params/.*has shape .*32"):
        average_params([(checkpointer, 1), (checkpointer, 2)], abstract_like(state_for(16).params))
    checkpointer.close()


def test_a_best_metric_checkpointer_keeps_the_highest_score(tmp_path):
    state = state_for(16)
    checkpointer = Checkpointer(str(tmp_path), save_every_steps=1, keep=1, best_metric="valid_bleu")
    for step, score in ((1, 5.0), (2, 9.0), (3, 7.0)):
        checkpointer.save(step, state, metrics={"valid_bleu": score})
    checkpointer.wait()
    assert checkpointer.all_steps() == [2] and checkpointer.best_step() == 2
    checkpointer.close()
