"""``trex ui`` (the local Prefect and MLflow servers) and ``trex tracking flush`` (deliver buffered metrics)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from trex.cli.common import ConfigOpt, SetOpt, load
from trex.tracking import ui
from trex.tracking.runs import flush_buffers


def register(app: typer.Typer) -> None:
    ui_app = typer.Typer(no_args_is_help=True, help="the local Prefect and MLflow UIs (state under run.state_dir)")
    tracking_app = typer.Typer(no_args_is_help=True, help="MLflow tracking maintenance")
    app.add_typer(ui_app, name="ui")
    app.add_typer(tracking_app, name="tracking")

    @ui_app.command("start")
    def ui_start(config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None,
                 prefect_port: int = 4200, mlflow_port: int = 5000,
                 foreground: Annotated[bool, typer.Option(help="stay attached; Ctrl-C stops both")] = False) -> None:
        """Start `prefect server` and `mlflow server` on localhost; trex commands report to them while up."""
        cfg = load(config, set_)
        info = ui.start(cfg.run.state_dir, prefect_port=prefect_port, mlflow_port=mlflow_port)
        typer.echo(f"Prefect UI: {info['prefect_ui']}   MLflow UI: {info['mlflow']}   "
                   f"(state: {Path(cfg.run.state_dir).resolve()}; `trex ui stop` stops both)")
        if foreground:
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                ui.stop(cfg.run.state_dir)

    @ui_app.command("stop")
    def ui_stop(config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
        ui.stop(load(config, set_).run.state_dir)

    @ui_app.command("status")
    def ui_status(config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
        info = ui.detect(load(config, set_).run.state_dir)
        typer.echo(json.dumps(info) if info else "down")
        if info is None:
            raise typer.Exit(1)

    @tracking_app.command("flush")
    def flush(config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
        """Deliver metrics, params, tags and artifacts buffered during an MLflow outage (in order)."""
        cfg = load(config, set_)
        root = Path(cfg.run.state_dir).resolve() / "tracking_buffer"
        if not root.is_dir():
            typer.echo("nothing buffered")
            return
        out = flush_buffers(root)
        typer.echo(json.dumps(out))
        if out["pending"]:
            raise typer.Exit(1)
