"""The MLflow model registry as T-Rex uses it: versions carry their lineage, an alias marks the champion.

Every registered version is tagged with what retraining needs to continue from it and to judge it:
``trex.model_dir`` / ``trex.model_hash`` (the SFT stage directory with its export), ``trex.data_dir`` /
``trex.data_hash`` (the curated data it was trained on), ``trex.tokenizer_dir`` and ``trex.scores`` (JSON
``{benchmark: pass@1}``). The alias (``retrain.alias``, default ``champion``) points at the version in service.
"""

from __future__ import annotations

import json

from trex.tracking.runs import client


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


def set_alias(tracking: dict, name: str, alias: str, version: str) -> None:
    client(tracking["uri"]).set_registered_model_alias(name, alias, str(version))


def tag_version(tracking: dict, name: str, version: str, tags: dict) -> None:
    c = client(tracking["uri"])
    for k, v in tags.items():
        c.set_model_version_tag(name, str(version), k, str(v))


def lineage_tags(model_ref: dict, data_ref: dict | None, tok_ref: dict | None, scores: dict | None) -> dict:
    tags = {"trex.model_dir": model_ref["path"], "trex.model_hash": model_ref["hash"]}
    if data_ref:
        tags |= {"trex.data_dir": data_ref["path"], "trex.data_hash": data_ref["hash"]}
    if tok_ref:
        tags["trex.tokenizer_dir"] = tok_ref["path"]
    if scores is not None:
        tags["trex.scores"] = json.dumps(scores, sort_keys=True)
    return tags
