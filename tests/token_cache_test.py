"""The train split's token cache across starts: found by a fingerprint of its source and vocabulary, so a
restart reads no pair of the split; built from a spill streamed from the source, equal to the cache the
in-memory writer made."""

import os
import shutil
import threading

import numpy as np
import pytest
from tiny import make_tiny_config

from transformer import data, token_cache, trainer
from transformer.errors import DataError
from transformer.settings import Settings


def start(config: data.DataConfig, workdir) -> token_cache.TokenCache:
    """What a start of train.py does for the train split (trainer.load_corpus, one process)."""
    with data.split_source(config, "train") as train:
        tokenizer = data.load_or_train_tokenizer(config, train, str(workdir), process_index=0)
        return data.load_or_build_token_cache(train, tokenizer, str(workdir), "train", process_index=0)


def file_bytes(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in token_cache.CACHE_FILES}


def test_a_restart_reads_neither_the_train_split_nor_trains_a_vocabulary(tmp_path, drawn):
    settings = Settings.from_config(make_tiny_config())
    first = trainer.load_corpus(settings, str(tmp_path), ["train", "valid"])
    assert drawn["train"] == settings.data.builtin_train_size  # one pass: the vocabulary and the cache share it
    vocabulary = open(tmp_path / "vocab.model", "rb").read()
    modified = os.stat(tmp_path / "vocab.model").st_mtime_ns
    drawn.clear()
    again = trainer.load_corpus(settings, str(tmp_path), ["train", "valid"])
    assert "train" not in drawn and drawn["valid"] == settings.data.builtin_valid_size
    assert again.train_cache.directory == first.train_cache.directory
    np.testing.assert_array_equal(again.train_kept, first.train_kept)
    assert os.stat(tmp_path / "vocab.model").st_mtime_ns == modified
    assert open(tmp_path / "vocab.model", "rb").read() == vocabulary
    assert sorted(os.listdir(tmp_path / "tokens")) == [os.path.basename(first.train_cache.directory)]  # no spill
    assert "train" not in again.pairs and "train" not in drawn  # the train text is not held in memory...
    assert len(again.pairs["train"]) == drawn["train"] == settings.data.builtin_train_size  # ...unless decoded


def test_another_size_seed_or_vocabulary_gets_its_own_cache(tmp_path, drawn):
    config = data.DataConfig(builtin_train_size=300, vocab_size=200)
    cache = start(config, tmp_path)
    assert len(cache) == 300
    drawn.clear()
    bigger = start(data.DataConfig(builtin_train_size=400, vocab_size=200), tmp_path)  # reuses vocab.model
    assert bigger.directory != cache.directory and len(bigger) == 400 and drawn["train"] == 400
    drawn.clear()
    reseeded = start(data.DataConfig(builtin_train_size=300, builtin_seed=1, vocab_size=200), tmp_path)
    assert reseeded.directory != cache.directory and drawn["train"] == 300
    assert reseeded[0]["inputs"].tolist() != cache[0]["inputs"].tolist()
    os.rename(tmp_path / "vocab.model", tmp_path / "first.model")  # a new vocabulary, trained on this start
    drawn.clear()
    retrained = start(data.DataConfig(**{**vars(config), "vocab_size": 150}), tmp_path)
    assert retrained.directory != cache.directory and drawn["train"] == 300
    assert len(os.listdir(tmp_path / "tokens")) == 4  # the older caches are left as they were


def test_a_cache_whose_record_disagrees_is_refused_not_used(tmp_path):
    config = data.DataConfig(builtin_train_size=300, vocab_size=200)
    cache = start(config, tmp_path)
    bigger = data.DataConfig(builtin_train_size=301, vocab_size=200)
    record = token_cache.cache_record(str(tmp_path / "vocab.model"), data.split_fingerprint(bigger, "train"))
    shutil.copytree(cache.directory, token_cache.cache_directory(str(tmp_path), "train", record))  # a hand-made copy
    with pytest.raises(DataError, match="built from another source [(]size 300 -> 301[)]; delete that folder"):
        start(bigger, tmp_path)


def write_text_corpus(directory, pairs):
    for side, lang in ((0, "en"), (1, "es")):
        (directory / f"train.{lang}").write_text("".join(f"{pair[side]}\n" for pair in pairs), encoding="utf-8")


