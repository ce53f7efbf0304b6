"""Slow: the README's quick start reaches its promised quality (run with `pytest -m slow`; ~8 min on 2 cores)."""

import pytest

from configs import default
from transformer import trainer


@pytest.mark.slow
def test_the_default_config_reaches_bleu_90_on_the_builtin_test_split(tmp_path):
    result = trainer.Run(default.get_config(), str(tmp_path / "demo")).train()
    assert result["bleu"]["test"]["bleu"] >= 90.0, result["bleu"]
