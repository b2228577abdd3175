import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A state dir of this session's own (not the shared ROOT/.trex-test, nor the user's .trex): set before any test
# module imports ``flows``, whose import points PREFECT_HOME under it. Subprocess tests drop every TREX_*
# variable and pass ``run.state_dir`` themselves.
_SESSION_STATE = tempfile.mkdtemp(prefix="trex-test-state-")
os.environ["TREX_STATE_DIR"] = _SESSION_STATE
# in-process commands never report to a `make ui` someone has running (trex.tracking.ui.detect)
os.environ["TREX_NO_UI"] = "1"
# importing ``flows`` sets PREFECT_HOME & co. (setdefault) once per process: do it here, so every test sees the
# same environment whether or not some earlier test module happened to import it
import flows  # noqa: E402,F401

_PREFECT_SERVER = None


# the longest modules, longest first (seconds per module in `make test` on 2 AVX2 cores, 2026-12-03: a cold
# inductor compile, whole lifecycles, multi-process jobs). `make test` hands modules to its two pytest-xdist
# workers in this order (--no-loadscope-reorder; xdist would otherwise order them by their number of tests), the
# longest-first rule, so that neither worker starts a long module last while the other idles
_LONG_MODULES = (
    "tests/trainer/test_compile.py",            # ~450 with a cold inductor cache, ~75 warm (AVX-512: ~245 cold,
                                                # 82 of it the compiled bf16 test; warm +24)
    "tests/flows/test_operations_e2e.py",       # 275
    "tests/flows/test_lifecycle_e2e.py",        # 250 (with the retrain test, on a copy of its lifecycle)
    "tests/trainer/test_deepspeed_engine.py",   # 170
    "tests/trainer/parallel/test_equivalence.py",  # 170
    "tests/ordata/test_curate.py",              # 140
    "tests/flows/test_lifecycle_hub.py",        # 130
    "tests/ordata/test_families.py",            # 120
    "tests/trainer/test_chaos.py",              # 100
    "tests/trainer/test_train_resume.py",       # 85
    "tests/trainer/test_safety.py",             # 80
    "tests/trex/tracking/test_tracking_outage.py",  # 80
    "tests/flows/test_crash_recovery.py",       # 80
    "tests/trainer/hub/test_parallel_init.py",  # 65
    "tests/trex/test_cli_train.py",             # 60
    "tests/trainer/parallel/test_reshard_fault.py",  # 60
    "tests/bench/test_model_bench.py",          # 50
    "tests/kernels/test_training_backends.py",  # 50
    "tests/flows/test_curate_llm.py",           # 45
)


def pytest_collection_modifyitems(session, config, items):
    """Longest modules first (stable otherwise); start the session's shared Prefect server
    (tests/prefect_server.py) when flow tests were collected."""
    global _PREFECT_SERVER
    from tests import prefect_server

    rank = {m: i for i, m in enumerate(_LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))

    if _PREFECT_SERVER is None and os.environ.get("TREX_TEST_SHARED_PREFECT", "1") != "0" and any(
            item.nodeid.startswith("tests/flows/") for item in items):
        _PREFECT_SERVER, os.environ[prefect_server.API_ENV] = prefect_server.start(Path(_SESSION_STATE) / "prefect-shared")


def pytest_unconfigure(config):
    if _PREFECT_SERVER is not None:
        from tests import prefect_server

        prefect_server.stop(_PREFECT_SERVER)
    shutil.rmtree(_SESSION_STATE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_environ():
    """Every test starts from and leaves the same ``os.environ``: library code run in-process sets variables
    for the rest of the process (``trex.cli`` sets TREX_STATE_DIR and, with a UI up, PREFECT_API_URL;
    importing ``flows`` sets PREFECT_*), which would leak into every later test and subprocess."""
    saved = os.environ.copy()
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
