"""Plots as MLflow artifacts (``plots/*.png`` on the stage run) and as Prefect artifacts."""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import quote

from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.context import get_run_context

from trex.tracking.runs import Tracker

log = logging.getLogger(__name__)


def plot_dir(ctx, stage_out: Path) -> Path:
    """Plots live beside the stage outputs, not in them: a stage directory's content hash (its cache key
    downstream) must not depend on a picture of how it was trained."""
    return Path(ctx.output_dir) / "plots" / Path(stage_out).name


def publish_plot(run: Tracker, png: Path, key: str, description: str) -> None:
    """Log ``png`` under ``plots/`` of the run; in Prefect, an image artifact served by the MLflow server
    (when tracking goes to one), else a markdown artifact naming the file."""
    run.artifact(png, "plots")
    try:
        get_run_context()  # outside a flow/task run there is nothing to attach to
    except Exception:  # noqa: BLE001
        return
    try:
        if run.active and not run.offline and run.uri.startswith("http"):
            url = f"{run.uri}/get-artifact?path={quote('plots/' + png.name)}&run_uuid={run.run_id}"
            create_image_artifact(url, key=key, description=description)
        else:
            create_markdown_artifact(f"**{description}**\n\n`{png}` (MLflow run `{run.run_id}`, artifact "
                                     f"`plots/{png.name}`)", key=key, description=description)
    except Exception as e:  # noqa: BLE001 -- an artifact is a convenience, never a failure
        log.warning("could not create the Prefect artifact %s: %s", key, e)


def pass_at_1_groups(report: dict) -> dict[str, dict[str, float]]:
    """``per_<group>`` breakdowns of an evaluation report as {group: {key: pass@1 (rel rule)}}."""
    out = {}
    for k, v in report.items():
        if k.startswith("per_") and isinstance(v, dict) and not k.endswith("pass@1"):
            vals = {name: r["pass@1_rel"] for name, r in v.items() if isinstance(r, dict) and "pass@1_rel" in r}
            if vals:
                out[k[4:]] = vals
    return out
