"""The MLflow model registry as T-Rex uses it: versions carry their lineage, an alias marks the champion.

Every registered version is tagged with what retraining needs to continue from it and to judge it:
``trex.model_dir`` / ``trex.model_hash`` (the SFT stage directory with its export), ``trex.data_dir`` /
``trex.data_hash`` (the curated data it was trained on), ``trex.tokenizer_dir`` and ``trex.scores`` (JSON
``{benchmark: pass@1}``). The alias (``retrain.alias``, default ``champion``) points at the version in service.

MLflow is imported inside the functions that use it, as in ``runs``: start-up time (it takes seconds to import,
and the CLI imports ``trex.tracking`` for every command).
"""

from __future__ import annotations

import json
from pathlib import Path

from trex.tracking.runs import Tracker, client


def champion(tracking: dict, name: str, alias: str = "champion") -> dict | None:
    """The version behind ``alias`` with its lineage tags, or None (no alias yet, no registry, no store)."""
    from mlflow.exceptions import MlflowException

    if not tracking.get("enabled", True):
        return None
    try:
        mv = client(tracking["uri"]).get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    t = mv.tags
    return {"version": str(mv.version), "run_id": mv.run_id, "model_dir": t.get("trex.model_dir"),
            "model_hash": t.get("trex.model_hash"), "data_dir": t.get("trex.data_dir"),
            "data_hash": t.get("trex.data_hash"), "tokenizer_dir": t.get("trex.tokenizer_dir"),
            "scores": json.loads(t.get("trex.scores", "{}"))}


def register_version(tracking: dict, name: str, run: Tracker, export_dir: str | Path, content_hash: str,
                     tags: dict, description: str) -> tuple[str, str, bool]:
    """The version of registered model ``name`` (created when absent) that holds the model ``content_hash``:
    an existing version with that ``content_hash`` tag (``reused``), else ``export_dir`` logged as artifact
    ``model`` of ``run`` and registered from there with ``tags`` (and ``content_hash``). Returns
    ``(version, source, reused)``."""
    from mlflow.exceptions import MlflowException

    c = client(tracking["uri"])
    try:
        c.create_registered_model(name, description=description)
    except MlflowException:
        pass  # already registered
    for existing in c.search_model_versions(f"name='{name}'"):
        if existing.tags.get("content_hash") == content_hash:
            return str(existing.version), existing.source, True
    run.artifact(export_dir, "model")
    source = f"{c.get_run(run.run_id).info.artifact_uri}/model"
    mv = c.create_model_version(name, source=source, run_id=run.run_id, tags={"content_hash": content_hash, **tags})
    return str(mv.version), source, False


def set_alias(tracking: dict, name: str, alias: str, version: str) -> None:
    client(tracking["uri"]).set_registered_model_alias(name, alias, str(version))


def tag_version(tracking: dict, name: str, version: str, tags: dict) -> None:
    c = client(tracking["uri"])
    for k, v in tags.items():
        c.set_model_version_tag(name, str(version), k, str(v))


def promote(tracking: dict, name: str, alias: str, version: str, reason: str, replaced: str | None = None) -> None:
    """Point ``alias`` at ``version``, tagged with ``trex.champion_reason``. A challenger that replaces the champion
    ``replaced`` is also tagged ``trex.challenger=promoted`` and ``trex.replaced_version``, and the old champion
    ``trex.replaced_by``."""
    set_alias(tracking, name, alias, version)
    tags = {"trex.champion_reason": reason}
    if replaced is not None:
        tags = {"trex.challenger": "promoted", **tags, "trex.replaced_version": replaced}
    tag_version(tracking, name, version, tags)
    if replaced is not None:
        tag_version(tracking, name, replaced, {"trex.replaced_by": version})


def reject(tracking: dict, name: str, version: str, reason: str, compared_with: str) -> None:
    """Tag a challenger that stays a challenger: ``trex.challenger=rejected``, the reason and the champion it lost
    to; the alias does not move."""
    tag_version(tracking, name, version, {"trex.challenger": "rejected", "trex.reject_reason": reason,
                                          "trex.compared_with": compared_with})


def lineage_tags(model_ref: dict, data_ref: dict | None, tok_ref: dict | None, scores: dict | None) -> dict:
    tags = {"trex.model_dir": model_ref["path"], "trex.model_hash": model_ref["hash"]}
    if data_ref:
        tags |= {"trex.data_dir": data_ref["path"], "trex.data_hash": data_ref["hash"]}
    if tok_ref:
        tags["trex.tokenizer_dir"] = tok_ref["path"]
    if scores is not None:
        tags["trex.scores"] = json.dumps(scores, sort_keys=True)
    return tags
