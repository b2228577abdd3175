"""What every ``trex`` sub-command module shares: the typer app, the error console, config loading.

Sub-command modules (``trex/cli/*.py``) import from here, never from ``trex.cli.main``. They import flows,
torch, ``trainer`` and ``eval`` inside their commands (start-up time: ``trex config`` or ``trex --help`` should
not pay seconds for Prefect or torch).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

# OpenMP threads that spin while waiting make torch ~2-100x slower whenever another process shares the cores
# (measured here); sleeping waiters cost little when the machine is idle. Set before torch is imported.
USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")  # None unless the user chose one (trex bench uses it)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer  # noqa: E402
from rich.console import Console  # noqa: E402

from trex.core.config import ConfigError, TrexConfig, load_config  # noqa: E402
from trex.core.refs import MissingInputError  # noqa: E402
from trex.tracking.ui import detect  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, help="T-Rex: post-train MoE LLMs into OR experts.")
err = Console(stderr=True)

ConfigOpt = Annotated[Optional[str], typer.Option("--config", "-c", help="YAML config (default: built-in tiny defaults)")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="override: section.key=value (repeatable)")]


def load(config: str | None, overrides: list[str] | None) -> TrexConfig:
    """Parse the configuration once, at the edge (exit 2 with the key on error), and point the process at
    the run's state directory (and torch.compile's cache inside it) and, while `make ui` is up, at its Prefect
    server."""
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        err.print(f"[red]config error:[/] {e}", markup=True, highlight=False)
        raise typer.Exit(2)
    os.environ["TREX_STATE_DIR"] = str(Path(cfg.run.state_dir).resolve())
    # torch.compile's caches (train.<stage>.compile) live with the run's state: `make clean` empties them too
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cfg.run.state_dir).resolve() / "inductor"))
    ui = detect(cfg.run.state_dir)  # `make ui` is up: flow runs report to its Prefect server
    if ui is not None and "PREFECT_API_URL" not in os.environ:
        os.environ["PREFECT_API_URL"] = ui["prefect_api"]
    return cfg


def run(fn, **kwargs):
    """Call a flow or library entry point; configuration errors and missing inputs exit with code 2."""
    try:
        return fn(**kwargs)
    except (ConfigError, MissingInputError) as e:
        err.print(f"[red]error:[/] {e}", highlight=False)
        raise typer.Exit(2)
