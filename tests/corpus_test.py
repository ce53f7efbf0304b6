"""Tests of the built-in synthetic English -> Spanish corpus (transformer/corpus.py)."""

import hashlib
import os
import re
import subprocess
import sys

import pytest

from transformer import corpus
from transformer.corpus import (
    _ADJECTIVE_BY_EN,
    _NOUN_BY_EN,
    _SUBJECT_PRONOUNS,
    _VERB_BY_EN,
    _connect,
    _copula,
    _direct_object,
    _front,
    _join,
    _noun_phrase,
    _noun_subject,
    _object_relative,
    _prepositional,
    _Preposition,
    _pronoun_subject,
    _sentence,
    _subject_relative,
    _verb_group,
)

SMALL = dict(train_size=3000, valid_size=300, test_size=300)


@pytest.fixture(scope="module")
def sample():
    return corpus.generate_pairs(5000, seed=0)


@pytest.fixture(scope="module")
def splits():
    return {split: corpus.builtin_split(split, **SMALL) for split in corpus.SPLITS}


# --- Helpers that render hand-built structures ------------------------------


def _pronoun(en):
    return _pronoun_subject(next(p for p in _SUBJECT_PRONOUNS if p.en == en))


def _the(noun, plural=False, adj=None):
    adjective = _ADJECTIVE_BY_EN[adj] if adj else None
    return _noun_phrase(_NOUN_BY_EN[noun], "the", plural, adjective)


def _clause(subject, *rest):
    """A whole sentence: subject (a _Subject) followed by (English, Spanish) parts."""
    return _sentence(*_join(subject[:2], *rest))


IN = _Preposition("in", "en", "p")
NEAR = _Preposition("near", "cerca de", "pu")
TO = _Preposition("to", "a", "p")


# --- Hand-checked translations ----------------------------------------------


def test_feminine_plural_noun_with_adjective_agrees():
    houses = _noun_subject(_NOUN_BY_EN["house"], "the", True, _ADJECTIVE_BY_EN["white"])
    old = _ADJECTIVE_BY_EN["old"]
    pair = _clause(houses, _copula(old.estar, "pres", houses.person), (old.en, old.forms[3]))
    assert pair == ("The white houses are old.", "Las casas blancas son viejas.")


def test_estar_adjective_and_imperfect_past():
    girls = _noun_subject(_NOUN_BY_EN["girl"], "my", True)
    tired = _ADJECTIVE_BY_EN["tired"]
    pair = _clause(girls, _copula(tired.estar, "past", girls.person, neg=True), (tired.en, tired.forms[3]))
    assert pair == ("My girls were not tired.", "Mis niñas no estaban cansadas.")


def test_we_conjugation_drops_the_pronoun():
    sleep = _VERB_BY_EN["sleep"]
    we = _pronoun("we")
    garden = _prepositional(IN, _the("garden"))
    assert _clause(we, _verb_group(sleep, "pres", we.person), garden) == (
        "We sleep in the garden.", "Dormimos en el jardín.")
    assert _clause(we, _verb_group(sleep, "fut", we.person)) == ("We will sleep.", "Dormiremos.")
    assert _clause(_pronoun("he"), _verb_group(sleep, "past", 2)) == ("He slept.", "Él durmió.")


def test_personal_a_contracts_with_el():
    girl = _noun_subject(_NOUN_BY_EN["girl"], "the")
    dog = _direct_object(_NOUN_BY_EN["dog"], _the("dog"))
    assert _clause(girl, _verb_group(_VERB_BY_EN["see"], "pres", 2), dog) == (
        "The girl sees the dog.", "La niña ve al perro.")
    # Inanimate objects take no "a".
    ball = _direct_object(_NOUN_BY_EN["ball"], _the("ball"))
    assert _clause(girl, _verb_group(_VERB_BY_EN["find"], "past", 2), ball) == (
        "The girl found the ball.", "La niña encontró la pelota.")


def test_prepositions_contract_with_el():
    boys = _noun_subject(_NOUN_BY_EN["boy"], "two", True)
    go = _verb_group(_VERB_BY_EN["go"], "pres", boys.person)
    assert _clause(boys, go, _prepositional(TO, _the("park"))) == (
        "Two boys go to the park.", "Dos niños van al parque.")
    i = _pronoun("I")
    assert _clause(i, _verb_group(_VERB_BY_EN["live"], "pres", 0), _prepositional(NEAR, _the("river"))) == (
        "I live near the river.", "Vivo cerca del río.")


