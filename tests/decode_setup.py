"""Shared by the decoding tests (one device, 8 fake devices, 2 processes): a real sentencepiece vocabulary of the
built-in corpus, a tiny random model of its size, and sentences to translate."""

import os

import numpy as np
from flax import nnx

from transformer import data, decode
from transformer.model import ModelConfig, build
from transformer.tokenizer import Tokenizer, train_tokenizer

CORPUS = data.DataConfig(builtin_train_size=2000, builtin_valid_size=64)
VOCAB_SIZE = 300
MAX_EXTRA_LENGTH = 4


def vocabulary(directory) -> Tokenizer:
    """The vocabulary in directory/vocab.model, trained there first if it is not yet."""
    path = os.path.join(str(directory), "vocab.model")
    if os.path.exists(path):
        return Tokenizer(path)
    sentences = [text for pair in data.read_split(CORPUS, "train") for text in pair]
    return train_tokenizer(sentences, path, vocab_size=VOCAB_SIZE)


MODEL = ModelConfig(vocab_size=VOCAB_SIZE, emb_dim=32, num_heads=4, num_encoder_layers=1, num_decoder_layers=2,
                    mlp_dim=64)
# The searches every device and process test runs: their outputs must not depend on where the rows went.
SEARCHES = {"greedy": {}, "beam": {"beam_size": 3, "alpha": 0.6},
            "sampling": {"temperature": 1.0, "top_p": 0.9, "seed": 5},
            "mbr": {"temperature": 1.0, "epsilon": 0.02, "candidates": 4, "utility": "chrf", "seed": 5}}


def tiny_model(seed: int = 0):
    """(graphdef, params as a pure dict) of a random 1+2-layer model; the same on every process for one seed."""
    graphdef, params = nnx.split(build(MODEL, rngs=nnx.Rngs(seed)))
    return graphdef, nnx.to_pure_dict(params)


def make_searches(graphdef) -> dict:
    return {name: decode.make_search(graphdef, max_extra_length=MAX_EXTRA_LENGTH, scores=True, **settings)
            for name, settings in SEARCHES.items()}


def shrinking_beam(graphdef):
    """SEARCHES' beam search with decode.shrink=2: its batches halve twice as their sentences finish."""
    return decode.make_search(graphdef, max_extra_length=MAX_EXTRA_LENGTH, scores=True, shrink=2, **SEARCHES["beam"])


def decode_all(searches: dict, params, tokenizer: Tokenizer, batch_sharding=None, batch_size: int = 5) -> dict:
    """{search name: [[ids, score] of each hypothesis] of each sentence} as plain lists (JSON for the processes).
    A batch of 5 rows and 13 sentences: neither divides the other, nor 5 the device counts."""
    found = {}
    for name, search in searches.items():
        hypotheses = decode.search_sentences(search, params, tokenizer, sentences(tokenizer), batch_size,
                                             batch_sharding=batch_sharding, call=0).hypotheses
        found[name] = [[[h.ids.tolist(), h.score] for h in sentence] for sentence in hypotheses]
    return found


def assert_same_hypotheses(got: dict, expected: dict) -> None:
    """The same ids, in the same order, for every search and sentence; scores equal up to float rounding."""
    assert got.keys() == expected.keys()
    for name in expected:
        assert [[ids for ids, _ in h] for h in got[name]] == [[ids for ids, _ in h] for h in expected[name]], name
        for a, b in zip(got[name], expected[name]):
            np.testing.assert_allclose([s for _, s in a], [s for _, s in b], rtol=1e-5, atol=1e-5, err_msg=name)


def sentences(tokenizer: Tokenizer, count: int = 13) -> list[str]:
    """`count` English sources of the valid split of several lengths, all of at most 16 tokens (one input shape:
    one compilation per search and batch size), the fourth one empty."""
    pairs = data.read_split(CORPUS, "valid")
    lengths = [len(ids) for ids in tokenizer.encode([source for source, _ in pairs])]
    found = [source for (source, _), length in zip(pairs, lengths) if length <= 16][:count]
    assert len(found) == count, f"the valid split has only {len(found)} sentences of at most 16 tokens"
    found[3] = ""
    return found
