"""The statistics of a Pass@1 figure: its confidence interval, unbiased pass@k, and paired comparisons.

A benchmark's problems are a sample of the problems a model will meet, and each problem's verdict at
temperature > 0 is itself random, so a Pass@1 of 0.62 on 244 problems is an estimate with a standard error of
about three points. Everything here treats the **problems** as the unit of resampling: the samples of one
problem are correlated (the same model on the same text), the problems are not.

- :func:`wilson` -- the Wilson score interval of a binomial proportion. Used when every problem has one sample
  (its verdicts are independent Bernoulli trials of the benchmark's rate); unlike the normal (Wald) interval
  it stays inside [0, 1] and keeps its coverage near 0 and 1 (e.g. 0 of 60 correct).
- :func:`bootstrap_mean` -- the percentile bootstrap of the mean over problems of a per-problem score (its
  pass rate over ``n`` samples): the interval when problems have several samples.
- :func:`pass_at_k` -- the unbiased estimator of pass@k from ``n`` samples of which ``c`` are correct
  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): ``1 - C(n-c, k) / C(n, k)``.
- :func:`paired_difference` -- the paired bootstrap of the difference of two models on the same problems
  (resampling problems, both models' scores together): the difference, its interval and the share of
  resamples in which the challenger is not better. Pairing removes the problems' difficulty from the noise,
  so it detects differences an unpaired comparison of two intervals would not.

Pure Python + numpy; seeded, so a report's intervals are reproducible.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist
from typing import Sequence

import numpy as np

DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 2000


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson(successes: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` of ``successes`` out of ``n`` Bernoulli trials."""
    if n <= 0:
        raise ValueError(f"wilson: n must be positive, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson: successes {successes} not in [0, {n}]")
    z = _z(confidence)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # exact at the edges (0 or n successes), where rounding could otherwise leave 1e-17 outside
    return (0.0 if successes == 0 else max(0.0, centre - half), 1.0 if successes == n else min(1.0, centre + half))


