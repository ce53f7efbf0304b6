"""The command line eval.py and transformer.translate share (transformer/cli.py): one rule for the decoding flags, a
flag left unset taking the workdir config's value; a bad flag is named as the flag, before anything is restored."""

import pytest

from transformer.cli import command_line_settings


def test_command_line_flags_fail_clearly_and_share_one_default_rule():
    saved = {"beam_size": 4, "average_last": 5, "batch_size": 64, "bleu_splits": "valid"}
    # Unset flags (None) take the workdir's value, average_last included; --best averages nothing.
    assert command_line_settings(saved, step=None, average_last=None, best=False, alpha=None) == (5, {})
    assert command_line_settings(saved, step=None, average_last=None, best=True) == (0, {})
    assert command_line_settings(saved, step=3, average_last=2, best=False, batch_size=8, nbest=4) == (
        2, {"batch_size": 8})
    for flags, message in [({"nbest": 5}, "--nbest=5 must be between 0 \\(off\\) and decode.beam_size=4"),
                           ({"nbest": 2, "beam_size": 1}, "decode.beam_size=1"),
                           ({"max_extra_length": -1}, "--max_extra_length=-1 must be >= 0"),
                           ({"batch_size": 0}, "--batch_size=0 must be positive"),
                           ({"average_last": -1}, "--average_last=-1 must be >= 0"),
                           ({"best": True, "step": 3}, "--best chooses one checkpoint")]:
        with pytest.raises(ValueError, match=message):
            command_line_settings(saved, **{"step": None, "average_last": None, "best": False, **flags})
    with pytest.raises(ValueError, match="decode.temperature=1.0 samples one per sentence"):
        command_line_settings({**saved, "temperature": 1.0, "beam_size": 1}, step=None, average_last=None,
                              best=False, nbest=1)
    # Sampling and beam search are two searches: asking for both is refused, whichever side sets which.
    with pytest.raises(ValueError, match="--temperature=1.0 samples one hypothesis per sentence; "
                                         "decode.beam_size=4 asks for beam search"):
        command_line_settings(saved, step=None, average_last=None, best=False, temperature=1.0)