def test_subject_relative_clause():
    see = _verb_group(_VERB_BY_EN["see"], "pres", 2)
    relative = _subject_relative(_NOUN_BY_EN["dog"], _join(see, _direct_object(_NOUN_BY_EN["cat"], _the("cat"))))
    dog = _noun_subject(_NOUN_BY_EN["dog"], "the", relative=relative)
    assert _clause(dog, _verb_group(_VERB_BY_EN["sleep"], "pres", 2)) == (
        "The dog that sees the cat sleeps.", "El perro que ve al gato duerme.")


def test_object_relative_clause_and_who():
    relative = _object_relative(_pronoun("I"), _verb_group(_VERB_BY_EN["find"], "past", 0))
    assert _noun_subject(_NOUN_BY_EN["key"], "the", relative=relative)[:2] == (
        "the key that I found", "la llave que encontré")
    cry = _verb_group(_VERB_BY_EN["cry"], "prog", 2)
    assert _subject_relative(_NOUN_BY_EN["woman"], cry) == ("who is crying", "que está llorando")


def test_clitic_goes_before_the_verb():
    dog = _noun_subject(_NOUN_BY_EN["dog"], "the")
    verb_group = _verb_group(_VERB_BY_EN["see"], "pres", 2, neg=True, clitic="lo")
    assert _clause(dog, verb_group, ("him", "")) == ("The dog does not see him.", "El perro no lo ve.")
    watching = _verb_group(_VERB_BY_EN["watch"], "prog", 4, clitic="nos")
    assert watching == ("are watching", "nos están mirando")


def test_frequency_adverb_moves_before_auxiliary():
    assert _copula(True, "pres", 2, freq="always") == ("is always", "siempre está")
    assert _verb_group(_VERB_BY_EN["swim"], "fut", 1, freq="never") == ("will never swim", "nunca nadarás")


def test_subordinate_clauses():
    main = _join(_pronoun("I")[:2], _verb_group(_VERB_BY_EN["sleep"], "pres", 0))
    sub = _join(_noun_subject(_NOUN_BY_EN["dog"], "the")[:2], _verb_group(_VERB_BY_EN["run"], "pres", 2))
    assert _sentence(*_connect(main, "because", sub)) == (
        "I sleep because the dog runs.", "Duermo porque el perro corre.")
    assert _sentence(*_front("when", sub, main)) == (
        "When the dog runs, I sleep.", "Cuando el perro corre, duermo.")
    assert _sentence(*_connect(main, "but", sub)) == (
        "I sleep, but the dog runs.", "Duermo, pero el perro corre.")
    go = _join(_pronoun("I")[:2], _verb_group(_VERB_BY_EN["go"], "fut", 0))
    assert _connect(sub, "and", go)[1] == "el perro corre e iré"  # "y" -> "e" before /i/


@pytest.mark.parametrize(
    "verb, tense, person, spanish",
    [
        ("hear", "past", 2, "oyó"),
        ("go", "pres", 0, "voy"),
        ("have", "fut", 3, "tendremos"),
        ("sleep", "prog", 4, "están durmiendo"),
        ("look for", "past", 0, "busqué"),
        ("follow", "pres", 1, "sigues"),
        ("come", "past", 4, "vinieron"),
    ],
)
def test_irregular_conjugations(verb, tense, person, spanish):
    assert _verb_group(_VERB_BY_EN[verb], tense, person)[1] == spanish


def test_a_becomes_an_before_vowel():
    assert _noun_phrase(_NOUN_BY_EN["apple"], "a")[0] == "an apple"
    assert _noun_phrase(_NOUN_BY_EN["cat"], "a", adj=_ADJECTIVE_BY_EN["old"]) == ("an old cat", "un gato viejo")


# --- Properties of the generated corpus -------------------------------------


def test_same_seed_same_pairs_other_seed_other_pairs():
    assert corpus.generate_pairs(300, seed=7) == corpus.generate_pairs(300, seed=7)
    assert corpus.generate_pairs(300, seed=7) != corpus.generate_pairs(300, seed=8)
    assert corpus.generate_pairs(100, seed=7) == corpus.generate_pairs(300, seed=7)[:100]
    assert corpus.generate_pairs(0, seed=7) == []


