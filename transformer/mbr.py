"""Minimum Bayes risk decoding's choice among a sentence's candidates (Kumar and Byrne 2004; Eikema and Aziz 2020;
Freitag et al. 2022, 2023): the candidate whose expected utility against the others, as pseudo-references, is
highest. The candidates come from the device (decode.py: samples or beam search's n-best); this module scores
them on the host with sacreBLEU's own sentence-level metrics.

Each candidate's expected utility is the mean of utility(candidate, reference) over all N candidates as
references, itself included, each counted once per time it was drawn: over samples that is the Monte Carlo
estimate of E_{y ~ P(.|x)}[utility], over an n-best list a uniform weight per entry. Distinct texts are scored
once (samples of a confident model repeat), and each reference's n-grams are extracted once (sacreBLEU's own
reference cache), so a sentence costs U^2 matches for U distinct candidates. Ties go to the earlier candidate.
"""

from __future__ import annotations

import functools

import numpy as np
import sacrebleu

UTILITIES = ("chrf", "bleu")


@functools.cache
def metric(utility: str) -> sacrebleu.metrics.base.Metric:
    """sacreBLEU's sentence-level metric of a utility name: chrF (its defaults: character 6-grams, beta 2) or BLEU
    with effective order (no zero score for a short sentence missing its 4-grams; sacreBLEU's advice for
    sentences)."""
    if utility == "chrf":
        return sacrebleu.metrics.CHRF()
    if utility == "bleu":
        return sacrebleu.metrics.BLEU(effective_order=True)
    raise ValueError(f"decode.mbr_utility={utility!r} must be one of {UTILITIES}")


def utility_matrix(texts: list[str], utility: str) -> np.ndarray:
    """[n, n] with entry (i, j) the sentence-level utility of texts[i] against texts[j] as its one reference,
    as sacrebleu.sentence_chrf / sentence_bleu(texts[i], [texts[j]]).score compute it (0-100)."""
    scorer = metric(utility)
    # The library's own steps of sentence_score, with each reference's n-grams extracted once, not n times.
    references = [scorer._extract_reference_info([scorer._preprocess_segment(text)]) for text in texts]
    if utility == "chrf":
        # chrF extracts a hypothesis's n-grams as it does a reference's: match the cached ones (2.4x faster).
        grams = [reference["ref_ngrams"][0] for reference in references]

        def statistics(i: int, j: int) -> list[int]:
            return [x for h, r in zip(grams[i], grams[j]) for x in sacrebleu.metrics.CHRF._get_match_statistics(h, r)]
    else:
        hypotheses = [scorer._preprocess_segment(text) for text in texts]

        def statistics(i: int, j: int) -> list[int]:
            return scorer._compute_segment_statistics(hypotheses[i], references[j])
    matrix = np.zeros((len(texts), len(texts)))
    for i in range(len(texts)):
        for j in range(len(texts)):
            matrix[i, j] = scorer._compute_score_from_stats(statistics(i, j)).score
    return matrix


def expected_utilities(texts: list[str], utility: str) -> np.ndarray:
    """[n] each candidate's mean utility against all n candidates as references (module docstring)."""
    distinct, index, counts = np.unique(np.asarray(texts, dtype=object), return_inverse=True, return_counts=True)
    matrix = utility_matrix(list(distinct), utility)
    return (matrix @ counts / len(texts))[index]


def ranking(texts: list[str], utility: str) -> tuple[np.ndarray, np.ndarray]:
    """(candidate indices by expected utility, highest first, ties in candidate order; their expected utilities)."""
    expected = expected_utilities(texts, utility)
    order = np.argsort(-expected, kind="stable")
    return order, expected[order]
