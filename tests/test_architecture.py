"""The architecture's import contracts (``.importlinter``, docs/architecture.md) hold, and break when violated.

The planted violations run the same linter on a copy of the source tree with one module added, so the
real tree is never written to and the tests stay order-independent.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trex", "flows", "tasks", "trainer", "kernels", "eval", "ordata")
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([str(LINT), "--no-cache", "--no-logo", str(root / ".importlinter")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / ".importlinter", root / ".importlinter")
    return root


def lint_with(root: Path, where: str, code: str) -> subprocess.CompletedProcess:
    """Lint ``root`` with ``code`` added as module ``where`` (or appended to it), then restore it."""
    path = root / where
    before = path.read_text() if path.exists() else None
    path.write_text((before or "") + code)
    try:
        return lint(root)
    finally:
        if before is None:
            path.unlink()
        else:
            path.write_text(before)


def test_the_tree_keeps_every_contract():
    res = lint(ROOT)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout and "BROKEN" not in res.stdout


PLANTED = {
    # module path in the copy (new, or an existing one the line is appended to): (code, the contract that breaks)
    "eval/_planted.py": ("import ordata.curate\n", "Layers: CLI -> flows -> tasks -> libraries -> trex.core"),
    "trex/core/_planted.py": ("import eval.harness\n", "Layers: CLI -> flows -> tasks -> libraries -> trex.core"),
    "flows/_planted.py": ("from trex.cli import main\n", "Layers: CLI -> flows -> tasks -> libraries -> trex.core"),
    "kernels/_planted.py": ("import trainer.data\n", "kernels/ imports nothing of ours"),
    "trainer/models/deepseek_v4/args.py": ("from trex.core.refs import MANIFEST\n",
                                           "Model arguments beside each model import nothing of the project"),
    "trainer/_planted.py": ("def f():\n    import prefect  # a lazy import counts too\n", "Prefect only in flows/ and tasks/"),
    "eval/_planted_mlflow.py": ("import mlflow\n", "MLflow only in trex.tracking"),
    "trex/cli/plan.py": ("from trex.cli.main import app\n", "CLI sub-command modules share trex.cli.common"),
    "trainer/models/deepseek_v4/_planted.py": ("import trainer.models.deepseek_v4.args\n", None),  # allowed
}


@pytest.mark.parametrize("where", sorted(PLANTED))
def test_a_planted_violation_breaks_its_contract(source_copy, where):
    code, contract = PLANTED[where]
    res = lint_with(source_copy, where, code)
    if contract is None:  # a control: an import the architecture allows keeps every contract
        assert res.returncode == 0, res.stdout[-4000:]
        return
    assert res.returncode != 0, f"{where} ({code.strip()}) broke no contract:\n{res.stdout[-3000:]}"
    broken = res.stdout[res.stdout.index("Broken contracts"):]
    assert contract in broken, broken[:3000]
    assert where[:-3].replace("/", ".") in broken  # the report names the offending module


def test_a_planted_cycle_breaks_the_acyclic_contract(source_copy):
    """eval.harness imports eval.scoring; scoring importing harness back is a cycle inside one layer."""
    res = lint_with(source_copy, "eval/scoring.py", "def _late():\n    from eval.harness import evaluate_items\n")
    assert res.returncode != 0
    assert "No import cycles between sibling packages or modules BROKEN" in res.stdout, res.stdout[-3000:]
    assert "No cycles are allowed in eval" in res.stdout
