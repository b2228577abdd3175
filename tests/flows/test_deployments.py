"""prefect.yaml: the deployments exist, and every entrypoint imports to a Prefect flow."""

import importlib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_prefect_yaml_entrypoints_import():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert {"lifecycle", "curate", "evaluate", "retrain", "rl"} <= set(deps)
    assert "rl" in deps["lifecycle"]["parameters"]  # the RL stage on or off per run
    from prefect import Flow

    for d in deps.values():
        path, fn = d["entrypoint"].split(":")
        module = importlib.import_module(path[:-3].replace("/", "."))
        assert isinstance(getattr(module, fn), Flow), d["entrypoint"]
        assert d["work_pool"]["name"]
    cron = deps["retrain"]["schedules"][0]["cron"]
    assert len(cron.split()) == 5


def test_weekly_seed_changes_by_week():
    import datetime as dt

    from flows.retrain import weekly_seed

    assert weekly_seed(dt.date(2026, 11, 30)) != weekly_seed(dt.date(2026, 12, 7))
    assert weekly_seed(dt.date(2026, 11, 30)) == weekly_seed(dt.date(2026, 12, 1))
