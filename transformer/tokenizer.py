"""Sentencepiece: train one joint vocabulary on the training split, save it in the workdir, load it.

Ids: 0 = padding (also the decoder's start symbol), 1 = end of sentence, 2 = unknown; no BOS. A vocabulary
trained for tagged back-translation (data.tag_synthetic) also holds the control piece SYNTHETIC_TAG, which no text
encodes to: only the data pipeline puts it before a synthetic source.

The vocabulary file is a sentencepiece model, or a *pair*: Marian's two sentencepiece models (one segments the
source, the other the target) with one table of pieces giving the ids, as an imported OPUS-MT model has them
(scripts/import_hf.py). A pair is one JSON file (PAIR_FORMAT), so that a workdir's vocabulary stays one file that
is copied, fingerprinted and checked as any other.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from transformer.errors import VocabularyError

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
SYNTHETIC_TAG = "<bt>"  # Caswell et al. 2019's tag of back-translated sources, a control piece
VOCAB_MODEL_TYPES = ("unigram", "bpe")  # sentencepiece's two subword models (its char and word are not subwords)


PAIR_FORMAT = "sentencepiece pair"  # the "format" of a pair vocabulary file


class Tokenizer:
    """A loaded vocabulary: text <-> int32 ids, with EOS appended on encoding. `side` names which sentencepiece
    model segments a text (a pair's; a joint model serves both): "source" or "target"."""

    def __init__(self, model_path: str):
        self.path = model_path
        try:
            with open(model_path, "rb") as handle:
                content = handle.read()
            if content[:1] == b"{":
                self._load_pair(json.loads(content))
            else:
                self.processor = spm.SentencePieceProcessor(model_proto=content)
                self.target_processor, self.table = self.processor, None
        except (OSError, RuntimeError, ValueError, KeyError) as error:
            raise VocabularyError(f"cannot load sentencepiece model {model_path}: {error}") from error
        if self.table is None and (self.processor.pad_id() != PAD_ID or self.processor.eos_id() != EOS_ID):
            raise VocabularyError(
                f"sentencepiece model {model_path} has pad_id={self.processor.pad_id()}, "
                f"eos_id={self.processor.eos_id()}; this project needs pad_id={PAD_ID}, eos_id={EOS_ID}")

    def _load_pair(self, record: dict) -> None:
        if record.get("format") != PAIR_FORMAT:
            raise ValueError(f"a JSON vocabulary must have format {PAIR_FORMAT!r}, got {record.get('format')!r}")
        self.processor = spm.SentencePieceProcessor(model_proto=base64.b64decode(record["source"]))
        self.target_processor = spm.SentencePieceProcessor(model_proto=base64.b64decode(record["target"]))
        self.table = list(record["pieces"])
        self.index = {piece: i for i, piece in enumerate(self.table)}
        if len(self.index) != len(self.table):
            raise ValueError("its table names one piece twice")
        self.specials = set(record["specials"])  # pieces no text is segmented into (pad, eos, unk), by id
        if not {PAD_ID, EOS_ID, UNK_ID} <= self.specials:
            raise ValueError(f"its specials {sorted(self.specials)} must include pad, eos and unk, "
                             f"{(PAD_ID, EOS_ID, UNK_ID)}")

    @property
    def is_pair(self) -> bool:
        return self.table is not None

    @property
    def vocab_size(self) -> int:
        return len(self.table) if self.is_pair else self.processor.get_piece_size()

    @functools.cached_property
    def model_type(self) -> str:
        """The (source) sentencepiece model's kind ("unigram", "bpe", ...), as its trainer spec records it."""
        from sentencepiece import sentencepiece_model_pb2 as model_pb2

        proto = model_pb2.ModelProto.FromString(self.processor.serialized_model_proto())
        return model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()

    @property
    def synthetic_tag(self) -> int | None:
        """The id of the control piece SYNTHETIC_TAG, or None if this vocabulary was trained without it."""
        if self.is_pair:
            tag = self.index.get(SYNTHETIC_TAG)
            return tag if tag in self.specials else None
        tag = self.processor.piece_to_id(SYNTHETIC_TAG)
        return tag if tag != self.processor.unk_id() and self.processor.is_control(tag) else None

    def encode_lists(self, texts: list[str], side: str = "source") -> list[list[int]]:
        """Each text -> its ids ending in EOS, as lists (the token cache's fast path)."""
        if not self.is_pair:
            return self.processor.encode(texts, add_eos=True)
        processor = self.processor if side == "source" else self.target_processor
        index = self.index
        return [[index.get(piece, UNK_ID) for piece in pieces] + [EOS_ID]
                for pieces in processor.encode(texts, out_type=str)]

    def encode(self, texts: list[str], side: str = "source") -> list[np.ndarray]:
        """Each text -> int32 ids ending in EOS."""
        return [np.asarray(ids, np.int32) for ids in self.encode_lists(texts, side)]

    def decode_lists(self, ids: list[list[int]], side: str = "target") -> list[str]:
        """Ids (neither padding nor EOS among them) -> texts, each by one call of the side's model."""
        if not self.is_pair:
            return self.processor.decode(ids)
        processor = self.target_processor if side == "target" else self.processor
        return [processor.decode_pieces([self.table[i] for i in sequence if i not in self.specials or i == UNK_ID])
                for sequence in ids]

    def decode(self, ids: np.ndarray | list[int], side: str = "target") -> str:
        """Ids up to the first EOS (padding dropped) -> text."""
        ids = [int(i) for i in ids]
        if EOS_ID in ids:
            ids = ids[: ids.index(EOS_ID)]
        return self.decode_lists([[i for i in ids if i != PAD_ID]], side)[0]

    def id_to_piece(self, i: int) -> str:
        return self.table[i] if self.is_pair else self.processor.id_to_piece(i)

    def piece_to_id(self, piece: str) -> int:
        return self.index.get(piece, UNK_ID) if self.is_pair else self.processor.piece_to_id(piece)

    def is_special(self, i: int) -> bool:
        """Whether piece i is no text's: control pieces (pad, eos, a tag), the unknown piece included."""
        if self.is_pair:
            return i in self.specials
        return self.processor.is_control(i) or self.processor.is_unknown(i)

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self.id_to_piece(int(i)) for i in ids]


