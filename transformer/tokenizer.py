"""Sentencepiece: train one joint vocabulary on the training split, save it in the workdir, load it.

Ids: 0 = padding (also the decoder's start symbol), 1 = end of sentence, 2 = unknown; no BOS. A vocabulary
trained for tagged back-translation (data.tag_synthetic) also holds the control piece SYNTHETIC_TAG, which no text
encodes to: only the data pipeline puts it before a synthetic source.
"""

from __future__ import annotations

import functools
import io
import os
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from transformer.errors import VocabularyError

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
SYNTHETIC_TAG = "<bt>"  # Caswell et al. 2019's tag of back-translated sources, a control piece
VOCAB_MODEL_TYPES = ("unigram", "bpe")  # sentencepiece's two subword models (its char and word are not subwords)


class Tokenizer:
    """A loaded sentencepiece model: text <-> int32 ids, with EOS appended on encoding."""

    def __init__(self, model_path: str):
        self.path = model_path
        try:
            self.processor = spm.SentencePieceProcessor(model_file=model_path)
        except (OSError, RuntimeError) as error:
            raise VocabularyError(f"cannot load sentencepiece model {model_path}: {error}") from error
        if self.processor.pad_id() != PAD_ID or self.processor.eos_id() != EOS_ID:
            raise VocabularyError(
                f"sentencepiece model {model_path} has pad_id={self.processor.pad_id()}, "
                f"eos_id={self.processor.eos_id()}; this project needs pad_id={PAD_ID}, eos_id={EOS_ID}")

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @functools.cached_property
    def model_type(self) -> str:
        """The sentencepiece model's kind ("unigram", "bpe", ...), as its trainer spec records it."""
        from sentencepiece import sentencepiece_model_pb2 as model_pb2

        proto = model_pb2.ModelProto.FromString(self.processor.serialized_model_proto())
        return model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()

    @property
    def synthetic_tag(self) -> int | None:
        """The id of the control piece SYNTHETIC_TAG, or None if this vocabulary was trained without it."""
        tag = self.processor.piece_to_id(SYNTHETIC_TAG)
        return tag if tag != self.processor.unk_id() and self.processor.is_control(tag) else None

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text -> int32 ids ending in EOS."""
        return [np.asarray(ids + [EOS_ID], np.int32) for ids in self.processor.encode(texts)]

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Ids up to the first EOS (padding dropped) -> text."""
        ids = [int(i) for i in ids]
        if EOS_ID in ids:
            ids = ids[: ids.index(EOS_ID)]
        return self.processor.decode([i for i in ids if i != PAD_ID])

    def pieces(self, ids: Iterable[int]) -> list[str]:
        return [self.processor.id_to_piece(int(i)) for i in ids]


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
