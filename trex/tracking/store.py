"""A new SQLite store (MLflow's tracking store, Prefect's API database) starts as a copy of an empty one that
the tool has already migrated.

MLflow builds a new SQLite store by running its schema migrations: 3.1 s on 2 cores, where opening a copy of
the result takes 0.05 s (measured 2026-12-03, mlflow 3). Prefect's server migrates a new database before it
answers: its ephemeral server took 24 s to start in a new state directory and 8 s with a migrated database
(2026-12-04, prefect 3, 2 cores). A state directory pays that once, but the test suite starts dozens of fresh
ones, and so does anyone scripting runs in fresh ones. So the first new store on a machine is built by the tool
as usual and kept (``$XDG_CACHE_HOME/trex/<tool>-<version>-empty.db``, one per tool version); each later new
store is a copy of it, which the tool opens at its schema head.

- MLflow: the template is kept without its ``Default`` experiment, which MLflow creates in each copy as for any
  new database (with the opening process's artifact root).
- Prefect: the first database a server migrated on this machine is kept as the template once a flow has run on
  it, emptied of every row but its migration mark (checked): the file ``prefect server database upgrade``
  makes, and nothing a server wrote (runs, block registrations, any key) is shared.

Whatever goes wrong here, the tool initialises the store itself, as before.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trex"


def template_path() -> Path:
    import mlflow

    return _cache_dir() / f"mlflow-{mlflow.__version__}-empty.db"


def _build_template(path: Path) -> None:
    from mlflow.tracking import MlflowClient

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()  # MLflow migrates the new file
        with sqlite3.connect(tmp) as db:
            db.execute("DELETE FROM experiments WHERE experiment_id = 0")  # recreated by each copy's first open
        os.replace(tmp, path)  # atomic: a concurrent builder's result is as good
    finally:
        tmp.unlink(missing_ok=True)


def prefect_template_path() -> Path:
    return _cache_dir() / f"prefect-{version('prefect')}-empty.db"


def keep_prefect_template(home: str | Path) -> bool:
    """Keep the schema of ``<home>/prefect.db``, which a Prefect server has migrated, as the template of new
    databases, unless there is one: a copy (SQLite's backup API, consistent while the server runs) emptied of
    every row but the migration mark -- the file ``prefect server database upgrade`` makes, without paying for
    the migrations a second time. False where a template exists or none could be made."""
    path, db = prefect_template_path(), Path(home) / "prefect.db"
    if path.is_file() or not db.is_file():
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        src, dst = sqlite3.connect(db), sqlite3.connect(tmp)
        try:
            src.backup(dst)
            tables = [r[0] for r in dst.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
            if dst.execute("SELECT count(*) FROM alembic_version").fetchone()[0] != 1:
                return False  # not a migrated database
            for t in tables:
                if t != "alembic_version":
                    dst.execute(f'DELETE FROM "{t}"')
            dst.commit()
            dst.execute("PRAGMA journal_mode = DELETE")  # one self-contained file; Prefect sets WAL on open
            dst.execute("VACUUM")
            left = {t: n for t in tables if (n := dst.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0])}
        finally:
            src.close()
            dst.close()
        if left != {"alembic_version": 1}:
            return False
        os.replace(tmp, path)  # atomic: a concurrent keeper's result is as good
        return True
    except (OSError, sqlite3.Error):
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _seed(db_path: str | Path, template: Callable[[], Path], build: Callable[[Path], None] | None) -> bool:
    db_path = Path(db_path)
    if db_path.exists():
        return False
    tmp = db_path.with_name(f".{db_path.name}.{os.getpid()}.tmp")
    try:
        path = template()
        if not path.is_file():
            if build is None:
                return False
            build(path)
        db_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, tmp)
        os.link(tmp, db_path)  # creates db_path only where it is still absent
        return True
    except Exception:  # noqa: BLE001 -- any failure leaves the new store to its tool, as without this
        return False
    finally:
        tmp.unlink(missing_ok=True)


def seed_sqlite(db_path: str | Path) -> bool:
    """Create the MLflow store ``db_path`` as a copy of the migrated empty store unless it exists; False where it
    existed or could not be seeded (MLflow then initialises it). Never replaces a store another process has
    started."""
    return _seed(db_path, template_path, _build_template)


def seed_prefect_db(home: str | Path) -> bool:
    """Create ``<home>/prefect.db``, the database a Prefect server started with ``PREFECT_HOME=home`` uses, as a
    copy of the template (:func:`keep_prefect_template`) unless it exists; False where it existed, where there is
    no template yet, where the environment names another database (``PREFECT_API_DATABASE_CONNECTION_URL`` /
    ``PREFECT_SERVER_DATABASE_CONNECTION_URL``) or where it could not be seeded: Prefect then migrates it."""
    if os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL"):
        return False
    return _seed(Path(home) / "prefect.db", prefect_template_path, None)