def write_pair(path: str, source_model: str, target_model: str, pieces: Sequence[str],
               specials: Iterable[int]) -> Tokenizer:
    """A pair vocabulary file: the two sentencepiece models (paths), the piece of each id, the special ids."""
    def proto(model):
        with open(model, "rb") as handle:
            return base64.b64encode(handle.read()).decode("ascii")
    record = {"format": PAIR_FORMAT, "source": proto(source_model), "target": proto(target_model),
              "pieces": list(pieces), "specials": sorted(set(specials))}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp", encoding="utf-8") as handle:
        json.dump(record, handle, ensure_ascii=False)
    os.replace(handle.name, path)
    return Tokenizer(path)


def sample_sentences(sentences: Sequence[str], *, max_sentences: int, max_characters: int = 0,
                     seed: int = 0) -> list[str]:
    """A seeded random sample drawn from the whole of `sentences`: at most max_sentences sentences and, when
    max_characters > 0, at most that many characters (always at least one sentence). Sampling from the
    whole split, not its first lines, matters: corpora are ordered by source (Europarl, then news, then
    web crawl), and a prefix would give a vocabulary of one domain. Only the sample is read from
    `sentences` (any sequence: e.g. a split spilled to disk), never the whole of it."""
    order = np.random.default_rng(seed).permutation(len(sentences))[:max_sentences]
    if max_characters <= 0:
        return [sentences[i] for i in order]
    sample, characters = [], 0
    for index in order:  # a loop, not a cumsum over the whole order: reads no sentence past the cap
        text = sentences[index]
        characters += len(text)
        if sample and characters > max_characters:
            break
        sample.append(text)
    return sample


def train_tokenizer(sentences: Sequence[str], model_path: str, *, vocab_size: int, model_type: str = "unigram",
                    character_coverage: float = 1.0, max_sentences: int = 1_000_000, max_characters: int = 0,
                    seed: int = 0, control_symbols: Sequence[str] = ()) -> Tokenizer:
    """Train a sentencepiece model (`model_type` unigram or bpe) on a seeded sample of `sentences` and write
    `model_path`.

    The file is written to a temporary name and renamed, so a failure leaves no partial model behind.
    """
    if not sentences:
        raise VocabularyError("cannot train a vocabulary on an empty corpus")
    sentences = sample_sentences(sentences, max_sentences=max_sentences, max_characters=max_characters, seed=seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            character_coverage=character_coverage, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
            input_sentence_size=max_sentences, shuffle_input_sentence=True, num_threads=os.cpu_count() or 1,
            minloglevel=2, **({"control_symbols": list(control_symbols)} if control_symbols else {}))
    except RuntimeError as error:
        # sentencepiece says e.g. "Vocabulary size too high (8000). Please set it to a value <= 1234."
        raise VocabularyError(
            f"cannot train a sentencepiece vocabulary of size {vocab_size} on {len(sentences)} sentences: "
            f"{error}. Lower data.vocab_size.") from error
    directory = os.path.dirname(os.path.abspath(model_path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, delete=False, suffix=".tmp") as handle:
        handle.write(model.getvalue())
    os.replace(handle.name, model_path)
    return Tokenizer(model_path)