def test_a_text_source_is_matched_by_stat_and_an_edit_rebuilds(tmp_path):
    pairs = data.read_split(data.DataConfig(builtin_train_size=300), "train")
    corpus_dir, workdir = tmp_path / "corpus", tmp_path / "workdir"
    corpus_dir.mkdir()
    write_text_corpus(corpus_dir, pairs)
    config = data.DataConfig(source="text", text_dir=str(corpus_dir), vocab_size=200)
    cache = start(config, workdir)
    assert len(cache) == 300
    # Same size and modification time, but bytes that a read would reject: a restart must not read them.
    source_file = corpus_dir / "train.en"
    stat = os.stat(source_file)
    source_file.write_bytes(b"\xff" * stat.st_size)
    os.utime(source_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert start(config, workdir).directory == cache.directory
    with pytest.raises(DataError, match=r"train.en:1: invalid UTF-8"):
        data.read_split(config, "train")
    write_text_corpus(corpus_dir, pairs[:250])  # an edit: another size and modification time
    edited = start(config, workdir)
    assert edited.directory != cache.directory and len(edited) == 250
    np.testing.assert_array_equal(edited[249]["targets"], cache[249]["targets"])


def old_in_memory_cache(directory, tokenizer, pairs):
    """The cache as TokenCache.build wrote it before it streamed: all chunks concatenated, then np.save."""
    os.makedirs(directory)
    examples = token_cache.TokenCache.tokenize(tokenizer, pairs)
    for side, offsets in (("inputs", "input_offsets"), ("targets", "target_offsets")):
        sequences = [examples[i][side] for i in range(len(examples))]
        tokens = np.concatenate(sequences)
        np.save(os.path.join(directory, f"{side}.npy"), tokens.astype(np.uint16 if tokens.max() < 2**16 else np.int32))
        lengths = np.array([len(x) for x in sequences])
        np.save(os.path.join(directory, f"{offsets}.npy"), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def test_the_streamed_cache_and_vocabulary_equal_the_in_memory_ones(tmp_path):
    from absl import flags
    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (train.py parses them)
    config = data.DataConfig(builtin_train_size=500, vocab_size=200, source_lang="es", target_lang="en")
    pairs = data.read_split(config, "train")
    spill = token_cache.PairSpill.write(data.iter_split(config, "train"), str(tmp_path / "spill"), batch_size=64)
    assert spill[:] == pairs and spill[498:1000] == pairs[498:] and spill[7:3] == []
    assert list(spill.sentences()) == [text for pair in pairs for text in pair]  # "año", "niña": UTF-8 offsets
    from_list = data.load_or_train_tokenizer(config, pairs, str(tmp_path / "list"), process_index=0)
    with data.split_source(config, "train") as train:
        tokenizer = data.load_or_train_tokenizer(config, train, str(tmp_path / "stream"), process_index=0)
    assert open(tokenizer.path, "rb").read() == open(from_list.path, "rb").read()  # the same sample
    old_in_memory_cache(str(tmp_path / "old"), tokenizer, pairs)
    expected = file_bytes(tmp_path / "old")
    for workers, chunk_size in ((0, 64), (0, 4096), (1, 100)):
        cache = token_cache.TokenCache.build(spill, tokenizer.path, str(tmp_path / f"w{workers}-{chunk_size}"),
                                      num_workers=workers, chunk_size=chunk_size)
        assert file_bytes(cache.directory) == expected, (workers, chunk_size)
    spill.remove()
    assert sorted(os.listdir(tmp_path)) == ["list", "old", "stream", "w0-4096", "w0-64", "w1-100"]


def test_a_failed_read_leaves_no_spill_and_no_cache(tmp_path):
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "train.en").write_text("one\ntwo\nthree\n")
    (corpus_dir / "train.es").write_text("uno\ndos\n")
    config = data.DataConfig(source="text", text_dir=str(corpus_dir), vocab_size=200)
    with pytest.raises(DataError, match="3 lines in .*train.en.* but 2 lines in .*train.es"):
        start(config, tmp_path / "workdir")
    assert os.listdir(tmp_path / "workdir" / "tokens") == []


def test_other_processes_wait_for_the_cache_of_process_zero_and_read_nothing(tmp_path):
    config = data.DataConfig(builtin_train_size=300, vocab_size=200)
    with data.split_source(config, "train") as train:
        tokenizer = data.load_or_train_tokenizer(config, train, str(tmp_path), process_index=0)

        def unread():
            raise AssertionError("process 1 read the train split")
            yield
        waiting = {}
        other = data.SplitSource("train", data.split_fingerprint(config, "train"), unread())
        thread = threading.Thread(target=lambda: waiting.update(cache=data.load_or_build_token_cache(
            other, tokenizer, str(tmp_path), "train", process_index=1)))
        thread.start()
        built = data.load_or_build_token_cache(train, tokenizer, str(tmp_path), "train", process_index=0)
        thread.join(timeout=60)
    assert not thread.is_alive() and waiting["cache"].directory == built.directory and len(built) == 300
    with pytest.raises(TimeoutError, match="sees another source than process 0"):
        data.load_or_build_token_cache(data.SplitSource("train", {"source": "elsewhere"}, unread()), tokenizer,
                                       str(tmp_path), "train", process_index=1, timeout_seconds=0.2)


def test_a_tfds_restart_opens_no_example_and_another_split_size_rebuilds(tmp_path, monkeypatch):
    import tensorflow_datasets as tfds
    from transformer import sources
    vocabulary = data.load_or_train_tokenizer(data.DataConfig(builtin_train_size=300, vocab_size=200),
                                              data.read_split(data.DataConfig(builtin_train_size=300), "train"),
                                              str(tmp_path / "vocabulary"), process_index=0)
    config = data.DataConfig(source="tfds", tfds_name="wmt14_translate/de-en", source_lang="en", target_lang="de",
                             vocab_path=vocabulary.path)
    with tfds.testing.mock_data(num_examples=7):
        cache = start(config, tmp_path / "workdir")
    read = sources.iter_tfds
    drawn = []
    monkeypatch.setattr(sources, "iter_tfds", lambda *args, **kwargs: (drawn.append(p) or p
                                                                       for p in read(*args, **kwargs)))
    with tfds.testing.mock_data(num_examples=7):
        assert start(config, tmp_path / "workdir").directory == cache.directory and not drawn
    with tfds.testing.mock_data(num_examples=9):
        assert len(start(config, tmp_path / "workdir")) == 9 and len(drawn) == 9
