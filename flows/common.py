"""Flow plumbing: the configuration a flow runs on, the parent MLflow run, stage bookkeeping (cached or not),
the final summary.

**How a configuration reaches a flow.** It is parsed once, at the edge, into a :class:`TrexConfig`:

- the CLI (``trex.cli``) parses ``--config`` / ``--set`` (exit 2 on an error) and calls the flow with
  ``cfg=<TrexConfig>``, and with the ``config`` and ``overrides`` it parsed, which are then only a record of
  where the configuration came from (the flow run's parameters in Prefect; the curate flow's event);
- a deployment run (``prefect.yaml``, an event trigger) can only carry JSON, so it passes ``config`` (a YAML
  path) and ``overrides`` (``section.key=value`` strings) and leaves ``cfg`` unset.

Every flow starts with :func:`resolve_config` -- the one place that turns the second form into the first --
and from there hands typed sections (``cfg.data``, ``cfg.eval``, ...) to its tasks. Where sections become
JSON data (output-directory keys, MLflow params) is ``tasks.common.plain``.

A flow body is a ``with FlowRecorder(cfg, name) as rec:`` block that only sequences tasks through
``rec.stage``; the recorder finishes the parent MLflow run as FAILED when the block raises and as FINISHED
(with ``rec.metrics``) otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Self

from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from rich.table import Table

from tasks.common import StageContext, plain, sandbox_preflight
from tasks.progress import console
from trex.core.config import TrexConfig, load_config
from trex.core.refs import check_ref
from trex.tracking.runs import start_run, tracking_settings


def resolve_config(cfg: TrexConfig | None, config: str | None, overrides: list[str] | None) -> TrexConfig:
    """The flow's configuration: ``cfg`` as parsed by the caller (the CLI), else ``config`` + ``overrides``
    parsed here (a deployment run's JSON parameters). With ``cfg`` given, ``config`` and ``overrides`` are not
    applied again: they are the record of what ``cfg`` was parsed from."""
    return cfg if cfg is not None else load_config(config, overrides or [])


class FlowRecorder:
    """Runs stage tasks for one flow run and records them in MLflow and in the summary.

    A context manager: ``with FlowRecorder(cfg, "lifecycle") as rec: rec.stage(...)``. Leaving the block
    finishes the parent run -- FAILED (no metrics, no Prefect artifact) when it raised, else FINISHED with
    ``rec.metrics`` (the flow's headline numbers, filled in by the block) -- and prints the summary."""

    def __init__(self, cfg: TrexConfig, flow_name: str, sandbox: tuple[str, ...] = ()):
        """``sandbox``: what of ``data`` / ``eval`` runs untrusted programs in this flow: checked before anything
        starts (:func:`tasks.common.sandbox_preflight`) and recorded on the parent run."""
        self.cfg, self.flow_name = cfg, flow_name
        self.t0 = time.perf_counter()
        sandbox_tags = sandbox_preflight(cfg, data="data" in sandbox, evaluate="eval" in sandbox)
        tracking = tracking_settings(cfg.tracking, cfg.run.state_dir)
        fr = flow_run.id
        data = plain(cfg)
        key = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
        self.parent = start_run(tracking, f"{flow_name}-{cfg.run.name}", None,
                                {"prefect.flow_run_id": fr, "flow": flow_name, "config": cfg.source or "<defaults>"},
                                resume_key=f"flow:{flow_name}:{key}")
        self.parent.tags({"prefect.flow_run_id": fr, **sandbox_tags})
        self.parent.params(data)
        self.ctx = StageContext(str(cfg.run.output_dir.resolve()), tracking, self.parent.run_id, fr)
        self.rows: list[dict[str, Any]] = []
        self.results: dict[str, dict] = {}
        self.metrics: dict[str, float] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.finish(self.metrics)
        else:
            self.finish(failed=True)
        return False  # an exception propagates

    def stage(self, name: str, task, **inputs) -> dict:
        state = task(**inputs, ctx=self.ctx, return_state=True)
        result = state.result()
        cached = state.name == "Cached"
        if cached and not check_ref(result["ref"]):
            console.print(f"[yellow]{name}: cached output {result['ref']['path']} is missing or changed; re-running[/]")
            state = task.with_options(refresh_cache=True)(**inputs, ctx=self.ctx, return_state=True)
            result, cached = state.result(), False
        if cached:
            run = start_run(self.ctx.tracking, f"{name} (cached)", self.parent.run_id,
                            {"stage": name, "cached": True, "source_run_id": result.get("mlflow_run_id")})
            run.metrics({k: v for k, v in result["summary"].items() if isinstance(v, (int, float))})
            run.tags({"output_dir": result["ref"]["path"], "content_hash": result["ref"]["hash"]})
            run.finish()
        self.results[name] = result
        self.rows.append({"stage": name, "seconds": 0.0 if cached else result["seconds"], "cached": cached,
                          "metric": _headline(result["summary"]), "path": result["ref"]["path"]})
        return result

    def finish(self, metrics: dict[str, float] | None = None, failed: bool = False) -> str:
        if metrics:
            self.parent.metrics(metrics)
        self.parent.metrics({"wall_seconds": time.perf_counter() - self.t0})
        self.parent.finish("FAILED" if failed else "FINISHED")
        md = self.markdown(metrics or {})
        if not failed:
            try:
                create_markdown_artifact(md, key=f"trex-{self.flow_name}-summary", description="T-Rex stage summary")
            except Exception as e:  # the artifact is a convenience; never fail a finished run for it
                console.print(f"[yellow]could not create the Prefect artifact: {e}[/]")
        self.print_summary(metrics or {})
        return md

    def markdown(self, metrics: dict) -> str:
        lines = [f"# T-Rex {self.flow_name} — {self.cfg.run.name}", "",
                 f"MLflow run `{self.parent.run_id}` in `{self.ctx.tracking['uri']}`", "",
                 "| stage | time (s) | key metric | cached | output |", "|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r['stage']} | {r['seconds']:.1f} | {r['metric']} | {r['cached']} | `{r['path']}` |")
        if metrics:
            lines += ["", "| metric | value |", "|---|---|"] + [f"| {k} | {v:.4g} |" for k, v in metrics.items()]
        return "\n".join(lines)

    def print_summary(self, metrics: dict) -> None:
        table = Table(title=f"T-Rex {self.flow_name} ({self.cfg.run.name})")
        for col in ("stage", "time (s)", "key metric", "cached"):
            table.add_column(col)
        for r in self.rows:
            table.add_row(r["stage"], f"{r['seconds']:.1f}", r["metric"], "yes" if r["cached"] else "")
        console.print(table)
        for k, v in metrics.items():
            console.print(f"  [bold]{k}[/]: {v:.4f}")
        console.print(f"Outputs: {self.cfg.run.output_dir.resolve()}")
        console.print(f"MLflow run {self.parent.run_id}: mlflow ui --backend-store-uri {self.ctx.tracking['uri']} "
                      f"(or `make ui`)")
        console.print(f"Prefect runs: PREFECT_HOME={os.environ.get('PREFECT_HOME')} prefect server start (or `make ui`)")


def _headline(summary: dict) -> str:
    for key in ("pass@1", "val_loss", "final_loss", "final_reward", "vocab_size", "sft", "kept", "version"):
        if key in summary and summary[key] is not None:
            v = summary[key]
            return f"{key}={v:.4f}" if isinstance(v, float) else f"{key}={v}"
    return ""
