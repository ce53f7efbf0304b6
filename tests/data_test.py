import gzip
import logging
import os
import re

import numpy as np
import pytest

from transformer import data, sharding, token_cache
from transformer.errors import DataError, VocabularyError
from transformer.tokenizer import EOS_ID, Tokenizer, train_tokenizer
from transformer.workdir import VocabularyMismatchError, fingerprint


RANDOM_LENGTHS = list(zip(np.random.default_rng(0).integers(1, 20, 300), np.random.default_rng(1).integers(1, 20, 300)))


def write_cache(directory, lengths):
    """A cache where every token of pair i is i + 3 (so a batch tells which pairs it holds), lengths
    [(source, target), ...]."""
    source_lengths, target_lengths = (np.array([pair[side] for pair in lengths]) for side in (0, 1))
    return token_cache.TokenCache.write(
        str(directory), inputs=np.repeat(np.arange(len(lengths)) + 3, source_lengths), inputs_lengths=source_lengths,
        targets=np.repeat(np.arange(len(lengths)) + 3, target_lengths), targets_lengths=target_lengths)


def pairs_in(batch):
    """The pair ids (token - 3) of each segment of a packed batch, checking each segment is one pair whole."""
    found = []
    for side in ("inputs", "targets"):
        ids = []
        for row in range(batch[side].shape[0]):
            for segment in range(1, batch[f"{side}_segmentation"][row].max() + 1):
                where = batch[f"{side}_segmentation"][row] == segment
                tokens = batch[side][row][where]
                assert len(set(tokens)) == 1, tokens  # a segment is one pair...
                np.testing.assert_array_equal(batch[f"{side}_position"][row][where], np.arange(where.sum()))
                assert np.ptp(where.nonzero()[0]) == where.sum() - 1  # ...contiguous, numbered from 0
                ids.append(int(tokens[0]) - 3)
            assert not batch[side][row][batch[f"{side}_segmentation"][row] == 0].any()  # padding is 0
        found.append(ids)
    assert found[0] == found[1]  # source and target segments hold the same pairs in the same order
    return found[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache") / "train", RANDOM_LENGTHS)


def epoch_pairs(cache, shard, max_length=32, rows=8):
    pack = data.PackChunk(cache, np.arange(len(cache)), seed=3, shard=shard, rows=rows, max_length=max_length,
                          chunk_pairs=40)
    batches = [b for chunk in range(pack.chunks_per_epoch) for b in pack(chunk)]
    return batches, [p for b in batches for p in pairs_in(b)]


def test_an_epoch_holds_every_pair_once_packed_within_the_budget(cache):
    batches, pairs = epoch_pairs(cache, data.Shard())
    assert sorted(pairs) == list(range(len(RANDOM_LENGTHS)))  # no pair lost or duplicated
    assert pairs != sorted(pairs)  # shuffled
    assert {b[key].shape for b in batches for key in data.MODEL_KEYS} == {(8, 32)}  # the token budget


def test_two_processes_read_disjoint_shards_that_make_the_one_process_batches(cache):
    first_batches, first = epoch_pairs(cache, data.Shard(0, 2))
    second_batches, second = epoch_pairs(cache, data.Shard(1, 2))
    assert not set(first) & set(second)
    assert sorted(first + second) == list(range(len(RANDOM_LENGTHS)))
    # Stacked, the two processes' rows are exactly the global batches of one process: same training.
    whole, _ = epoch_pairs(cache, data.Shard())
    assert len(first_batches) == len(second_batches) == len(whole)
    for a, b, together in zip(first_batches, second_batches, whole):
        assert a["targets"].shape == (4, 32)
        for key in data.MODEL_KEYS:
            np.testing.assert_array_equal(np.concatenate([a[key], b[key]]), together[key])


def test_rows_must_split_evenly_over_processes(cache):
    with pytest.raises(DataError, match="3 processes"):
        data.train_dataset(cache, np.arange(len(cache)), seed=0, max_length=32, rows_per_batch=8,
                           shard=data.Shard(0, 3))


def test_first_fit_places_every_pair_once_without_overflow():
    lengths = np.array(RANDOM_LENGTHS)
    batches = data.first_fit(lengths[:, 0], lengths[:, 1], rows=4, max_length=24)
    assert sorted(p for batch in batches for row in batch for p in row) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) <= 4
        for row in batch:
            assert lengths[row, 0].sum() <= 24 and lengths[row, 1].sum() <= 24


