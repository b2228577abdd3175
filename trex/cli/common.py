"""What every ``trex`` sub-command module shares: the typer app, the error console, config loading.

Sub-command modules (``trex/cli/*.py``) import from here, never from ``trex.cli.main``. They import flows,
torch, ``trainer`` and ``eval`` inside their commands (start-up time: ``trex config`` or ``trex --help`` should
not pay seconds for Prefect or torch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional


def busy_cores(interval_s: float = 0.1) -> float | None:
    """How many cores other processes kept busy over ``interval_s`` (psutil; this process sleeps meanwhile);
    None where the system does not tell."""
    import psutil

    try:
        return psutil.cpu_percent(interval=interval_s) / 100 * (psutil.cpu_count() or 1)
    except (OSError, RuntimeError, NotImplementedError):
        return None


def default_omp_wait_policy(busy: float | None) -> str | None:
    """The OpenMP wait policy when the user set none: PASSIVE (waiting threads sleep) when other processes
    use the cores -- spinning waiters then made torch 2-100x slower here (two tiny-model trainings side by
    side: 2.5 s per step spinning vs 1.15 s) -- else None, libgomp's default (spin briefly, then sleep),
    which on an idle machine trains the tiny model ~17 % faster than PASSIVE (0.63 vs 0.76 s per step)."""
    return "PASSIVE" if busy is None or busy >= 0.5 else None


# Decided once, before torch is imported (libgomp reads it when it loads); `trex bench` runs its benchmark
# scripts with ACTIVE unless the user chose a policy.
USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")  # None unless the user chose one
if USER_OMP_WAIT_POLICY is None and (_policy := default_omp_wait_policy(busy_cores())) is not None:
    os.environ["OMP_WAIT_POLICY"] = _policy

import typer  # noqa: E402
from rich.console import Console  # noqa: E402

from trex.core.config import ConfigError, TrexConfig, load_config  # noqa: E402
from trex.core.refs import MissingInputError, ref_of  # noqa: E402
from trex.tracking.ui import detect  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, help="T-Rex: post-train MoE LLMs into OR experts.")
# soft_wrap: an error message is never broken into lines at the console width (a path in it stays one string to
# copy, and a long temporary path does not split the words a script or a test looks for)
err = Console(stderr=True, soft_wrap=True)

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


def check_inputs(**dirs: tuple[str | None, str]) -> None:
    """Exit 2 naming the path when an input directory given on the command line (``name=(path, kind)``; a None
    path is not given) is missing or not a stage output of its kind: before any flow, Prefect server or torch
    starts (the flows check again, for deployment runs)."""
    try:
        for path, kind in dirs.values():
            if path is not None:
                ref_of(path, kind)
    except MissingInputError as e:
        err.print(f"[red]error:[/] {e}", highlight=False)
        raise typer.Exit(2)


def run(fn, sandbox: tuple[str, ...] = (), **kwargs):
    """Call a flow or library entry point; configuration errors and missing inputs exit with code 2. A flow
    with no Prefect server to report to starts Prefect's ephemeral one on ``$PREFECT_HOME/prefect.db``: a new
    database there is a copy of a migrated empty one (``trex.tracking.store``), not migrated from scratch; the
    first one a machine migrates becomes that template. ``sandbox`` (``"data"``, ``"eval"``): the parts of
    ``kwargs["cfg"]`` that run untrusted programs; their sandbox is checked first, before Prefect starts, and
    exits 2 with the cause and the fix when it cannot run (the flow checks again for deployment runs)."""
    from eval.sandbox import SandboxUnavailable, require_sandbox  # (light: no solver, no torch)

    try:
        if sandbox:
            require_sandbox(kwargs["cfg"], data="data" in sandbox, evaluate="eval" in sandbox)
    except SandboxUnavailable as e:
        err.print(f"[red]sandbox unavailable:[/] {e}", highlight=False)
        raise typer.Exit(2)
    prefect = sys.modules.get("prefect")  # (a flow has imported it; other entry points do not pay for it)
    home = os.environ.get("PREFECT_HOME")
    ephemeral = prefect is not None and isinstance(fn, prefect.Flow) and "PREFECT_API_URL" not in os.environ and home
    if ephemeral:
        from trex.tracking.store import keep_prefect_template, seed_prefect_db

        seed_prefect_db(home)
    try:
        return fn(**kwargs)
    except (ConfigError, MissingInputError) as e:
        err.print(f"[red]error:[/] {e}", highlight=False)
        raise typer.Exit(2)
    finally:
        if ephemeral:
            keep_prefect_template(home)
