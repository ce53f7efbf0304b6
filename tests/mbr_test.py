"""Minimum Bayes risk's choice among candidates (transformer/mbr.py), against sacreBLEU's own sentence scores."""

import numpy as np
import pytest
import sacrebleu

from transformer import mbr

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