def test_without_packing_each_row_holds_one_pair():
    """data.pack=false (linformer's rows): one pair per row, every pair once, in order, batches still full."""
    lengths = np.array(RANDOM_LENGTHS)
    batches = data.first_fit(lengths[:, 0], lengths[:, 1], rows=4, max_length=24, pack=False)
    assert [row for batch in batches for row in batch] == [[p] for p in range(len(lengths))]
    assert all(len(batch) == 4 for batch in batches[:-1])


def stream(cache, start_state=None, count=12, num_workers=0):
    iterator = iter(data.train_dataset(cache, np.arange(len(cache)), seed=1, max_length=32, rows_per_batch=8,
                                       num_workers=num_workers, chunk_batches=2))
    if start_state is not None:
        data.restore_iterator(iterator, start_state)
    batches, states = [], []
    for _ in range(count):
        batches.append(next(iterator))
        states.append(data.iterator_state_json(iterator))
    if hasattr(iterator, "close"):
        iterator.close()
    return batches, states


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for key in data.MODEL_KEYS:
            np.testing.assert_array_equal(a[key], b[key])


def test_a_restored_iterator_continues_exactly_across_chunks_and_epochs(cache):
    uninterrupted, states = stream(cache, count=40)  # 300 pairs, ~2 batches per chunk: several epochs
    for stop in (0, 1, 4, 17, 30):
        resumed, _ = stream(cache, states[stop], count=40 - stop - 1)
        assert_same_batches(resumed, uninterrupted[stop + 1:])
    epoch_one = [p for b in uninterrupted for p in pairs_in(b)][len(RANDOM_LENGTHS):2 * len(RANDOM_LENGTHS)]
    assert epoch_one != [p for b in uninterrupted for p in pairs_in(b)][:len(RANDOM_LENGTHS)]  # reshuffled


@pytest.mark.slow  # ~13 s: starting worker processes (the token cache test below also runs one worker)
def test_worker_processes_give_a_restorable_stream(cache):
    from absl import flags
    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (train.py parses them)
    uninterrupted, states = stream(cache, count=8, num_workers=1)
    resumed, _ = stream(cache, states[3], count=4, num_workers=1)
    assert_same_batches(uninterrupted, stream(cache, count=8)[0])  # one worker: the in-process stream
    assert_same_batches(resumed, uninterrupted[4:])
    pairs = [p for b in uninterrupted for p in pairs_in(b)]
    assert len(pairs) == len(set(pairs)) or len(pairs) > len(RANDOM_LENGTHS)


def test_placing_local_rows_on_one_process_gives_the_local_batch(cache):
    batch, _ = stream(cache, count=1)
    placed = sharding.place_local_batch(batch[0])
    for key in data.MODEL_KEYS:
        assert placed[key].shape == (8, 32)
        np.testing.assert_array_equal(np.asarray(placed[key]), batch[0][key])


def test_the_length_filter_counts_what_it_drops(cache):
    kept = data.LengthFilter.of(cache, 10)
    lengths = np.array(RANDOM_LENGTHS)
    assert kept.too_long == int(((lengths[:, 0] > 10) | (lengths[:, 1] > 10)).sum()) > 0
    assert len(kept.kept) + kept.too_long == len(lengths)


