"""``trex serve``: an OpenAI-compatible HTTP server for a model directory (see :mod:`eval.serve`)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from trex.cli.common import err


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to ``app``."""

    @app.command()
    def serve(
        model: Annotated[str, typer.Option(help="model directory (an export, or a stage output holding export/)")],
        backend: Annotated[str, typer.Option(help="native | hf")] = "native",
        host: str = "127.0.0.1",
        port: int = 8000,
        served_model_name: Annotated[Optional[str], typer.Option(help="model id (default: the directory name)")] = None,
        max_batch: Annotated[int, typer.Option(help="rows decoded together: native, continuous batching (requests "
                                                    "join between decode steps, each with its own sampling); hf, "
                                                    "queued requests with equal sampling parameters")] = 8,
        batch_size: Annotated[Optional[int], typer.Option(help="the backend's own batch size (hf; native serving "
                                                               "batches up to --max-batch)")] = None,
        device: Annotated[Optional[str], typer.Option(help="hf backend: cpu, cuda, ... (default: cuda if any)")] = None,
        default_max_tokens: Annotated[int, typer.Option(help="when a request gives no max_tokens")] = 512,
        api_key: Annotated[Optional[str], typer.Option(envvar="TREX_SERVE_API_KEY",
                                                       help="require this bearer token on /v1/*")] = None,
        log_level: str = "info",
    ) -> None:
        """Serve a model over POST /v1/chat/completions (n choices, stream=True as server-sent events),
        GET /v1/models and GET /health (OpenAI-compatible); the native backend with continuous batching."""
        from eval.backends import BackendUnavailableError
        from eval.serve import SERVE_KINDS
        from eval.serve import serve as run_server

        if backend not in SERVE_KINDS:
            err.print(f"[red]error:[/] --backend must be one of {', '.join(SERVE_KINDS)}, not {backend!r}",
                      highlight=False)
            raise typer.Exit(2)
        opts: dict = {}
        if batch_size is not None:
            opts["batch_size"] = batch_size
        if device is not None:
            if backend != "hf":
                err.print("[red]error:[/] --device applies to the hf backend only (native runs on the CPU)",
                          highlight=False)
                raise typer.Exit(2)
            opts["device"] = device
        try:
            run_server(model, backend=backend, host=host, port=port, served_model_name=served_model_name,
                       max_batch=max_batch, api_key=api_key, default_max_tokens=default_max_tokens,
                       log_level=log_level, **opts)
        except (FileNotFoundError, ValueError, BackendUnavailableError) as e:
            err.print(f"[red]error:[/] {e}", highlight=False)
            raise typer.Exit(2)