def test_deterministic_across_processes():
    """No dependence on Python's per-process string hash randomisation."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = "from transformer import corpus; print(corpus.builtin_split('test', test_size=200))"
    outputs = {
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=root,
                       env=dict(os.environ, PYTHONHASHSEED=hash_seed)).stdout
        for hash_seed in ("1", "2")
    }
    assert outputs == {f"{corpus.builtin_split('test', test_size=200)}\n"}


def test_one_translation_per_english_sentence():
    translations = {}
    for en, es in corpus.generate_pairs(20_000, seed=1):
        assert translations.setdefault(en, es) == es, en


def test_surface_form(sample):
    for en, es in sample:
        assert en[0].isupper() and en.endswith(".") and not en.endswith(".."), en
        assert es[0].isupper() and es.endswith(".") and not es.endswith(".."), es
        assert "  " not in en and "  " not in es
        assert not re.search(r"\b(a|de) el\b", es), es  # must contract to al/del
        assert not re.search(r"\ba [aeiouAEIOU]", en), en  # must be "an"


def test_sentence_lengths(sample):
    lengths = [len(en.split()) for en, _ in sample]
    mean = sum(lengths) / len(lengths)
    print(f"English words per sentence: min {min(lengths)} mean {mean:.1f} max {max(lengths)}")
    assert min(lengths) >= 4 and max(lengths) <= 25
    assert 9 <= mean <= 13
    # Both short and long sentences are common.
    assert sum(n <= 6 for n in lengths) > 0.1 * len(lengths)
    assert sum(n >= 16 for n in lengths) > 0.1 * len(lengths)


def test_splits_have_requested_sizes_and_no_duplicates(splits):
    for split, pairs in splits.items():
        assert len(pairs) == SMALL[f"{split}_size"]
        assert len({en for en, _ in pairs}) == len(pairs)


def test_splits_are_disjoint(splits):
    english = {split: {en for en, _ in pairs} for split, pairs in splits.items()}
    assert not english["train"] & english["valid"]
    assert not english["train"] & english["test"]
    assert not english["valid"] & english["test"]
    # Also across seeds: the split of a sentence depends only on the sentence.
    other_train = {en for en, _ in corpus.builtin_split("train", seed=1, **SMALL)}
    assert not other_train & english["test"]


def test_split_is_deterministic_and_independent_of_other_sizes(splits):
    assert corpus.builtin_split("test", **SMALL) == splits["test"]
    assert corpus.builtin_split("test", train_size=10, valid_size=0, test_size=300) == splits["test"]
    assert corpus.builtin_split("valid", train_size=50_000, valid_size=300, test_size=0) == splits["valid"]
    # A smaller train split is a prefix of a larger one.
    assert corpus.builtin_split("train", train_size=1000) == splits["train"][:1000]
    assert corpus.builtin_split("test", seed=1, **SMALL) != splits["test"]


def test_es_to_en_swaps_pairs(splits):
    swapped = corpus.builtin_split("test", source_lang="es", target_lang="en", **SMALL)
    assert swapped == [(es, en) for en, es in splits["test"]]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(split="dev"), "'dev'"),
        (dict(split="train", source_lang="fr"), "'fr'"),
        (dict(split="train", target_lang="de"), "'de'"),
        (dict(split="train", source_lang="es", target_lang="es"), "'es'"),
        (dict(split="train", train_size=-1), "-1"),
        (dict(split="test", valid_size=10**9), "1000000000"),
        (dict(split="valid", test_size="100"), "'100'"),
        (dict(split="valid", valid_size=2.5), "2.5"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value(kwargs, named):
    split = kwargs.pop("split")
    with pytest.raises(ValueError, match=re.escape(named)):
        corpus.builtin_split(split, **kwargs)


def test_generate_pairs_rejects_negative_count():
    with pytest.raises(ValueError, match="-3"):
        corpus.generate_pairs(-3, seed=0)


def test_the_generator_version_names_the_generated_pairs():
    """Token caches of the built-in corpus are found by GENERATOR_VERSION, seed and size, without generating
    the split: a change to the generated pairs must come with a new version, or a restart would pair the
    cache of the old grammar with valid and test splits of the new one."""
    pairs = corpus.builtin_split("train", train_size=2000) + corpus.builtin_split("valid", valid_size=200)
    digest = hashlib.sha256(repr(pairs).encode()).hexdigest()[:16]
    assert (corpus.GENERATOR_VERSION, digest) == (1, "12508a9279bdf144"), (
        "the generated pairs changed: bump corpus.GENERATOR_VERSION and record the new digest here")


def test_a_streamed_split_checks_its_arguments_before_the_first_pair():
    with pytest.raises(ValueError, match="train_size=10000001"):
        corpus.iter_builtin_split("train", train_size=10_000_001)  # no next(): raised when asked
    stream = corpus.iter_builtin_split("test", test_size=300)
    assert next(stream) == corpus.builtin_split("test", test_size=1)[0]