def test_token_cache_matches_the_tokenizer_with_and_without_workers(tokenizer, tmp_path):
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    pairs = data.read_split(data.DataConfig(builtin_train_size=300), "train")
    expected = token_cache.TokenCache.tokenize(tokenizer, pairs)  # in memory, as the eval loss's dev set
    for workers in (0, 1):
        cache = token_cache.TokenCache.build(pairs, tokenizer.path, str(tmp_path / f"w{workers}"), num_workers=workers,
                                      chunk_size=64)
        assert len(cache) == len(pairs)
        for index in (0, 63, 64, 299):
            np.testing.assert_array_equal(cache[index]["inputs"], expected[index]["inputs"])
            np.testing.assert_array_equal(cache[index]["targets"], expected[index]["targets"])
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]


def test_a_packed_row_gives_each_pair_the_outputs_it_has_alone(cache):
    import jax.numpy as jnp
    from flax import nnx
    from transformer.model import ModelConfig, build
    from transformer.steps import shift_right

    config = ModelConfig(vocab_size=400, emb_dim=32, num_heads=4, num_encoder_layers=1, num_decoder_layers=1,
                         mlp_dim=64)
    model = nnx.jit(lambda: build(config, rngs=nnx.Rngs(0)))()  # eager init is op-by-op: slower
    batch = stream(cache, count=1)[0][0]
    row = int(batch["targets_segmentation"].max(axis=1).argmax())  # the row with the most pairs
    packed = nnx.jit(lambda m, b: m(b["inputs"], shift_right(b["targets"], b["targets_segmentation"]),
                                    inputs_segmentation=b["inputs_segmentation"],
                                    inputs_position=b["inputs_position"],
                                    targets_segmentation=b["targets_segmentation"],
                                    targets_position=b["targets_position"]))(
        model, {k: jnp.asarray(v[row:row + 1]) for k, v in batch.items()})[0]
    assert batch["targets_segmentation"][row].max() >= 3
    alone = nnx.jit(lambda m, x, y: m(x, shift_right(y)))
    for segment in range(1, batch["targets_segmentation"][row].max() + 1):
        # Each pair alone, padded to the row's length: one compilation (padding changes nothing, model_test).
        source, target = (np.where(batch[f"{side}_segmentation"][row] == segment, batch[side][row], 0)
                          for side in ("inputs", "targets"))
        where = batch["targets_segmentation"][row] == segment
        source, target = source[source != 0], target[where]
        logits = alone(model, jnp.asarray(np.pad(source, (0, 32 - len(source)))[None]),
                       jnp.asarray(np.pad(target, (0, 32 - len(target)))[None]))[0]
        np.testing.assert_allclose(packed[where], logits[:len(target)], atol=1e-5, rtol=1e-5)


def test_the_vocabulary_sample_is_drawn_from_the_whole_split():
    from transformer.tokenizer import sample_sentences
    sentences = [f"sentence {i}" for i in range(1000)]
    sample = sample_sentences(sentences, max_sentences=100)
    assert len(sample) == 100 and max(int(s.split()[1]) for s in sample) > 500  # not a prefix
    assert sample == sample_sentences(sentences, max_sentences=100)  # seeded
    by_characters = sample_sentences(sentences, max_sentences=100, max_characters=120)
    assert sum(map(len, by_characters)) <= 120 and by_characters == sample[:len(by_characters)]


def test_other_processes_wait_for_process_zero_to_write_the_vocabulary(tokenizer, tmp_path):
    import threading
    threading.Timer(0.5, lambda: os.link(tokenizer.path, tmp_path / "vocab.model")).start()
    loaded = data.load_or_train_tokenizer(data.DataConfig(vocab_size=300), [], str(tmp_path), process_index=1)
    assert loaded.vocab_size == 300
    with pytest.raises(TimeoutError, match="process 0"):
        data.wait_for_file(str(tmp_path / "never"), "vocabulary", timeout_seconds=0.2, poll_seconds=0.05)


