"""Prefect flows of T-Rex. Importing this package points Prefect at the project state dir.

A flow takes its configuration as ``cfg`` (a ``TrexConfig`` the CLI parsed) or as ``config`` + ``overrides``
(the JSON parameters of a deployment run), resolved in one place: ``flows/common.py: resolve_config``.

``PREFECT_HOME`` defaults to ``<TREX_STATE_DIR or .trex>/prefect`` so the ephemeral API database
and cached task results live beside the MLflow store; set it yourself to use another place.
"""

import os
from pathlib import Path

# the CLI sets TREX_STATE_DIR from the parsed config before it imports a flow
_state = Path(os.environ.get("TREX_STATE_DIR") or ".trex").resolve()
os.environ.setdefault("PREFECT_HOME", str(_state / "prefect"))
os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(_state / "prefect" / "storage"))
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect won't create parents
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_ENABLED", "true")
# the first start migrates a fresh database, which takes longer than Prefect's 20 s on 2 cores
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
