"""Every file in configs/ loads, resolves into typed settings, and builds its model under jax.eval_shape."""

import glob
import importlib
import os

import jax
import numpy as np
import pytest

from transformer.optim import make_optimizer
from transformer.trainer import Settings, abstract_train_state

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
CONFIG_NAMES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
                      if not os.path.basename(p).startswith("_"))


def load(name):
    module = importlib.import_module(f"configs.{name}")
    return module.get_config("/some/text/dir") if name == "multi30k" else module.get_config()


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_builds_under_eval_shape(name):
    settings = Settings.from_config(load(name))
    model_config = settings.model_config(vocab_size=settings.data.vocab_size)
    optimizer, _ = make_optimizer(settings.optimizer, model_config.emb_dim)
    state = abstract_train_state(model_config, optimizer, settings.seed)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    assert num_params > 0 and all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))


def test_the_expected_configs_exist():
    assert {"default", "base", "big", "multi30k"} <= set(CONFIG_NAMES)


def test_base_and_big_parameter_counts_match_the_paper_scale():
    """Paper Table 3: base 65M, big 213M parameters (with a 37k vocabulary; 32k here)."""
    counts = {}
    for name in ("base", "big"):
        settings = Settings.from_config(load(name))
        model_config = settings.model_config(vocab_size=settings.data.vocab_size)
        optimizer, _ = make_optimizer(settings.optimizer, model_config.emb_dim)
        state = abstract_train_state(model_config, optimizer, 0)
        counts[name] = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    assert 58e6 < counts["base"] < 65e6 and 200e6 < counts["big"] < 215e6


def test_unknown_and_invalid_settings_fail_naming_the_key():
    config = load("default")
    with config.unlocked():
        config.model.num_layers = 2
    with pytest.raises(ValueError, match="config.model.num_layers"):
        Settings.from_config(config)
    config = load("default")
    config.model.num_heads = 3
    with pytest.raises(ValueError, match="num_heads=3 must divide emb_dim=128"):
        Settings.from_config(config)
    config = load("default")
    config.decode.bleu_splits = "valid,dev"
    with pytest.raises(ValueError, match="'dev'"):
        Settings.from_config(config)