def test_eval_batches_hold_each_kept_pair_once_in_order_with_one_shape(cache):
    kept = data.LengthFilter.of(cache, 16).kept
    batches = data.eval_batches(cache, kept, max_length=16, rows_per_batch=8)
    assert {b["inputs"].shape for b in batches} == {(8, 16)} and len(batches) > 1
    order = [p for b in batches for p in pairs_in(b)]  # each segment one whole pair
    assert sorted(order) == kept.tolist()
    lengths = np.array(RANDOM_LENGTHS)[kept]
    assert sum(int((b["targets"] != 0).sum()) for b in batches) == int(lengths[:, 1].sum())


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
    (dict(num_workers=-1), "num_workers=-1"),
    (dict(vocab_max_characters=-1), "vocab_max_characters=-1"),
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


def test_the_vocabulary_model_is_the_configs_choice(tokenizer, tmp_path):
    """data.vocab_model_type=bpe trains sentencepiece's BPE into the workdir: a model of merges, whose pieces
    segment the corpus differently from the unigram model of the same size trained on the same sample."""
    config = data.DataConfig(builtin_train_size=2000, vocab_size=300, vocab_model_type="bpe")
    bpe = data.load_or_train_tokenizer(config, data.read_split(config, "train"), str(tmp_path))
    assert (tokenizer.model_type, bpe.model_type, bpe.vocab_size) == ("unigram", "bpe", 300)
    text = [source for source, _ in data.read_split(config, "valid")[:50]]
    assert [bpe.decode(ids) for ids in bpe.encode(text)] == text
    assert [list(ids) for ids in bpe.encode(text)] != [list(ids) for ids in tokenizer.encode(text)]
    with pytest.raises(DataError, match="data.vocab_model_type='wordpiece' is not one of"):
        data.DataConfig(vocab_model_type="wordpiece")


def test_a_vocabulary_too_large_for_the_corpus_is_a_clear_error(tmp_path):
    path = tmp_path / "vocab.model"
    with pytest.raises(VocabularyError, match="vocab_size"):
        train_tokenizer(["a b c", "b c d"] * 10, str(path), vocab_size=5000)
    assert not path.exists()


def test_a_workdir_vocabulary_of_another_size_is_refused(tokenizer, tmp_path):
    os.link(tokenizer.path, tmp_path / "vocab.model")
    config = data.DataConfig(vocab_size=500)
    with pytest.raises(DataError, match="unigram vocabulary of 300 pieces but .*data.vocab_size=500"):
        data.load_or_train_tokenizer(config, [], str(tmp_path))
    with pytest.raises(DataError, match="unigram vocabulary of 300 pieces but data.vocab_model_type='bpe'"):
        data.load_or_train_tokenizer(data.DataConfig(vocab_size=300, vocab_model_type="bpe"), [], str(tmp_path))
    assert Tokenizer(str(tmp_path / "vocab.model")).vocab_size == 300


def test_a_given_vocabulary_is_used_as_it_is_and_a_foreign_one_is_refused(tokenizer, tmp_path):
    """data.vocab_path: an existing model is loaded whatever data.vocab_size says and copied whole into the
    workdir, nothing trained; a model with sentencepiece's own ids (pad -1, eos 2) would break every mask, so it
    is refused before it enters the workdir."""
    config = data.DataConfig(vocab_path=tokenizer.path, vocab_size=500)
    loaded = data.load_or_train_tokenizer(config, [], str(tmp_path / "workdir"))
    assert loaded.path == str(tmp_path / "workdir" / "vocab.model") and loaded.vocab_size == 300
    assert (tmp_path / "workdir" / "vocab.model").read_bytes() == open(tokenizer.path, "rb").read()
    assert os.listdir(tmp_path / "workdir") == ["vocab.model"]  # no temporary file left beside it
    with pytest.raises(DataError, match="data.vocab_path=.*missing.model does not exist"):
        data.load_or_train_tokenizer(data.DataConfig(vocab_path=str(tmp_path / "missing.model")), [], str(tmp_path))
    import sentencepiece as spm
    foreign = tmp_path / "foreign"
    sentences = [text for pair in data.read_split(data.DataConfig(builtin_train_size=200), "train") for text in pair]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(foreign), vocab_size=100,
                                   minloglevel=2)  # sentencepiece's defaults: unk 0, bos 1, eos 2, no pad
    with pytest.raises(VocabularyError, match=r"pad_id=-1, eos_id=2; this project needs pad_id=0, eos_id=1"):
        Tokenizer(str(foreign) + ".model")
    with pytest.raises(VocabularyError, match="pad_id=-1"):
        data.load_or_train_tokenizer(data.DataConfig(vocab_path=str(foreign) + ".model"), [], str(tmp_path / "other"))
    assert not (tmp_path / "other" / "vocab.model").exists()


