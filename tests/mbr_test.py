"""Minimum Bayes risk's choice among candidates (transformer/mbr.py), against sacreBLEU's own sentence scores, and
decode.search=mbr: the candidates a search draws and the one it returns."""

import dataclasses

import decode_setup
import numpy as np
import pytest
import sacrebleu

from transformer import decode, mbr
from transformer.decode import DecodeConfig

CANDIDATES = ["Ein Mann fährt Fahrrad.", "Ein Mann fährt ein Fahrrad.", "Eine Frau läuft am Strand.",
              "Ein Mann fährt ein rotes Fahrrad.", "", "Hunde."]


@pytest.mark.parametrize("utility, sentence_score", [("chrf", sacrebleu.sentence_chrf),
                                                     ("bleu", sacrebleu.sentence_bleu)])
def test_the_utility_matrix_is_sacrebleus_sentence_score_of_each_pair(utility, sentence_score):
    expected = [[sentence_score(h, [r]).score for r in CANDIDATES] for h in CANDIDATES]
    np.testing.assert_allclose(mbr.utility_matrix(CANDIDATES, utility), expected, atol=1e-9)


@pytest.mark.parametrize("utility", mbr.UTILITIES)
def test_mbr_ranks_first_the_medoid_found_by_brute_force(utility):
    # The third is the centre: each other candidate changes one of its words.
    texts = ["Ein Mann fährt ein Auto.", "Eine Frau fährt ein Fahrrad.", "Ein Mann fährt ein Fahrrad.",
             "Ein Mann kauft ein Fahrrad.", "Ein Mann fährt ein Boot."]
    scores = np.array([[mbr.metric(utility).sentence_score(h, [r]).score for r in texts] for h in texts])
    order, expected = mbr.ranking(texts, utility)
    assert order[0] == np.argmax(scores.mean(axis=1)) == 2
    np.testing.assert_allclose(expected, scores.mean(axis=1)[order])
    assert all(a >= b for a, b in zip(expected, expected[1:]))


@pytest.mark.parametrize("utility", mbr.UTILITIES)
def test_a_candidate_drawn_more_often_wins_and_repeats_count_as_draws(utility):
    texts = ["Eine Frau läuft am Strand."] * 3 + CANDIDATES[:2] + ["Hunde."]
    order, expected = mbr.ranking(texts, utility)
    assert order[0] == 0 and list(order[1:3]) == [1, 2]  # the first of equal candidates first
    # Three draws of one text weigh as three references: the mean over all six, not over the four distinct.
    matrix = mbr.utility_matrix(texts, utility)
    np.testing.assert_allclose(expected, matrix.mean(axis=1)[order])


def test_one_candidate_is_chosen_and_an_unknown_utility_is_named():
    order, _ = mbr.ranking(["Hallo."], "chrf")
    assert order.tolist() == [0]
    with pytest.raises(ValueError, match="decode.mbr_utility='comet' must be one of"):
        mbr.metric("comet")


# ----------------------------------------------------------------------------------------------------
# decode.search=mbr: candidates drawn on device, ranked by search_sentences


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = decode_setup.vocabulary(tmp_path_factory.mktemp("vocab"))
    graphdef, params = decode_setup.tiny_model()
    return tokenizer, graphdef, params, decode_setup.sentences(tokenizer, 9)


def padded(tokenizer, sentences: list[str]) -> np.ndarray:
    """[sentences, 16] the sentences' ids (decode_setup's are at most 16 tokens), padded with 0."""
    inputs = np.zeros((len(sentences), 16), np.int32)
    for row, ids in enumerate(tokenizer.encode(sentences)):
        inputs[row, :len(ids)] = ids
    return inputs


def sampler(graphdef, **settings):
    return decode.make_search(graphdef, max_extra_length=decode_setup.MAX_EXTRA_LENGTH, temperature=1.0, seed=3,
                              scores=True, **settings)


def test_mbr_over_one_candidate_returns_plain_samplings_sample(tiny):
    tokenizer, graphdef, params, sentences = tiny
    sampled = decode.search_sentences(sampler(graphdef), params, tokenizer, sentences, 4, call=0)
    chosen = decode.search_sentences(sampler(graphdef, candidates=1, utility="chrf"), params, tokenizer, sentences, 4,
                                     call=0)
    assert [x.tolist() for x in chosen.best_ids()] == [x.tolist() for x in sampled.best_ids()]
    # Candidate 0 of several is that sample too; the others are fresh draws.
    many = sampler(graphdef, candidates=6)
    inputs = padded(tokenizer, sentences)
    one, _ = sampler(graphdef).run(params, inputs, decode.default_streams(len(sentences)))
    six, _ = many.run(params, inputs, decode.default_streams(len(sentences)))
    np.testing.assert_array_equal(np.asarray(six)[:, 0], np.asarray(one)[:, 0])
    real = [row for row, text in enumerate(sentences) if text]
    assert all(len({tuple(x) for x in np.asarray(six)[row]}) > 1 for row in real)


