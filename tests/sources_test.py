"""Tests of transformer.sources: parallel text from files and from TFDS.

The TFDS tests need no TensorFlow and no network: they use
`tfds.testing.mock_data` for the WMT builders, and a tiny dataset prepared
locally in array_record format for the real (bytes) read path.
"""

from __future__ import annotations

import gzip
import io
import os
import pathlib
import subprocess
import sys
import time

import pytest

from transformer import sources
from transformer.errors import DataError
from transformer.sources import iter_text_pair, iter_tfds

# --------------------------------------------------------------------------
# Text files.
# --------------------------------------------------------------------------


def _write(path, text: str | bytes) -> str:
    """Writes `text` (str as UTF-8) to `path`, gzip-compressed if it ends in .gz."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as file:
        file.write(data)
    return str(path)


def test_module_import_does_not_import_tfds():
    # tensorflow_datasets takes about a second to import; importing
    # transformer.sources must not pay for it.
    code = "import sys, transformer.sources; print('tensorflow_datasets' in sys.modules)"
    repo_root = pathlib.Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_text_round_trip(tmp_path, suffix):
    source = _write(tmp_path / f"src.en{suffix}", "Hello world.\nGood morning, ä ß €.\n")
    target = _write(tmp_path / f"tgt.de{suffix}", "Hallo Welt.\nGuten Morgen, ä ß €.\n")
    assert list(iter_text_pair(source, target)) == [
        ("Hello world.", "Hallo Welt."),
        ("Good morning, ä ß €.", "Guten Morgen, ä ß €."),
    ]


def test_text_gz_and_plain_mixed_and_pathlike(tmp_path):
    source = _write(tmp_path / "src.gz", "a\nb")  # No final newline.
    target = tmp_path / "tgt.txt"
    _write(target, "x\ny\n")
    assert list(iter_text_pair(source, target)) == [("a", "x"), ("b", "y")]


def test_text_strips_whitespace_crlf_and_bom(tmp_path):
    source = _write(tmp_path / "src", "\ufeff  one \r\n\ttwo\t\r\n")
    target = _write(tmp_path / "tgt", "eins\n   zwei  \n")
    assert list(iter_text_pair(source, target)) == [("one", "eins"), ("two", "zwei")]


def test_text_unicode_line_separators_do_not_split_lines(tmp_path):
    # U+2028 and U+0085 are line breaks for str.splitlines but not for corpora.
    source = _write(tmp_path / "src", "a\u2028b\nc\u0085d\n")
    target = _write(tmp_path / "tgt", "x\ny\n")
    assert list(iter_text_pair(source, target)) == [("a\u2028b", "x"), ("c\u0085d", "y")]


def test_text_skips_pairs_with_an_empty_side(tmp_path):
    source = _write(tmp_path / "src", "a\n\nc\n   \ne\n")
    target = _write(tmp_path / "tgt", "x\ny\n\nw\nv\n")
    assert list(iter_text_pair(source, target)) == [("a", "x"), ("e", "v")]


def test_text_missing_file(tmp_path):
    existing = _write(tmp_path / "tgt", "x\n")
    missing = str(tmp_path / "no_such_file.en")
    with pytest.raises(DataError, match="not found") as error:
        list(iter_text_pair(missing, existing))
    assert missing in str(error.value)
    with pytest.raises(DataError, match="not found") as error:
        list(iter_text_pair(existing, missing + ".gz"))
    assert missing + ".gz" in str(error.value)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_text_directory_instead_of_file(tmp_path, suffix):
    directory = tmp_path / f"corpus{suffix}"
    directory.mkdir()
    existing = _write(tmp_path / "tgt", "x\n")
    with pytest.raises(DataError, match="directory") as error:
        list(iter_text_pair(str(directory), existing))
    assert str(directory) in str(error.value)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can read any file"
)
def test_text_unreadable_file(tmp_path):
    unreadable = _write(tmp_path / "src", "a\n")
    os.chmod(unreadable, 0)
    existing = _write(tmp_path / "tgt", "x\n")
    with pytest.raises(DataError, match="permission") as error:
        list(iter_text_pair(unreadable, existing))
    assert unreadable in str(error.value)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_text_invalid_utf8_names_file_and_line(tmp_path, suffix):
    source = _write(tmp_path / f"src{suffix}", "a\nb\n")
    target = _write(tmp_path / f"tgt{suffix}", b"x\ny\nbad \xff byte\n")
    with pytest.raises(DataError, match="invalid UTF-8") as error:
        list(iter_text_pair(source, target))
    assert f"{target}:3:" in str(error.value)


def test_text_not_really_gzip(tmp_path):
    source = _write(tmp_path / "src.gz", "x\n")
    fake_gzip = tmp_path / "tgt.gz"
    fake_gzip.write_bytes(b"plain text, not gzip\n")
    with pytest.raises(DataError, match="cannot read") as error:
        list(iter_text_pair(source, str(fake_gzip)))
    assert str(fake_gzip) in str(error.value)


@pytest.mark.parametrize(
    ("source_text", "target_text", "source_count", "target_count"),
    [("a\nb\nc\n", "x\ny\n", 3, 2), ("a\n", "x\ny\nz\nw\n", 1, 4)],
)
def test_text_misaligned_files(tmp_path, source_text, target_text, source_count, target_count):
    source = _write(tmp_path / "src", source_text)
    target = _write(tmp_path / "tgt", target_text)
    with pytest.raises(DataError, match="different numbers of lines") as error:
        list(iter_text_pair(source, target))
    message = str(error.value)
    assert f"{source_count} lines in {source!r}" in message
    assert f"{target_count} lines in {target!r}" in message


def test_text_one_empty_file_is_misaligned(tmp_path):
    source = _write(tmp_path / "src", "")
    target = _write(tmp_path / "tgt", "x\n")
    with pytest.raises(DataError, match="0 lines .* but 1 lines"):
        list(iter_text_pair(source, target))


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_text_empty_files(tmp_path, suffix):
    source = _write(tmp_path / f"src{suffix}", "")
    target = _write(tmp_path / f"tgt{suffix}", "")
    with pytest.raises(DataError, match="empty parallel corpus") as error:
        list(iter_text_pair(source, target))
    assert source in str(error.value) and target in str(error.value)


def test_text_all_pairs_empty_on_one_side(tmp_path):
    source = _write(tmp_path / "src", "a\n\n")
    target = _write(tmp_path / "tgt", "\n  y\n")
    with pytest.raises(DataError, match="empty parallel corpus.*all 2 lines"):
        list(iter_text_pair(source, target))



@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_text_stream_yields_the_pairs_before_a_late_error(tmp_path, suffix):
    # A multi-million-line split is streamed: its pairs come before the whole
    # file is read, and a bad line far down still names its file and line.
    source = _write(tmp_path / f"src{suffix}", b"one\ntwo\n\xff three\n")
    target = _write(tmp_path / f"tgt{suffix}", "eins\nzwei\ndrei\n")
    pairs = sources.iter_text_pair(source, target)
    assert [next(pairs), next(pairs)] == [("one", "eins"), ("two", "zwei")]
    with pytest.raises(DataError, match=rf"src{suffix}:3: invalid UTF-8"):
        next(pairs)


def test_file_fingerprint_follows_edits_without_reading(tmp_path):
    path = _write(tmp_path / "train.en", "a\nb\n")
    first = sources.file_fingerprint(path)
    assert first == sources.file_fingerprint(path)
    assert first["size"] == 4 and first["path"] == os.path.realpath(path)
    _write(tmp_path / "train.en", "a\nc\n")  # same size, later modification time
    os.utime(path, ns=(first["mtime_ns"] + 10**9, first["mtime_ns"] + 10**9))
    assert sources.file_fingerprint(path) != first
    with pytest.raises(DataError, match="file not found: .*missing.en"):
        sources.file_fingerprint(str(tmp_path / "missing.en"))

# --------------------------------------------------------------------------
# TFDS.
# --------------------------------------------------------------------------

WMT14 = "wmt14_translate/de-en"
NUM_MOCK_EXAMPLES = 7


@pytest.fixture(scope="module")
def tfds():
    """tensorflow_datasets, imported once for all TFDS tests (slow import)."""
    return sources._import_tfds()  # pylint: disable=protected-access


@pytest.fixture(scope="module")
def tiny_data_dir(tfds, tmp_path_factory):
    """A data_dir with 'sources_test_translate' prepared as real array_record data.

    The builder is not registered (skip_registration): TFDS opens it from its
    dataset_info.json in data_dir, as it would a dataset prepared elsewhere.
    """

    class SourcesTestTranslate(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """A tiny de-en translation dataset."""

        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self, features=tfds.features.Translation(languages=("de", "en"))
            )

        def _split_generators(self, dl_manager):
            del dl_manager  # Nothing to download.
            return {
                "train": self._generate_examples(
                    [
                        ("Hallo Welt.", "Hello world."),
                        (" Grüße  ", "  Greetings "),
                        ("", "dropped: empty German side"),
                        ("Danke.", "Thanks."),
                    ]
                ),
                "test": self._generate_examples([("ok", "ok"), (b"bad \xff byte", "bad")]),
            }

        def _generate_examples(self, pairs):
            for index, (german, english) in enumerate(pairs):
                yield index, {"de": german, "en": english}

    data_dir = tmp_path_factory.mktemp("tfds_data")
    builder = SourcesTestTranslate(data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare()
    return str(data_dir)


def test_tfds_registers_wmt_builders(tfds):
    names = tfds.list_builders(with_community_datasets=False)
    assert {"wmt14_translate", "wmt19_translate", "wmt_t2t_translate"} <= set(names)


@pytest.mark.parametrize("name, split", [(WMT14, "train"), (WMT14, "validation"), ("wmt17_translate/de-en", "train"),
                                         ("wmt17_translate/de-en", "test")])
def test_tfds_mock_wmt(tfds, name, split):
    with tfds.testing.mock_data(num_examples=NUM_MOCK_EXAMPLES):
        en_de = list(iter_tfds(name, split, source_lang="en", target_lang="de"))
        de_en = list(iter_tfds(name, split, source_lang="de", target_lang="en"))
        raw = tfds.data_source(name, split=split, download=False)
        raw_examples = [raw[index] for index in range(len(raw))]

    assert len(en_de) == NUM_MOCK_EXAMPLES
    assert all(isinstance(text, str) and text for pair in en_de for text in pair)
    assert en_de == [(ex["en"].strip(), ex["de"].strip()) for ex in raw_examples]
    assert de_en == [(german, english) for english, german in en_de]


def test_tfds_mock_unknown_language(tfds):
    with tfds.testing.mock_data(num_examples=2):
        with pytest.raises(DataError, match="'fr'") as error:
            list(iter_tfds(WMT14, "train", source_lang="fr", target_lang="en"))
    assert "['de', 'en']" in str(error.value)


def test_tfds_unknown_name(tfds, tmp_path):
    with pytest.raises(DataError, match="unknown TFDS dataset 'wmt14_translat'") as error:
        list(iter_tfds("wmt14_translat/de-en", "train", source_lang="en", target_lang="de",
                  data_dir=str(tmp_path)))
    assert "did you mean 'wmt14_translate'" in str(error.value)
    assert isinstance(error.value.__cause__, tfds.core.DatasetNotFoundError)


def test_tfds_unknown_name_without_suggestions(tfds, tmp_path):
    with pytest.raises(DataError, match="unknown TFDS dataset 'qqqqzzzz'") as error:
        list(iter_tfds("qqqqzzzz", "train", source_lang="en", target_lang="de", data_dir=str(tmp_path)))
    assert "did you mean" not in str(error.value)


def test_tfds_unknown_config(tfds, tmp_path):
    with pytest.raises(DataError, match="wmt14_translate/de-fr") as error:
        list(iter_tfds("wmt14_translate/de-fr", "train", source_lang="de", target_lang="fr",
                  data_dir=str(tmp_path)))
    assert "de-en" in str(error.value)  # The available configs are listed.
    assert error.value.__cause__ is not None


def test_tfds_not_prepared_fails_fast_without_downloading(tfds, tmp_path):
    start = time.monotonic()
    with pytest.raises(DataError, match="not prepared") as error:
        list(iter_tfds(WMT14, "train", source_lang="en", target_lang="de", data_dir=str(tmp_path)))
    elapsed = time.monotonic() - start
    message = str(error.value)
    assert str(tmp_path) in message
    assert "scripts/prepare_wmt.py" in message and f"tfds build {WMT14}" in message
    assert error.value.__cause__ is not None
    assert list(tmp_path.iterdir()) == []  # Nothing downloaded or written.
    assert elapsed < 10


def test_tfds_real_array_record_data(tiny_data_dir):
    pairs = list(iter_tfds(
        "sources_test_translate", "train", source_lang="en", target_lang="de",
        data_dir=tiny_data_dir,
    ))
    # TFDS shuffles examples when it prepares a dataset, so compare as sets.
    assert sorted(pairs) == [
        ("Greetings", "Grüße"),
        ("Hello world.", "Hallo Welt."),
        ("Thanks.", "Danke."),
    ]


def test_tfds_real_data_split_slicing(tiny_data_dir):
    pairs = list(iter_tfds(
        "sources_test_translate", "train[:2]", source_lang="de", target_lang="en",
        data_dir=tiny_data_dir,
    ))
    everything = list(iter_tfds(
        "sources_test_translate", "train", source_lang="de", target_lang="en",
        data_dir=tiny_data_dir,
    ))
    # The first two examples of the prepared (shuffled) split, whichever they
    # are; one example has an empty side and is skipped, so 1 or 2 remain.
    assert 1 <= len(pairs) <= 2
    assert set(pairs) <= set(everything)


def test_tfds_real_data_unknown_split(tiny_data_dir):
    with pytest.raises(DataError, match="'bogus'") as error:
        list(iter_tfds("sources_test_translate", "bogus", source_lang="de", target_lang="en",
                  data_dir=tiny_data_dir))
    assert error.value.__cause__ is not None


def test_tfds_real_data_empty_split(tiny_data_dir):
    # TFDS itself refuses an empty slice ("Paths sequence can not be of 0
    # length"); either way it must be a DataError naming the split.
    with pytest.raises(DataError, match=r"train\[:0\]"):
        list(iter_tfds("sources_test_translate", "train[:0]", source_lang="de", target_lang="en",
                  data_dir=tiny_data_dir))


def test_tfds_real_data_invalid_utf8(tiny_data_dir):
    # The example index depends on TFDS's shuffling, so match any index.
    with pytest.raises(DataError, match=r"split 'test': example \d, language 'de': invalid UTF-8"):
        list(iter_tfds("sources_test_translate", "test", source_lang="de", target_lang="en",
                  data_dir=tiny_data_dir))


def test_tfds_fingerprint_names_the_prepared_version_and_split(tiny_data_dir):
    whole = sources.tfds_fingerprint("sources_test_translate", "train", data_dir=tiny_data_dir)
    assert whole["name"] == "sources_test_translate/1.0.0" and whole["examples"] == 4  # the empty one counts
    assert whole["data_dir"].startswith(tiny_data_dir) and whole["dataset_info"]["size"] > 0
    part = sources.tfds_fingerprint("sources_test_translate", "train[:2]", data_dir=tiny_data_dir)
    assert part["examples"] == 2 and part != whole
    with pytest.raises(DataError, match="'bogus'"):
        sources.tfds_fingerprint("sources_test_translate", "bogus", data_dir=tiny_data_dir)


def test_tfds_fingerprint_of_an_unprepared_dataset_fails_like_reading_it(tfds, tmp_path):
    with pytest.raises(DataError, match="not prepared"):
        sources.tfds_fingerprint(WMT14, "train", data_dir=str(tmp_path))


def test_decode_lines_reads_text_as_training_does_and_replaces_invalid_bytes_only_when_asked():
    """The one reading of text that training, eval.py and translate share: a byte order mark and CR dropped,
    lines split at newlines only (a form feed or U+2028 stays inside its line), empty lines kept; invalid UTF-8
    names the file and line, or, with `replaced`, becomes U+FFFD and its line is counted."""
    raw = b"\xef\xbb\xbfone\r\n\r\ntwo\x0cthree \xe2\x80\xa8 four\n caf\xe9 \nlast"
    with pytest.raises(DataError, match=r"^in\.txt:4: invalid UTF-8"):
        list(sources.decode_lines("in.txt", io.BytesIO(raw)))
    replaced = []
    assert list(sources.decode_lines("stdin", io.BytesIO(raw), replaced)) == [
        "one", "", "two\x0cthree \u2028 four", "caf\ufffd", "last"]
    assert replaced == [4]
