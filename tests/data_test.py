import gzip
import os

import numpy as np
import pytest

from transformer import data
from transformer.sources import DataError
from transformer.tokenizer import EOS_ID, Tokenizer, VocabularyError, train_tokenizer


def examples_of(lengths):
    return data.Examples([np.full(s, 7, np.int32) for s, _ in lengths], [np.full(t, 9, np.int32) for _, t in lengths])


RANDOM_LENGTHS = list(zip(np.random.default_rng(0).integers(1, 20, 300), np.random.default_rng(1).integers(1, 20, 300)))


def test_packing_fits_every_row_and_uses_each_pair_once():
    examples = examples_of(RANDOM_LENGTHS)
    rows = data.pack_rows(examples, np.arange(len(examples)), max_length=32)
    assert sorted(i for row in rows for i in row) == list(range(len(examples)))
    for row in rows:
        assert sum(len(examples.inputs[i]) for i in row) <= 32 and sum(len(examples.targets[i]) for i in row) <= 32


def test_packed_batch_has_segments_and_positions():
    examples = data.Examples([np.array([5, 6, 1]), np.array([7, 1])], [np.array([8, 1]), np.array([9, 10, 11, 1])])
    batch = data.make_batch(examples, [[0, 1]], num_rows=2, max_length=8)
    np.testing.assert_array_equal(batch["inputs"][0], [5, 6, 1, 7, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch["inputs_segmentation"][0], [1, 1, 1, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(batch["targets_position"][0], [0, 1, 0, 1, 2, 3, 0, 0])
    assert not batch["inputs"][1].any()  # the unused row is padding


def test_eval_batches_cover_the_split_with_one_shape():
    examples = examples_of(RANDOM_LENGTHS)
    batches = data.eval_batches(examples, max_length=32, rows_per_batch=16)
    assert {b["inputs"].shape for b in batches} == {(16, 32)}
    assert sum(int((b["targets"] != 0).sum()) for b in batches) == sum(t for _, t in RANDOM_LENGTHS)


def test_decode_batches_are_length_sorted_padded_and_complete():
    inputs = [np.arange(1, n + 1, dtype=np.int32) for n in (5, 17, 3, 9, 2)]
    seen = []
    for indices, batch in data.decode_batches(inputs, batch_size=2):
        assert batch.shape[0] == 2 and batch.shape[1] in (8, 16, 32)
        for row, index in zip(batch, indices):
            if index >= 0:
                np.testing.assert_array_equal(row[:len(inputs[index])], inputs[index])
                seen.append(index)
            else:
                assert not row.any()
    assert sorted(seen) == list(range(5))


def test_builtin_source_is_deterministic_and_splits_are_disjoint():
    config = data.DataConfig(builtin_train_size=500, builtin_valid_size=50, builtin_test_size=50)
    train = data.read_split(config, "train")
    assert train == data.read_split(config, "train") and len(train) == 500
    test = data.read_split(config, "test")
    assert not {s for s, _ in train} & {s for s, _ in test}


def test_text_source_reads_split_files_including_gzip(tmp_path):
    (tmp_path / "train.en").write_text("Hello.\nGood morning.\n", encoding="utf-8")
    with gzip.open(tmp_path / "train.de.gz", "wt", encoding="utf-8") as handle:
        handle.write("Hallo.\nGuten Morgen.\n")
    config = data.DataConfig(source="text", text_dir=str(tmp_path), source_lang="en", target_lang="de")
    assert data.read_split(config, "train") == [("Hello.", "Hallo."), ("Good morning.", "Guten Morgen.")]


def test_text_source_with_misaligned_files_names_both_counts(tmp_path):
    (tmp_path / "train.en").write_text("a\nb\nc\n")
    (tmp_path / "train.de").write_text("a\nb\n")
    config = data.DataConfig(source="text", text_dir=str(tmp_path), source_lang="en", target_lang="de")
    with pytest.raises(DataError, match="3.*2"):
        data.read_split(config, "train")


def test_tfds_source_through_mock_data():
    import tensorflow_datasets as tfds

    config = data.DataConfig(source="tfds", tfds_name="wmt14_translate/de-en", source_lang="en", target_lang="de",
                             valid_split="validation")
    with tfds.testing.mock_data(num_examples=7):
        pairs = data.read_split(config, "valid")
    assert len(pairs) == 7 and all(isinstance(s, str) and isinstance(t, str) for s, t in pairs)


@pytest.mark.parametrize("bad, message", [
    (dict(source="web"), "data.source='web'"),
    (dict(source="text"), "data.text_dir"),
    (dict(source="tfds"), "data.tfds_name"),
    (dict(max_length=64, tokens_per_batch=32), "tokens_per_batch=32"),
])
def test_bad_data_configs_fail_naming_the_field(bad, message):
    with pytest.raises(DataError, match=message):
        data.DataConfig(**bad)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    config = data.DataConfig(builtin_train_size=2000)
    sentences = [text for pair in data.read_split(config, "train") for text in pair]
    return train_tokenizer(sentences, str(tmp_path_factory.mktemp("vocab") / "vocab.model"), vocab_size=300)


def test_tokenizer_round_trips_and_appends_eos(tokenizer):
    assert tokenizer.vocab_size == 300
    ids = tokenizer.encode(["El gato negro duerme en el jardín."])[0]
    assert ids[-1] == EOS_ID and ids.dtype == np.int32
    assert tokenizer.decode(np.concatenate([ids, [0, 0]])) == "El gato negro duerme en el jardín."


def test_a_vocabulary_too_large_for_the_corpus_is_a_clear_error(tmp_path):
    path = tmp_path / "vocab.model"
    with pytest.raises(VocabularyError, match="vocab_size"):
        train_tokenizer(["a b c", "b c d"] * 10, str(path), vocab_size=5000)
    assert not path.exists()


def test_a_workdir_vocabulary_of_another_size_is_refused(tokenizer, tmp_path):
    os.link(tokenizer.path, tmp_path / "vocab.model")
    config = data.DataConfig(vocab_size=500)
    with pytest.raises(DataError, match="300 pieces but data.vocab_size=500"):
        data.load_or_train_tokenizer(config, [], str(tmp_path))
    assert Tokenizer(str(tmp_path / "vocab.model")).vocab_size == 300