def _resampled_means(v: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """The means of ``resamples`` draws of ``v.size`` values of ``v`` with replacement."""
    return v[rng.integers(0, v.size, size=(resamples, v.size))].mean(axis=1)


def _percentiles(means: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


def bootstrap_mean(values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE,
                   resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """The percentile-bootstrap interval of the mean of ``values`` (one score per problem)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("bootstrap_mean: no values")
    _z(confidence)
    return _percentiles(_resampled_means(v, resamples, np.random.default_rng(seed)), confidence)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``n`` samples, ``c`` correct. ``1 - C(n-c, k) / C(n, k)``, computed
    as a product so that large ``n`` does not overflow."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} not in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} not in [1, n={n}]")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclass(frozen=True)
class Estimate:
    """A pass rate over problems with its interval."""
    value: float
    low: float
    high: float
    method: str
    problems: int
    samples_per_problem: int
    confidence: float

    def as_dict(self) -> dict:
        return asdict(self)


def pass_rate(correct: Sequence[Sequence[bool]], confidence: float = DEFAULT_CONFIDENCE,
              resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Estimate:
    """Mean Pass@1 over problems, each problem given by its samples' verdicts, with a ``confidence`` interval:
    Wilson when every problem has exactly one sample, else the bootstrap over problems of the per-problem
    pass rates."""
    if not correct:
        raise ValueError("pass_rate: no problems")
    counts = {len(c) for c in correct}
    if 0 in counts:
        raise ValueError("pass_rate: a problem has no samples")
    rates = [_rate(c) for c in correct]
    value = sum(rates) / len(rates)
    per = min(counts) if len(counts) == 1 else -1  # -1: problems have different sample counts
    if counts == {1}:
        lo, hi = wilson(sum(int(bool(c[0])) for c in correct), len(correct), confidence)
        method = "wilson"
    else:
        lo, hi = bootstrap_mean(rates, confidence, resamples, seed)
        method = f"percentile bootstrap over problems ({resamples} resamples)"
    return Estimate(value, lo, hi, method, len(correct), per, confidence)


def mean_pass_at_k(correct: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[int, float]:
    """Unbiased pass@k averaged over problems, for every ``k`` no larger than the smallest sample count."""
    n_min = min(len(c) for c in correct)
    return {k: sum(pass_at_k(len(c), sum(map(bool, c)), k) for c in correct) / len(correct)
            for k in sorted(set(ks)) if 1 <= k <= n_min}


@dataclass(frozen=True)
class PairedDifference:
    """``challenger - champion`` mean per-problem score on the same problems."""
    difference: float
    low: float
    high: float
    p_not_better: float  # share of bootstrap resamples with difference <= 0 (a one-sided bootstrap p-value)
    problems: int
    method: str
    confidence: float

    def as_dict(self) -> dict:
        return asdict(self)


def paired_difference(challenger: Sequence[float], champion: Sequence[float],
                      confidence: float = DEFAULT_CONFIDENCE, resamples: int = DEFAULT_RESAMPLES,
                      seed: int = 0) -> PairedDifference:
    """The paired bootstrap of ``mean(challenger) - mean(champion)``: both sequences are per-problem scores
    (pass rates) on the same problems in the same order; each resample draws problems with replacement and
    takes both models' scores of the drawn problems (:func:`stratified_paired_difference` of one group)."""
    d = stratified_paired_difference({"": (challenger, champion)}, confidence, resamples, seed)
    return replace(d, method=f"paired percentile bootstrap over problems ({resamples} resamples)")


def stratified_paired_difference(groups: dict[str, tuple[Sequence[float], Sequence[float]]],
                                 confidence: float = DEFAULT_CONFIDENCE, resamples: int = DEFAULT_RESAMPLES,
                                 seed: int = 0) -> PairedDifference:
    """The paired bootstrap of the **mean over groups** (benchmarks) of each group's mean difference
    ``challenger - champion``: ``groups`` maps a benchmark to both models' per-problem scores on its problems
    (same order); every resample draws problems with replacement within each benchmark, so each benchmark
    keeps its weight whatever its size (the comparison the mean Pass@1 over benchmarks makes)."""
    if not groups:
        raise ValueError("stratified_paired_difference: no groups")
    _z(confidence)
    rng = np.random.default_rng(seed)
    point, boots, n = [], np.zeros(resamples), 0
    for name, (a, b) in sorted(groups.items()):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape or a.ndim != 1 or a.size == 0:
            where = f" of {name}" if name else ""
            raise ValueError(f"paired comparison{where}: need two equally long, non-empty score lists, got {a.shape} "
                             f"and {b.shape}")
        d = a - b
        point.append(d.mean())
        boots += _resampled_means(d, resamples, rng)
        n += d.size
    boots /= len(groups)
    lo, hi = _percentiles(boots, confidence)
    return PairedDifference(float(np.mean(point)), float(lo), float(hi), float((boots <= 0).mean()), n,
                            f"paired percentile bootstrap over problems within each of {len(groups)} benchmark(s) "
                            f"({resamples} resamples)", confidence)


def paired_scores(challenger: dict[str, Sequence[bool]], champion: dict[str, Sequence[bool]]
                  ) -> tuple[list[str], list[float], list[float]]:
    """Align two models' verdicts by problem id: the ids both have (sorted) and each model's per-problem pass
    rate on them. A problem only one model has is left out of the pairing (the caller reports how many)."""
    ids = sorted(set(challenger) & set(champion))
    return ids, [_rate(challenger[i]) for i in ids], [_rate(champion[i]) for i in ids]


def _rate(verdicts: Sequence[bool]) -> float:
    if not verdicts:
        raise ValueError("a problem has no samples")
    return sum(map(bool, verdicts)) / len(verdicts)
