"""Every file in configs/ loads, resolves into typed settings, builds its model under jax.eval_shape (the paper's
configs at the paper's model sizes) and reads its data where and in the direction its docstring says."""

import dataclasses
import glob
import importlib
import os
import re

import jax
import numpy as np
import pytest

from transformer import corpus, data, sharding
from transformer.model import ModelConfig
from transformer.optim import OptimizerConfig, make_optimizer
from transformer.decode import DecodeConfig
from transformer.plan import abstract_train_state
from transformer.settings import Settings, TrainConfig


CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
CONFIG_NAMES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
                      if not os.path.basename(p).startswith("_"))


def load(name):
    module = importlib.import_module(f"configs.{name}")
    return module.get_config("/some/text/dir") if name in ("multi30k", "multi30k_bt", "europarl") else module.get_config()


# Vaswani et al. 2017, Table 3: base 65M, big 213M parameters with a 37k shared vocabulary, as these configs have.
PAPER_PARAMETERS = {"base": 65e6, "big": 213e6}


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_builds_under_eval_shape(name):
    settings = Settings.from_config(load(name))
    model_config = settings.model_config(vocab_size=settings.data.vocab_size)
    optimizer, _ = make_optimizer(settings.optimizer, model_config.emb_dim)
    state = abstract_train_state(model_config, optimizer, settings.seed)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    assert num_params > 0 and all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
    if name in PAPER_PARAMETERS:  # the paper's model sizes: layers, widths and embedding sharing as in the paper
        assert abs(num_params / PAPER_PARAMETERS[name] - 1) < 0.05, num_params


def test_every_setting_is_in_the_default_config_so_the_command_line_can_override_it():
    """--config.x.y=v only overrides keys configs/default.py defines: a field missing there is unreachable."""
    config = load("default")
    sections = {"data": data.DataConfig, "model": ModelConfig, "optimizer": OptimizerConfig, "train": TrainConfig,
                "decode": DecodeConfig, "mesh": sharding.MeshConfig}
    for section, kind in sections.items():
        fields = {f.name for f in dataclasses.fields(kind)}
        if section == "model":
            fields -= {"vocab_size", "seed"}  # the tokenizer's and config.seed, filled by Settings.model_config
        assert fields == set(config[section].keys()), section


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


WORKDIR_CONFIGS = {"finetune"}  # a workdir's own settings, its data among them (tests/finetune_test.py)
LANGUAGES = {"English": "en", "German": "de", "Spanish": "es", "French": "fr"}


def documented_direction(name) -> tuple[str, str]:
    """The language codes of the "X->Y" in the first line of the config's docstring."""
    doc = importlib.import_module(f"configs.{name}").__doc__
    source, target = re.search(r"(\w+)->(\w+)", doc.splitlines()[0]).groups()
    return LANGUAGES[source], LANGUAGES[target]


def documented_files(name) -> list[str]:
    """The file stems a text config's docstring says its folder holds ("{train,val}.{en,de}", "dir/name.{en,de}")."""
    doc = importlib.import_module(f"configs.{name}").__doc__
    stems = []
    for pattern in re.findall(r"([\w./{},-]+)\.\{\w+,\w+\}", doc):
        braces = re.fullmatch(r"(.*)\{([\w,-]+)\}(.*)", pattern)
        stems += [braces[1] + part + braces[3] for part in braces[2].split(",")] if braces else [pattern]
    return stems


@pytest.mark.parametrize("name", [name for name in CONFIG_NAMES if name not in WORKDIR_CONFIGS])
def test_each_config_reads_its_splits_as_its_docstring_says(name, tmp_path):
    """Train, valid and test read from the source the docstring documents, in the direction its first line names:
    for a text config, from a folder laid out as the docstring says (each file's lines name the file); for TFDS,
    from TFDS's mock of the named dataset; for the built-in corpus, from its generator."""
    source, target = documented_direction(name)
    settings = Settings.from_config(load(name))
    config = settings.data
    if config.source == "text":
        stems = documented_files(name)
        for stem in stems:
            for lang in (source, target):
                path = tmp_path / f"{stem}.{lang}"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(f"{stem}.{lang} line {i}\n" for i in range(3)))
        config = dataclasses.replace(config, text_dir=str(tmp_path))
        used = set()
        for split in data.SPLITS:
            pair = data.read_split(config, split)[0]
            read = [stem for stem in stems if pair == (f"{stem}.{source} line 0", f"{stem}.{target} line 0")]
            assert len(read) == 1, (split, pair)
            used.update(read)
        assert used == set(stems)  # every documented file is read
    elif config.source == "tfds":
        import tensorflow_datasets as tfds
        with tfds.testing.mock_data(num_examples=2):
            for split in data.SPLITS:
                pair = data.read_split(config, split)[0]  # registers the WMT builders on first use
                raw = tfds.data_source(config.tfds_name, split=config.split_name(split), download=False)[0]
                assert pair == (raw[source].strip(), raw[target].strip()), split
    else:
        sizes = dict(train_size=2, valid_size=2, test_size=2)
        config = dataclasses.replace(config, **{f"builtin_{key}": value for key, value in sizes.items()})
        for split in data.SPLITS:
            english, spanish = corpus.builtin_split(split, seed=config.builtin_seed, **sizes)[0]
            sides = {"en": english, "es": spanish}
            assert data.read_split(config, split)[0] == (sides[source], sides[target]), split