def test_a_given_vocabulary_is_copied_into_the_workdir_and_another_one_refused(tokenizer, tmp_path):
    first = tokenizer
    pairs = data.read_split(data.DataConfig(builtin_train_size=300, builtin_seed=1), "train")
    second = train_tokenizer([text for pair in pairs for text in pair], str(tmp_path / "other.model"), vocab_size=300)
    loaded = data.load_or_train_tokenizer(data.DataConfig(vocab_path=first.path), [], str(tmp_path), process_index=0)
    assert loaded.path == str(tmp_path / "vocab.model")
    assert fingerprint(loaded.path) == fingerprint(first.path)
    other = data.load_or_train_tokenizer(data.DataConfig(vocab_path=first.path), [], str(tmp_path), process_index=1)
    assert other.path == loaded.path  # another process reads process 0's copy
    expected = f"data.vocab_path={re.escape(second.path)} .* is not {re.escape(str(tmp_path / 'vocab.model'))}"
    with pytest.raises(VocabularyMismatchError, match=expected):
        data.load_or_train_tokenizer(data.DataConfig(vocab_path=second.path), [], str(tmp_path), process_index=0)


def test_inputs_longer_than_learned_positions_are_cut_to_fit_keeping_eos(tokenizer, caplog):
    """decode.search_sentences with max_input_length (a model with learned positions, which has no embedding past
    them): a longer input keeps its first max_input_length - 1 ids and EOS, with a warning naming its line."""
    from transformer import decode
    from transformer.model import ModelConfig

    assert ModelConfig(vocab_size=8, positional_encoding="learned", max_length=6).position_limit == 6
    assert ModelConfig(vocab_size=8).position_limit is None  # sinusoids: callers pass no limit
    seen = {}

    def search(params, batch):  # stands in for a jitted search: records its input rows, returns EOS at once
        for row in np.asarray(batch):
            if row.any():  # not a filler row of the last batch
                seen[tuple(row[row != 0])] = True
        return np.full((len(batch), 2), EOS_ID, np.int32)
    sentences = ["El gato.", " ".join(["el gato negro duerme en el jardín"] * 4)]
    short, long = tokenizer.encode(sentences)
    limit = len(short) + 2
    assert len(long) > limit
    logger = logging.getLogger("transformer")  # the project's console logger, which does not propagate
    logger.addHandler(caplog.handler)
    try:
        outputs = decode.search_sentences(search, None, tokenizer, sentences, batch_size=4,
                                          max_input_length=limit).best_ids()
    finally:
        logger.removeHandler(caplog.handler)
    assert set(seen) == {tuple(short), tuple(long[:limit - 1]) + (EOS_ID,)}
    assert (f"1 of 2 source sentence(s) longer than {limit} tokens cut to their first {limit - 1} and EOS (still "
            "decoded and scored): line(s) 2") in caplog.text
    assert [list(ids) for ids in outputs] == [[EOS_ID], [EOS_ID]]
    seen.clear()
    decode.search_sentences(search, None, tokenizer, sentences, batch_size=4)  # sinusoids: no limit, nothing is cut
    assert set(seen) == {tuple(short), tuple(long)}