@pytest.mark.parametrize("utility", mbr.UTILITIES)
def test_search_sentences_returns_the_candidate_of_highest_expected_utility(tiny, utility):
    """The device's candidates, read back unranked, scored pair by pair with sacreBLEU: the search's choice and
    its score are the brute-force argmax and mean, its list the distinct candidates best first."""
    tokenizer, graphdef, params, sentences = tiny
    sentences = [s for s in sentences if s]
    search = sampler(graphdef, candidates=8, utility=utility, epsilon=0.02)
    inputs = padded(tokenizer, sentences)
    sequences, _ = search.run(params, inputs, decode.default_streams(len(sentences)))
    ranked = decode.search_sentences(search, params, tokenizer, sentences, 8 * len(sentences), call=0)
    score = {"chrf": sacrebleu.sentence_chrf, "bleu": lambda h, r: mbr.metric("bleu").sentence_score(h, r)}[utility]
    for row, hypotheses in zip(np.asarray(sequences), ranked.hypotheses):
        texts = [tokenizer.decode(ids[:list(ids).index(decode.EOS_ID) + 1]) for ids in row]
        expected = [np.mean([score(text, [other]).score for other in texts]) for text in texts]
        assert tokenizer.decode(hypotheses[0].ids) == texts[int(np.argmax(expected))]
        np.testing.assert_allclose(hypotheses[0].score, max(expected), rtol=1e-9)
        assert sorted(tokenizer.decode(h.ids) for h in hypotheses) == sorted(set(texts))
        assert [h.score for h in hypotheses] == sorted((h.score for h in hypotheses), reverse=True)


def test_mbr_over_a_beams_nbest_ranks_the_beams_hypotheses(tiny):
    tokenizer, graphdef, params, sentences = tiny
    beam = decode.make_search(graphdef, max_extra_length=decode_setup.MAX_EXTRA_LENGTH, beam_size=4)
    ranked = decode.make_search(graphdef, max_extra_length=decode_setup.MAX_EXTRA_LENGTH, beam_size=4, utility="chrf")
    listed = decode.search_sentences(beam, params, tokenizer, sentences, 4).hypotheses
    chosen = decode.search_sentences(ranked, params, tokenizer, sentences, 4).hypotheses
    for hypotheses, mbr_hypotheses in zip(listed, chosen):
        texts = [tokenizer.decode(h.ids) for h in hypotheses]
        assert sorted(tokenizer.decode(h.ids) for h in mbr_hypotheses) == sorted(set(texts))
        if texts:
            order, _ = mbr.ranking(texts, "chrf")
            assert tokenizer.decode(mbr_hypotheses[0].ids) == texts[order[0]]


def test_the_decode_config_names_a_bad_mbr_setting():
    mbr_config = dataclasses.replace(DecodeConfig(), search="mbr", mbr_candidates=8, epsilon=0.02, beam_size=4)
    assert mbr_config.search_tag == "mbr8-chrf-samples-t1-k0-p0-e0.02-extra50"  # beam_size 4 is not read
    assert dataclasses.replace(mbr_config, mbr_from="beam", epsilon=0.0).search_tag == "mbr8-chrf-beam-gnmt0.6-extra50"
    mbr_config.check_nbest(8)
    for changes, message in [({"mbr_candidates": 0}, "decode.mbr_candidates=0 must be >= 1"),
                             ({"mbr_from": "nbest"}, "decode.mbr_from='nbest' must be one of"),
                             ({"mbr_utility": "comet"}, "decode.mbr_utility='comet' must be one of"),
                             ({"mbr_from": "beam"}, "decode.mbr_from='beam' ranks beam search's n-best list"),
                             ({"search": "best"}, "decode.search='best' must be one of"),
                             ({"epsilon": 1.0}, r"decode.epsilon=1.0 must be in \[0, 1\)")]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(mbr_config, **changes)
    with pytest.raises(ValueError, match="--nbest=9 must be between 0 .off. and decode.mbr_candidates=8"):
        mbr_config.check_nbest(9)
