"""Checkpoint tasks: bring an outside checkpoint into the lifecycle, and hand a trained model back in the
published layout.

- ``import_task``: ``model.init_from`` (the published hub layout, transformers' or a T-Rex export) is
  checked against its own ``config.json`` (every tensor's name, dtype and shape; no weights are read) and
  becomes a ``model`` reference whose ``export`` links to it, so CPT (or SFT) starts from it like from any
  stage. Its key is the checkpoint's fingerprint: the files' bytes up to 2 GiB in all, beyond that their
  names, sizes, modification times and safetensors headers (hashing 160 GB on every run would take longer
  than the run).
- ``export_task``: a trained model's export converted (``trex convert``) to ``hub-fp8`` / ``hub-bf16``; with
  the init checkpoint given as ``like``, its ``config.json`` is kept as published, its quantisation scheme is
  re-applied, and tensors training left unchanged keep its bytes.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from prefect import task
from prefect.cache_policies import CacheKeyFnPolicy

from tasks.common import TASK_OPTIONS, StageContext, stage_dir, stage_result
from trainer.hub.convert import convert
from trainer.hub.reader import CheckpointReader, check_args, read_header
from trainer.models.deepseek_v4.args import ModelArgs
from trex.core.refs import fresh_dir, read_manifest, write_manifest
from trex.tracking.runs import start_run

FULL_HASH_LIMIT = 2 << 30


def fingerprint(root: Path) -> tuple[str, str]:
    """(sha256 hex, "content" or "metadata") of a checkpoint directory's files (see the module docstring)."""
    files = sorted(f for f in root.iterdir() if f.is_file())
    full = sum(f.stat().st_size for f in files) <= FULL_HASH_LIMIT
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        st = f.stat()
        if full:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        else:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
            if f.suffix == ".safetensors":
                h.update(json.dumps(read_header(f), sort_keys=True).encode())
            elif st.st_size < (16 << 20):
                h.update(f.read_bytes())
    return h.hexdigest(), "content" if full else "metadata"


def _checkpoint_key(_context, parameters: dict) -> str:
    """The import's cache key includes the checkpoint's fingerprint: a changed checkpoint at the same path is
    imported again."""
    return fingerprint(Path(parameters["path"]).resolve())[0]


@task(name="import", **{**TASK_OPTIONS,
                        "cache_policy": TASK_OPTIONS["cache_policy"] + CacheKeyFnPolicy(cache_key_fn=_checkpoint_key)})
def import_task(path: str, ctx: StageContext, model: ModelArgs | None = None) -> dict:
    """``model``: the run's ``model`` keys, checked against the checkpoint's ``config.json`` here, before any
    training (a contradiction is an error naming both values)."""
    t0 = time.perf_counter()
    root = Path(path).resolve()
    with CheckpointReader(root) as reader:  # validates the whole tensor set from the headers
        if model is not None:
            check_args(reader, model)
        info = {"format": reader.format, "scheme": reader.scheme.name if reader.scheme else None,
                "vocab_size": reader.vocab_size, "model": reader.args.model_dump(mode="json"),
                "tensors": len(reader.headers), "shards": len(set(reader.files.values()))}
    digest, kind = fingerprint(root)
    out = fresh_dir(stage_dir(ctx, "import", digest[:12]))
    (out / "export").symlink_to(root, target_is_directory=True)  # not followed by the manifest's hashing
    (out / "fingerprint.json").write_text(json.dumps({"source": str(root), "sha256": digest, "of": kind}))  # is
    run = start_run(ctx.tracking, "import", ctx.parent_run_id, {"stage": "import"})
    run.params({"init_from": str(root), "format": info["format"], "scheme": info["scheme"] or "none",
                "fingerprint": kind})
    ref = write_manifest(out, "model", {"stage": "import", "source": str(root), "fingerprint": digest,
                                        "fingerprint_kind": kind, "summary": info})
    run.metrics({"tensors": info["tensors"], "shards": info["shards"]})
    run.finish()
    return stage_result(ref, info, t0, run.run_id)


@task(name="export", **TASK_OPTIONS)
def export_task(model_ref: dict, fmt: str, scheme: str | None, like: str | None, ctx: StageContext) -> dict:
    """``model_ref``'s export as ``fmt`` in a ``model`` reference of its own (its manifest: the source's)."""
    t0 = time.perf_counter()
    source = read_manifest(model_ref["path"], "model")
    out = fresh_dir(stage_dir(ctx, f"export-{fmt}", f"{model_ref['hash'][:12]}-{scheme or 'own'}"))
    run = start_run(ctx.tracking, f"export-{fmt}", ctx.parent_run_id, {"stage": "export"})
    like_config, reference = None, None
    if like:
        reference = CheckpointReader(like)
        if reference.format == "hub":
            like_config = reference.config
            scheme = scheme or (reference.scheme.name if reference.scheme.scale_dtype is not None else None)
        else:
            reference.close()
            reference = None
    try:
        # the provenance names the model by its content hash: an absolute path would make this export's own
        # content hash (the registered version's key) depend on where the output directory is
        summary = convert(Path(model_ref["path"]) / "export", out / "export", fmt, scheme, source_config=like_config,
                          reference=reference, source_name=f"model:{model_ref['hash']}")
    finally:
        if reference is not None:
            reference.close()
    run.params({"format": fmt, "scheme": summary["scheme"] or "none", "like": like or ""})
    run.metrics({"tensors": summary["tensors"], "shards": summary["shards"]})
    ref = write_manifest(out, "model", {"stage": source.get("stage", "sft"), "format": fmt, "summary": {
        **source.get("summary", {}), "export": summary}, "inputs": {"model": model_ref}})
    run.finish()
    return stage_result(ref, summary, t0, run.run_id)
