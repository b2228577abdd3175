"""A new SQLite tracking store is a copy of a migrated empty one (trex.tracking.store)."""

from __future__ import annotations

import sqlite3

from trex.tracking.store import seed_sqlite, template_path


def _experiments(db) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT experiment_id, name, artifact_location FROM experiments").fetchall()


def test_a_new_store_is_a_copy_that_mlflow_opens_without_migrating(tmp_path, monkeypatch):
    import mlflow.store.db.utils
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    assert seed_sqlite(first)
    template = template_path()
    assert template.is_file() and template.parent == tmp_path / "cache" / "trex"
    assert _experiments(template) == []  # without its Default experiment
    built = template.stat().st_mtime_ns
    assert seed_sqlite(second) and template.stat().st_mtime_ns == built  # built once, then copied
    monkeypatch.chdir(tmp_path / "b")

    def no_migrations(_engine):
        raise AssertionError("MLflow migrated a seeded store")

    monkeypatch.setattr(mlflow.store.db.utils, "_initialize_tables", no_migrations)  # the copy is at the head
    c = MlflowClient(tracking_uri=f"sqlite:///{second}")
    exp = c.get_experiment(c.create_experiment("x"))
    c.log_metric(c.create_run(exp.experiment_id).info.run_id, "m", 1.0)
    default = [e for e in _experiments(second) if e[0] == 0]
    assert default and default[0][2] == str(tmp_path / "b" / "mlruns" / "0")  # made by MLflow, for this process
    assert {e[1] for e in _experiments(second)} == {"Default", "x"} and _experiments(first) == []


def test_an_existing_store_is_never_replaced_and_a_failure_leaves_it_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not replaced")
    assert not seed_sqlite(db) and db.read_bytes() == b"not replaced"
    (tmp_path / "cache").write_text("a file where the cache directory would be")  # the template cannot be built
    fresh = tmp_path / "fresh" / "mlflow.db"
    assert not seed_sqlite(fresh) and not fresh.exists()
    assert not list((tmp_path / "fresh").glob("*"))  # no temporary file left behind
