"""Champion / challenger decisions. Retraining through the real CLI runs on a copy of the lifecycle tests' state
(``tests/flows/test_lifecycle_e2e.py``), which saves the suite a lifecycle of its own."""

from __future__ import annotations

import pytest

from trex.tracking.champion import decide


def test_decide_rules():
    d = decide({"a": 0.5, "b": 0.5}, {"a": 0.7, "b": 0.48}, margin=0.05, tolerance=0.05)
    assert d.promote and d.challenger_mean == pytest.approx(0.59)
    d = decide({"a": 0.5, "b": 0.5}, {"a": 0.9, "b": 0.4}, margin=0.0, tolerance=0.05)
    assert not d.promote and "b regressed by 0.1000" in d.reason
    d = decide({"a": 0.5}, {"a": 0.52, "x": 1.0}, margin=0.05, tolerance=0.05)
    assert not d.promote and "margin" in d.reason and "x" in d.reason
    assert not decide({}, {"a": 1.0}, 0, 0).promote
    assert "| a | 0.5000 | 0.5200 | +0.0200 |" in d.markdown("t", "v1", "v2")


def _verdicts(pattern: str) -> dict[str, list[bool]]:
    return {f"p{i}": [c == "1"] for i, c in enumerate(pattern)}


def test_decide_on_paired_verdicts_needs_a_gain_that_noise_cannot_explain():
    # 40 problems on one benchmark: the challenger fixes 8 and breaks 2
    champ = "1" * 20 + "0" * 10 + "0" * 8 + "1" * 2
    clear = "1" * 20 + "0" * 10 + "1" * 8 + "0" * 2
    scores = lambda p: {"synthetic": p.count("1") / len(p)}  # noqa: E731
    d = decide(scores(champ), scores(clear), 0.0, 0.5, ({"synthetic": _verdicts(champ)},
                                                        {"synthetic": _verdicts(clear)}))
    assert d.paired is not None and d.paired.difference == pytest.approx(0.15) and d.paired.problems == 40
    # 8 fixed against 2 broken: McNemar's one-sided p is 0.055 -- the bare margin would promote, the paired rule not
    assert not d.promote and "not above the margin" in d.reason and "< margin 0.0000" in d.reason
    assert decide(scores(champ), scores(clear), 0.0, 0.5).promote
    clearer = "1" * 20 + "0" * 10 + "1" * 8 + "1" * 2  # 8 fixed, none broken
    d = decide(scores(champ), scores(clearer), 0.0, 0.5, ({"synthetic": _verdicts(champ)},
                                                          {"synthetic": _verdicts(clearer)}))
    assert d.promote and d.paired.low > 0 and "interval" in d.reason
    assert "Paired gain on 40 problems: +0.2000" in d.markdown("t", "v1", "v2")
    # the regression guard still comes first, and a missing side's verdicts are an error, not a silent pass
    assert not decide({"a": 0.5, "b": 0.5}, {"a": 0.9, "b": 0.4}, 0.0, 0.05,
                      ({"a": _verdicts("10"), "b": _verdicts("1")}, {"a": _verdicts("11"), "b": _verdicts("0")})
                      ).promote
    with pytest.raises(ValueError, match="benchmark 'synthetic' for the challenger"):
        decide(scores(champ), scores(clear), 0.0, 0.5, ({"synthetic": _verdicts(champ)}, {}))
    # no problem judged for both (e.g. unknown ground truths): the point rule decides
    d = decide(scores(champ), scores(clear), 0.0, 0.5, ({"synthetic": {}}, {"synthetic": {}}))
    assert d.paired is None and d.promote and ">= margin" in d.reason


def test_out_of_distribution_guard_rejects_a_challenger_significantly_worse_there():
    # in distribution the challenger clearly wins (fixes 10 of 40); out of distribution it breaks 12 of 30
    champ, clear = "1" * 20 + "0" * 20, "1" * 30 + "0" * 10
    ood_champ, ood_worse, ood_same = "1" * 15 + "0" * 15, "1" * 3 + "0" * 27, "0" * 3 + "1" * 12 + "1" * 3 + "0" * 12

    def rate(p):
        return p.count("1") / len(p)

    def run(ood_challenger, rule="not_worse", paired=True):
        champ_s = {"synthetic": rate(champ), "synthetic_ood": rate(ood_champ)}
        chall_s = {"synthetic": rate(clear), "synthetic_ood": rate(ood_challenger)}
        verdicts = ({"synthetic": _verdicts(champ), "synthetic_ood": _verdicts(ood_champ)},
                    {"synthetic": _verdicts(clear), "synthetic_ood": _verdicts(ood_challenger)}) if paired else None
        return decide(champ_s, chall_s, 0.0, 0.5, verdicts, ood=rule)

    d = run(ood_worse)
    assert not d.promote and "significantly worse out of distribution" in d.reason and d.ood.high < 0
    # the OOD split is a guard, not part of the mean
    assert d.challenger_mean == pytest.approx(rate(clear)) and "synthetic_ood (guard)" in d.markdown("t", "v1", "v2")
    assert "Out of distribution (synthetic_ood, 30 problems): -0.4000" in d.markdown("t", "v1", "v2")
    assert run(ood_same).promote  # a shuffle of which problems pass, not a drop: promoted
    assert run(ood_worse, rule="ignore").promote  # configurable
    d = run(ood_worse, paired=False)  # bare scores: a drop beyond the tolerance (0.5)? 0.4 is not
    assert d.promote
    d = decide({"synthetic": 0.5, "synthetic_ood": 0.9}, {"synthetic": 0.6, "synthetic_ood": 0.2}, 0.0, 0.5)
    assert not d.promote and "synthetic_ood dropped by 0.7000" in d.reason
    assert not decide({"synthetic_ood": 0.5}, {"synthetic_ood": 0.9}, 0.0, 0.5).promote  # OOD alone decides nothing
    with pytest.raises(ValueError, match="unknown out-of-distribution rule"):
        decide({"a": 0.5}, {"a": 0.6}, 0.0, 0.5, ood="maybe")
