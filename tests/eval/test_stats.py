"""eval.stats: intervals that cover at their nominal level, unbiased pass@k, the paired comparison."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from eval.stats import bootstrap_mean, mean_pass_at_k, paired_difference, paired_scores, pass_at_k, pass_rate, wilson


def test_wilson_matches_the_closed_form_and_stays_in_the_unit_interval():
    lo, hi = wilson(30, 60)
    z = 1.959963984540054
    p, n = 0.5, 60
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (lo, hi) == pytest.approx((c - h, c + h), abs=1e-12)
    assert wilson(0, 60)[0] == 0.0 and 0.05 < wilson(0, 60)[1] < 0.07  # 0 of 60 is not "exactly 0"
    assert wilson(60, 60)[1] == 1.0 and wilson(60, 60)[0] < 1.0
    assert wilson(30, 60, 0.99)[0] < lo  # wider at a higher confidence
    with pytest.raises(ValueError, match="successes 61"):
        wilson(61, 60)
    with pytest.raises(ValueError, match="confidence"):
        wilson(1, 2, 1.5)


def test_wilson_covers_the_true_rate_at_the_nominal_level():
    """Exactly (binomial probabilities) at every rate of a grid for 60 and 244 problems, and on 1,000
    simulated 244-problem benchmarks (one sample per problem) at each of several true rates."""
    from scipy.stats import binom

    for n in (60, 244):
        intervals = [wilson(k, n) for k in range(n + 1)]
        for rate in np.linspace(0.01, 0.99, 99):
            coverage = sum(binom.pmf(k, n, rate) for k, (lo, hi) in enumerate(intervals) if lo <= rate <= hi)
            assert coverage >= 0.93, (n, rate, coverage)
    rng = np.random.default_rng(0)
    for rate in (0.05, 0.3, 0.62, 0.9):
        hits = rng.binomial(244, rate, size=1000)
        covered = sum(lo <= rate <= hi for lo, hi in (wilson(int(k), 244) for k in hits))
        assert covered >= 930, (rate, covered)


def test_bootstrap_over_problems_covers_the_true_rate_with_several_samples_per_problem():
    """Problems of unequal difficulty (pass probabilities ~ Beta), 4 samples each at temperature > 0: the
    interval of :func:`pass_rate` covers the population's mean rate in >= 93 % of 1,000 benchmarks of 100
    problems."""
    rng = np.random.default_rng(1)
    a, b = 2.0, 3.0
    truth = a / (a + b)
    covered = 0
    for trial in range(1000):
        p = rng.beta(a, b, size=100)
        correct = (rng.random((100, 4)) < p[:, None]).tolist()
        est = pass_rate(correct, resamples=1000, seed=trial)
        covered += est.low <= truth <= est.high
        assert est.method.startswith("percentile bootstrap") and est.samples_per_problem == 4
    assert covered >= 930, covered


def test_pass_rate_uses_wilson_for_one_sample_and_reports_what_it_did():
    est = pass_rate([[True], [False], [True], [True]])
    assert est.value == 0.75 and est.method == "wilson" and est.problems == 4 and est.samples_per_problem == 1
    assert (est.low, est.high) == wilson(3, 4)
    with pytest.raises(ValueError, match="no samples"):
        pass_rate([[True], []])


def test_pass_at_k_is_the_closed_form_and_the_mean_over_subsets():
    for n, c in [(5, 0), (5, 2), (10, 3), (10, 10), (7, 6)]:
        for k in range(1, n + 1):
            closed = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
            # the definition: the share of size-k subsets of the n samples that hold a correct one
            samples = [True] * c + [False] * (n - c)
            subsets = list(itertools.combinations(samples, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert pass_at_k(200, 3, 1) == pytest.approx(3 / 200)
    assert 0 < pass_at_k(1000, 1, 10) < 1  # no overflow
    assert mean_pass_at_k([[True, False, False, False], [False] * 4], ks=[1, 2, 8]) == {
        1: pytest.approx(0.125), 2: pytest.approx(0.25)}  # k=8 > n is left out
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_paired_difference_on_fixed_verdicts():
    # 44 problems: both right on 20, both wrong on 10, only the challenger right on 12, only the champion on 2
    challenger = [1.0] * 20 + [0.0] * 10 + [1.0] * 12 + [0.0] * 2
    champion = [1.0] * 20 + [0.0] * 10 + [0.0] * 12 + [1.0] * 2
    d = paired_difference(challenger, champion, resamples=4000, seed=0)
    assert d.difference == pytest.approx(10 / 44)
    assert 0.0 < d.low < d.difference < d.high  # a real gain: the interval excludes 0
    assert d.p_not_better < 0.025 and d.problems == 44
    # 8 against 2 discordant problems is not enough at 95 % (McNemar's exact one-sided p = 0.055)
    weak = paired_difference([1.0] * 20 + [1.0] * 8 + [0.0] * 2, [1.0] * 20 + [0.0] * 8 + [1.0] * 2,
                             resamples=4000, seed=0)
    assert weak.difference == pytest.approx(0.2) and weak.low <= 0.0 < weak.high

    # a tie: the difference is 0 and its interval straddles 0
    tie = paired_difference([1.0] * 5 + [0.0] * 5, [0.0] * 5 + [1.0] * 5, seed=0)
    assert tie.difference == 0.0 and tie.low < 0 < tie.high and tie.p_not_better > 0.4
    # the unpaired view of the first, clear gain (32 vs 22 of 44): two intervals that overlap
    assert wilson(32, 44)[0] < wilson(22, 44)[1]
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([1.0], [1.0, 0.0])


def test_paired_scores_align_by_problem_id():
    ids, a, b = paired_scores({"p1": [True, False], "p2": [True], "only_a": [True]},
                              {"p2": [False], "p1": [True, True], "only_b": [False]})
    assert ids == ["p1", "p2"] and a == [0.5, 1.0] and b == [1.0, 0.0]


def test_bootstrap_mean_is_seeded_and_brackets_the_mean():
    v = np.random.default_rng(3).random(50)
    assert bootstrap_mean(v, seed=7) == bootstrap_mean(v, seed=7)
    lo, hi = bootstrap_mean(v)
    assert lo < v.mean() < hi
