"""Every file in configs/ loads, resolves into typed settings, and builds its model under jax.eval_shape."""

import dataclasses
import glob
import importlib
import os

import jax
import numpy as np
import pytest

from transformer import data, sharding
from transformer.model import ModelConfig
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.decode import DecodeConfig
from transformer.trainer import Settings, TrainConfig, abstract_train_state

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
CONFIG_NAMES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
                      if not os.path.basename(p).startswith("_"))


def load(name):
    module = importlib.import_module(f"configs.{name}")
    return module.get_config("/some/text/dir") if name in ("multi30k", "europarl") else module.get_config()


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_builds_under_eval_shape(name):
    settings = Settings.from_config(load(name))
    model_config = settings.model_config(vocab_size=settings.data.vocab_size)
    optimizer, _ = make_optimizer(settings.optimizer, model_config.emb_dim)
    state = abstract_train_state(model_config, optimizer, settings.seed)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    assert num_params > 0 and all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))


def test_every_setting_is_in_the_default_config_so_the_command_line_can_override_it():
    """--config.x.y=v only overrides keys configs/default.py defines: a field missing there is unreachable."""
    config = load("default")
    sections = {"data": data.DataConfig, "model": ModelConfig, "optimizer": OptimizerConfig, "train": TrainConfig,
                "decode": DecodeConfig, "mesh": sharding.MeshConfig}
    for section, kind in sections.items():
        fields = {f.name for f in dataclasses.fields(kind)}
        if section == "model":
            fields.remove("vocab_size")  # the tokenizer's (data.vocab_size asks for it), not a model setting
        assert fields == set(config[section].keys()), section


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
    config.decode.cache_blocks = -1
    with pytest.raises(ValueError, match="decode.cache_blocks=-1 must be >= 0"):
        Settings.from_config(config)
    config = load("default")
    config.decode.bleu_splits = "valid,dev"
    with pytest.raises(ValueError, match="'dev'"):
        Settings.from_config(config)
    for marks, message in (("20,x", "report_minutes='20,x' must be comma-separated"), ("20,60", "has 60: each mark")):
        config = load("default")
        config.train.max_train_minutes, config.train.report_minutes = 60.0, marks
        with pytest.raises(ValueError, match=message):
            Settings.from_config(config)


@pytest.mark.parametrize("name, dropout, steps, averaged", [("base", 0.1, 100_000, 5), ("big", 0.3, 300_000, 20)])
def test_base_and_big_carry_the_papers_values(name, dropout, steps, averaged):
    """Vaswani et al. 2017, Table 3 and sections 5-6, English->German."""
    settings = Settings.from_config(load(name))
    model, optimizer, train, decode, data = (settings.model, settings.optimizer, settings.train, settings.decode,
                                             settings.data)
    d_model, d_ff, heads = (512, 2048, 8) if name == "base" else (1024, 4096, 16)
    assert (model["num_encoder_layers"], model["num_decoder_layers"]) == (6, 6)
    assert (model["emb_dim"], model["mlp_dim"], model["num_heads"]) == (d_model, d_ff, heads)
    assert model["dropout_rate"] == dropout and model["layer_norm"] == "post"
    assert model["positional_encoding"] == "sinusoidal" and model["share_embeddings"]
    assert train.label_smoothing == 0.1 and train.num_train_steps == steps
    assert optimizer.warmup_steps == 4000 and optimizer.learning_rate_scale == 1.0
    assert (optimizer.adam_b1, optimizer.adam_b2, optimizer.adam_eps) == (0.9, 0.98, 1e-9)
    assert 24_000 <= data.tokens_per_batch <= 26_000  # ~25k source and ~25k target tokens per step (packed rows)
    assert (decode.beam_size, decode.alpha, decode.max_extra_length) == (4, 0.6, 50)
    assert decode.average_last == averaged and train.checkpoint_every_minutes == 10  # the paper's averaging
    # English->German on WMT14 (TFDS keys the pairs de, en), newstest2013 dev, newstest2014 test.
    assert (data.source, data.tfds_name, data.source_lang, data.target_lang) == (
        "tfds", "wmt14_translate/de-en", "en", "de")
    assert (data.valid_split, data.test_split) == ("validation", "test")


def test_the_multi30k_recipe_stops_on_a_time_budget_after_a_cooldown():
    settings = Settings.from_config(load("multi30k"))
    assert settings.train.max_train_minutes == 20 and settings.optimizer.cooldown_fraction > 0
    assert settings.decode.average_last <= 1  # val chose the final parameters over an average (docstring)
    assert settings.model_config(8000).init_std == 0.02  # val chose the peer's N(0, 0.02) init (docstring)
    assert (settings.data.valid_split, settings.data.test_split) == ("val", "test2016")
    assert settings.data.source_lang == "en" and settings.data.target_lang == "de"
