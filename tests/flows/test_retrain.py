"""Retraining with champion / challenger promotion, through the real CLI on the micro config."""

from __future__ import annotations

import json

import pytest

from tests.flows.test_lifecycle_e2e import trex
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


def _registry(state):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    return c, {int(v.version): v for v in c.search_model_versions("name='trex-or'")}


def _last_json(out: str) -> dict:
    return json.loads([x for x in out.splitlines() if x.startswith("{")][-1])


@pytest.mark.slow
def test_first_lifecycle_is_champion_then_retrain_promotes_or_rejects_with_reason(tmp_path):
    state = tmp_path / "state"
    first = trex(["lifecycle", "--config", "configs/micro.yaml"], state)
    assert first.returncode == 0, first.stderr[-4000:]
    c, versions = _registry(state)
    champ = c.get_model_version_by_alias("trex-or", "champion")
    assert str(champ.version) == "1" and champ.tags["trex.champion_reason"] == "first registered model"
    assert champ.tags["trex.data_hash"] and json.loads(champ.tags["trex.scores"])["synthetic"] >= 0

    # new data (another seed), no margin: promoted iff no benchmark regressed by more than the tolerance
    r = trex(["retrain", "--config", "configs/micro.yaml", "--data-seed", "77", "--set", "retrain.margin=0"], state)
    assert r.returncode == 0, r.stderr[-4000:]
    res = _last_json(r.stdout)
    assert res["decision"] in ("promoted", "rejected") and res["challenger_version"] == "2"
    c, versions = _registry(state)
    alias_now = str(c.get_model_version_by_alias("trex-or", "champion").version)
    if res["decision"] == "promoted":
        assert alias_now == "2" and versions[2].tags["trex.challenger"] == "promoted"
        assert versions[1].tags["trex.replaced_by"] == "2"
    else:
        assert alias_now == "1" and versions[2].tags["trex.reject_reason"] == res["reason"]
    exp = c.get_experiment_by_name("trex")
    cmp_runs = c.search_runs([exp.experiment_id], "tags.`mlflow.runName` = 'champion-vs-challenger'")
    assert len(cmp_runs) == 1 and "champion_pass_at_1_synthetic" in cmp_runs[0].data.metrics

    # an impossible margin: rejected, with the reason on the version; the alias does not move
    before = str(c.get_model_version_by_alias("trex-or", "champion").version)
    r = trex(["retrain", "--config", "configs/micro.yaml", "--data-seed", "78", "--set", "retrain.margin=1.0"], state)
    assert r.returncode == 0, r.stderr[-4000:]
    res = _last_json(r.stdout)
    assert res["decision"] == "rejected" and "< margin 1.0000" in res["reason"]
    c, versions = _registry(state)
    assert str(c.get_model_version_by_alias("trex-or", "champion").version) == before
    assert versions[3].tags["trex.challenger"] == "rejected" and "margin" in versions[3].tags["trex.reject_reason"]

    # the champion's own data again: nothing to retrain
    data_dir = c.get_model_version_by_alias("trex-or", "champion").tags["trex.data_dir"]
    r = trex(["retrain", "--config", "configs/micro.yaml", "--data-dir", data_dir], state)
    assert r.returncode == 0, r.stderr[-4000:]
    assert _last_json(r.stdout)["decision"] == "unchanged-data"
