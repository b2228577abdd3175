"""Prefect flows of T-Rex. Importing this package points Prefect at the project state dir.

``PREFECT_HOME`` defaults to ``<TREX_STATE_DIR or .trex>/prefect`` so the ephemeral API database
and cached task results live beside the MLflow store; set it yourself to use another place.
"""

import os
import sys
from pathlib import Path


def _state_dir_from_argv() -> str | None:
    """``python -m flows.<name> --config F --set run.state_dir=D``: the state dir that run will use."""
    if not sys.argv or sys.argv[0] != "-m":  # Python sets argv[0] to "-m" while locating the module
        return None
    from trex.config import ConfigError, state_dir_from_args

    try:
        return state_dir_from_args(sys.argv[1:])
    except ConfigError:
        return None  # the CLI reports the error properly


_state = Path(os.environ.get("TREX_STATE_DIR") or _state_dir_from_argv() or ".trex").resolve()
os.environ.setdefault("PREFECT_HOME", str(_state / "prefect"))
os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(_state / "prefect" / "storage"))
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect won't create parents
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_ENABLED", "true")
# the first start migrates a fresh database, which takes longer than Prefect's 20 s on 2 cores
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
