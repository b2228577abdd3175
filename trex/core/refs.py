"""References between stages: a directory, its ``manifest.json`` and a content hash.

Stages never pass objects to each other. Each writes a directory, then a manifest describing it
(counts, provenance, config) and the sha256 of every file; the reference handed downstream is
``{"path", "hash", "kind"}``. The hash feeds Prefect's cache keys, so a changed input re-runs
everything after it, and a reference whose directory is gone or altered fails :func:`check_ref`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


class MissingInputError(FileNotFoundError):
    """A stage was given an input reference that does not exist or is incomplete."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dir_files(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` except the manifest, keyed by relative posix path."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST and ".tmp" not in p.parts[-1]:
            out[p.relative_to(root).as_posix()] = file_sha256(p)
    return out


def content_hash(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(root: str | Path, kind: str, info: dict[str, Any]) -> dict[str, str]:
    """Hash ``root``'s files, write its manifest atomically and return the reference."""
    root = Path(root)
    files = dir_files(root)
    manifest = {"kind": kind, "content_hash": content_hash(files), "files": files, **info}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    os.replace(tmp, root / MANIFEST)
    return {"kind": kind, "path": str(root.resolve()), "hash": manifest["content_hash"]}


def read_manifest(path: str | Path, kind: str | None = None) -> dict[str, Any]:
    root = Path(path)
    mf = root / MANIFEST
    if not root.is_dir():
        raise MissingInputError(f"{root}: input directory does not exist")
    if not mf.is_file():
        raise MissingInputError(f"{root}: no {MANIFEST} (incomplete or not a T-Rex {kind or 'stage'} output)")
    manifest = json.loads(mf.read_text())
    if kind is not None and manifest.get("kind") != kind:
        raise MissingInputError(f"{root}: expected a '{kind}' directory, manifest says '{manifest.get('kind')}'")
    return manifest


def ref_of(path: str | Path, kind: str | None = None) -> dict[str, str]:
    """Reference to an existing stage directory (for running a stage alone on given inputs)."""
    m = read_manifest(path, kind)
    return {"kind": m["kind"], "path": str(Path(path).resolve()), "hash": m["content_hash"]}


def check_ref(ref: dict[str, str], deep: bool = False) -> bool:
    """True when the referenced directory exists with the same manifest hash (and, if deep, files)."""
    try:
        m = read_manifest(ref["path"], ref.get("kind"))
    except (MissingInputError, json.JSONDecodeError):
        return False
    if m["content_hash"] != ref["hash"]:
        return False
    return not deep or content_hash(dir_files(Path(ref["path"]))) == ref["hash"]


def fresh_dir(path: str | Path) -> Path:
    """An empty directory at ``path`` (removing a previous incomplete attempt)."""
    p = Path(path)
    if p.exists():
        shutil.rmtree(p)
    p.mkdir(parents=True)
    return p
