"""A new SQLite store (MLflow's, Prefect's) is a copy of a migrated empty one (trex.tracking.store)."""

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


def _rows(db) -> dict[str, int]:
    with sqlite3.connect(db) as c:
        tables = [r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: c.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}


def _served_db(home) -> sqlite3.Connection:
    """A database as a Prefect server leaves it: migrated (alembic's mark), then written to, in WAL mode."""
    home.mkdir(parents=True)
    c = sqlite3.connect(home / "prefect.db")
    c.execute("PRAGMA journal_mode = WAL")
    c.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)")
    c.execute("CREATE TABLE flow_run (id CHAR(36) PRIMARY KEY, name VARCHAR NOT NULL)")
    c.execute("CREATE TABLE configuration (key VARCHAR PRIMARY KEY, value JSON)")
    c.execute("INSERT INTO alembic_version VALUES ('27d8f4e1a6c9')")
    c.executemany("INSERT INTO flow_run VALUES (?, ?)", [("a", "run-a"), ("b", "run-b")])
    c.execute("INSERT INTO configuration VALUES ('ENCRYPTION_KEY', '\"secret\"')")
    c.commit()
    return c  # left open by the caller, its WAL not checkpointed: the server is still running


def test_a_migrated_prefect_database_becomes_the_empty_template_of_new_ones(tmp_path, monkeypatch):
    from trex.tracking.store import keep_prefect_template, prefect_template_path, seed_prefect_db

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("PREFECT_API_DATABASE_CONNECTION_URL", raising=False)
    monkeypatch.delenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", raising=False)
    assert not seed_prefect_db(tmp_path / "early")  # no template yet: Prefect migrates, as before
    assert not (tmp_path / "early" / "prefect.db").exists()
    server = _served_db(tmp_path / "served")
    assert (tmp_path / "served" / "prefect.db-wal").stat().st_size > 0  # the rows are in the WAL still
    assert keep_prefect_template(tmp_path / "served")
    template = prefect_template_path()
    # the schema and the migration mark; none of the server's rows (runs, keys) travel to other state dirs
    assert _rows(template) == {"alembic_version": 1, "flow_run": 0, "configuration": 0}
    with sqlite3.connect(template) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # one self-contained file
    assert _rows(tmp_path / "served" / "prefect.db")["flow_run"] == 2  # the served database is untouched
    kept = template.stat().st_mtime_ns
    assert not keep_prefect_template(tmp_path / "served") and template.stat().st_mtime_ns == kept  # kept once
    assert seed_prefect_db(tmp_path / "new")
    assert (tmp_path / "new" / "prefect.db").read_bytes() == template.read_bytes()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "prefect.db").write_bytes(b"not replaced")
    assert not seed_prefect_db(tmp_path / "other")
    assert (tmp_path / "other" / "prefect.db").read_bytes() == b"not replaced"
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", "postgresql+asyncpg://db/prefect")
    assert not seed_prefect_db(tmp_path / "elsewhere") and not (tmp_path / "elsewhere").exists()
    server.close()


def test_an_unmigrated_prefect_database_is_not_kept(tmp_path, monkeypatch):
    from trex.tracking.store import keep_prefect_template, prefect_template_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "home").mkdir()
    with sqlite3.connect(tmp_path / "home" / "prefect.db") as c:
        c.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)")
    assert not keep_prefect_template(tmp_path / "home") and not prefect_template_path().exists()
    assert not keep_prefect_template(tmp_path / "nothing-here")
    assert not list((tmp_path / "cache" / "trex").glob("*"))  # no temporary file left behind
