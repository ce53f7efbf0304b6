"""Training from several corpora (transformer/mixture.py): the entries, the cleaning filters on a hand-built file,
the shares of a weighted mixture, the synthetic tag, process shards, and a run's bitwise resume across a mixture."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from tiny import make_tiny_config
from transformer import config_files, corpus, data, mixture, trainer
from transformer.errors import DataError
from transformer.restore import restore
from transformer.settings import Settings


def write_folder(directory, pairs, split="train", langs=("en", "es")):
    os.makedirs(directory, exist_ok=True)
    for side, lang in enumerate(langs):
        with open(os.path.join(directory, f"{split}.{lang}"), "w", encoding="utf-8") as handle:
            handle.writelines(pair[side] + "\n" for pair in pairs)
    return str(directory)


def reversed_words(text: str) -> str:
    """A source no built-in sentence is: its words backwards ("sleeps cat The.")."""
    return " ".join(reversed(text.rstrip(".").split())) + "."


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    text = write_folder(root / "text", corpus.builtin_split("train", seed=7, train_size=400))
    synthetic_pairs = [(reversed_words(en), es) for en, es in corpus.builtin_split("train", seed=9, train_size=300)]
    return {"text": text, "synthetic": write_folder(root / "synthetic", synthetic_pairs),
            "synthetic_sources": {source for source, _ in synthetic_pairs}}


def settings_of(**overrides) -> Settings:
    return Settings.from_config(config_files.plain(make_tiny_config(**overrides)))


@pytest.fixture(scope="module")
def mixed(folders, tmp_path_factory):
    """A corpus of three sources, weights 3 : 1 : 1, the synthetic one tagged."""
    spec = f"3:main,1:builtin:7,1:synthetic:{folders['synthetic']}"
    settings = settings_of(**{"data.mixture": spec, "data.tag_synthetic": True})
    workdir = str(tmp_path_factory.mktemp("mixed"))
    return settings, trainer.load_corpus(settings, workdir, ["train", "valid"])


@pytest.mark.parametrize("spec, message", [
    ("1:main,0:text:d", "'0' is not a weight > 0"),
    ("1:main,x:text:d", "'x' is not a weight"),
    ("1:main,1:web:d", "the kind 'web' is not one of"),
    ("1:main,1:text", "text needs a location"),
    ("1:main,1:builtin:x", "builtin takes the generator's seed"),
    ("1:main:d", "main is the source of data.source and takes no location"),
    ("1:text:d", "must list the main source"),
    ("1:main,1:text:d,2:text:d", "lists text:d twice"),
])
def test_a_bad_mixture_entry_is_named(spec, message):
    with pytest.raises(DataError, match=message):
        mixture.parse(spec)


def test_each_filter_drops_exactly_what_it_names_on_a_hand_built_file(tmp_path):
    # Clean pairs that fail no filter (short, with sides of similar length), then the planted ones.
    pairs = [(en, es) for en, es in corpus.builtin_split("train", seed=3, train_size=2000)
             if max(len(en), len(es)) <= 60 and 2 * max(len(en), len(es)) <= 3 * min(len(en), len(es))][:200]
    planted = {
        "duplicates": [pairs[5], pairs[5], pairs[9]],  # pairs[5] and pairs[9] are already there: 3 repeats
        "copies (source = target)": [("The cat sleeps.", "The cat sleeps."), ("Hola.", "Hola.")],
        "with a length ratio over 3": [("Yes.", "Sí, el gato negro duerme en la casa grande del pueblo hoy.")],
        "over 70 characters": [("The dog that sees the black cat in the garden is sleeping near the bridge.",
                                "El perro que ve al gato negro en el jardín duerme cerca del puente viejo.")],
    }
    rows = pairs + [pair for group in planted.values() for pair in group]
    write_folder(tmp_path / "c", pairs[:20], split="valid")
    settings = settings_of(**{"data.source": "text", "data.text_dir": write_folder(tmp_path / "c", rows),
                              "data.filter_duplicates": True, "data.filter_copies": True,
                              "data.filter_max_ratio": 3.0, "data.filter_max_characters": 70,
                              "data.max_length": 200})
    corpus_ = trainer.load_corpus(settings, str(tmp_path / "w"), ["train", "valid"])
    cleaned = mixture.clean(corpus_.train_cache, settings.data, corpus_.tokenizer)
    assert len(pairs) == 200 and max(len(text) for text in planted["over 70 characters"][0]) == 74
    expected = {"duplicates": {200, 201, 202}, "copies (source = target)": {203, 204},
                "with a length ratio over 3": {205}, "over 70 characters": {206}}
    assert cleaned.dropped == {"longer than 200 tokens": 0, **{what: len(rows) for what, rows in expected.items()}}
    assert set(range(len(rows))) - set(cleaned.kept.tolist()) == set().union(*expected.values())
    for what, limit in (("over 70 characters", 74), ("with a length ratio over 3", 0)):  # the bounds are exact
        loose = dataclasses.replace(settings.data, filter_max_characters=limit or 70,
                                    filter_max_ratio=3.0 if limit else 20.0)
        assert mixture.clean(corpus_.train_cache, loose, corpus_.tokenizer).dropped[
            what.replace("70", str(limit)) if limit else "with a length ratio over 20"] == 0
    assert cleaned.dropped["longer than 200 tokens"] == 0
    # Off, the same cache keeps every pair within max_length: the single-source path as it was.
    plain = mixture.clean(corpus_.train_cache, settings_of(**{"data.max_length": 200}).data)
    np.testing.assert_array_equal(plain.kept, data.LengthFilter.of(corpus_.train_cache, 200).kept)


def test_the_sources_shares_of_the_batches_match_their_weights(mixed):
    settings, corpus_ = mixed
    sources = corpus_.mixture
    assert [s.label for s in sources] == ["main", "builtin", "synthetic"]
    iterator = iter(mixture.train_dataset(sources, seed=0, max_length=48, rows_per_batch=8, chunk_batches=16))
    tokens = sum(next(iterator)[mixture.SOURCE_TOKENS] for _ in range(300))
    mean_targets = np.array([s.cache.lengths("targets")[s.kept].mean() for s in sources])
    expected = np.array([3, 1, 1]) * mean_targets / (np.array([3, 1, 1]) * mean_targets).sum()
    np.testing.assert_allclose(tokens / tokens.sum(), expected, atol=0.01)


def test_the_tag_begins_every_synthetic_source_and_no_other(mixed, folders):
    _, corpus_ = mixed
    tag, tokenizer = corpus_.tokenizer.synthetic_tag, corpus_.tokenizer
    assert tag is not None and not any(tag in ids for ids in tokenizer.encode([f"a {tokenizer.pieces([tag])[0]} b"]))
    synthetic = {tokenizer.decode(ids) for ids in tokenizer.encode(sorted(folders["synthetic_sources"]))}
    iterator = iter(mixture.train_dataset(corpus_.mixture, seed=1, max_length=48, rows_per_batch=8))
    tagged = untagged = 0
    for _ in range(40):
        batch = next(iterator)
        for row, segments in zip(batch["inputs"], batch["inputs_segmentation"]):
            for segment in set(segments[segments > 0].tolist()):
                ids = row[segments == segment]
                assert tag not in ids[1:].tolist()
                if ids[0] == tag:
                    tagged += 1
                    assert tokenizer.decode(ids[1:]) in synthetic
                else:
                    untagged += 1
                    assert tokenizer.decode(ids) not in synthetic
    assert tagged and untagged


def test_a_tag_without_its_vocabulary_piece_is_refused_before_training(folders, tmp_path):
    first = settings_of()
    trainer.load_corpus(first, str(tmp_path), ["train", "valid"])  # a vocabulary trained without the tag
    tagged = settings_of(**{"data.mixture": f"1:main,1:synthetic:{folders['synthetic']}",
                            "data.tag_synthetic": True})
    with pytest.raises(DataError, match="data.tag_synthetic needs a vocabulary with the control piece <bt>"):
        trainer.load_corpus(tagged, str(tmp_path), ["train", "valid"])


def test_processes_shards_of_a_mixture_make_up_its_one_process_batches(mixed):
    _, corpus_ = mixed
    common = dict(seed=2, max_length=48, rows_per_batch=8)
    whole = iter(mixture.train_dataset(corpus_.mixture, **common))
    halves = [iter(mixture.train_dataset(corpus_.mixture, shard=data.Shard(i, 2), **common)) for i in range(2)]
    for _ in range(10):
        batch, parts = next(whole), [next(half) for half in halves]
        for key in data.MODEL_KEYS:
            np.testing.assert_array_equal(batch[key], np.concatenate([part[key] for part in parts]))
        for part in parts:  # the counts are the whole global batch's, on every process
            np.testing.assert_array_equal(part[mixture.SOURCE_TOKENS], batch[mixture.SOURCE_TOKENS])


def test_a_resumed_mixture_run_ends_with_the_same_parameters_bitwise_and_logs_the_shares(folders, tmp_path):
    overrides = {"data.mixture": f"2:main,0.5:text:{folders['text']},1:synthetic:{folders['synthetic']}",
                 "data.tag_synthetic": True,
                 "data.filter_duplicates": True, "train.num_train_steps": 4, "decode.bleu_splits": ""}
    trainer.Run(make_tiny_config(**overrides), str(tmp_path / "straight")).train()
    trainer.Run(make_tiny_config(**{**overrides, "train.num_train_steps": 2}), str(tmp_path / "resumed")).train()
    trainer.Run(make_tiny_config(**overrides), str(tmp_path / "resumed")).train()
    straight, resumed = restore(str(tmp_path / "straight")), restore(str(tmp_path / "resumed"))
    assert straight.step == resumed.step == 4
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                                            straight.params, resumed.params)))
    records = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    shares = [(r["share_main"], r["share_text"], r["share_synthetic"]) for r in records if r["split"] == "train"]
    assert shares and all(abs(sum(share) - 1) < 1e-9 and 0.3 < share[0] < 0.9 and share[1] > 0 for share in shares)


def test_a_mixture_with_a_missing_folder_is_refused_before_any_corpus_is_read(tmp_path):
    settings = settings_of(**{"data.mixture": f"1:main,1:text:{tmp_path / 'nowhere'}"})
    with pytest.raises(DataError, match="file not found: .*nowhere/train.en"):
        trainer.load_corpus(settings, str(tmp_path / "w"), ["train", "valid"])
    assert not (tmp_path / "w").exists()
    with pytest.raises(ValueError, match="the kind 'web'"):  # a bad entry: at the settings, before the workdir
        settings_of(**{"data.mixture": "1:main,1:web:x"})


def test_the_language_filter_drops_the_pairs_with_a_side_in_another_language(tmp_path):
    pytest.importorskip("py3langid")  # the langid extra
    pairs = corpus.builtin_split("train", seed=3, train_size=300)
    planted = [("Der Hund schläft heute im Garten neben dem alten Haus.", pairs[0][1]),  # German source
               (pairs[1][0], "The black cat is sleeping in the garden today."),  # English target
               (pairs[2][0], pairs[2][0])]  # English on both sides
    rows = pairs + planted
    write_folder(tmp_path / "c", pairs[:20], split="valid")
    settings = settings_of(**{"data.source": "text", "data.text_dir": write_folder(tmp_path / "c", rows),
                              "data.filter_language": True, "data.max_length": 200})
    corpus_ = trainer.load_corpus(settings, str(tmp_path / "w"), ["train", "valid"])
    cleaned = mixture.clean(corpus_.train_cache, settings.data, corpus_.tokenizer)
    dropped = set(range(len(rows))) - set(cleaned.kept.tolist())
    # The built-in text is en -> es; langid misnames some short sentences (4 of 300 when this was written).
    assert {300, 301, 302} <= dropped and len(dropped - {300, 301, 302}) <= 6
    assert os.path.exists(f"{corpus_.train_cache.directory}.language-en-es.npy")  # a restart identifies nothing
