"""Registry of OR-modelling benchmarks and their loaders.

``load_benchmark(name, path=None, limit=None)`` returns a :class:`LoadedBenchmark`: the normalised
:class:`~eval.benchmark_formats.BenchmarkItem` list plus every row that did not become an item, with
the reason (``skipped``), so ``rows == len(items) + len(skipped)`` always holds. ``path`` may be

* ``None``: the benchmark's default file under ``$TREX_BENCHMARKS_DIR`` (the shared benchmark copy,
  see its README.md for provenance and quirks);
* a file (``.jsonl``/``.json``/``.parquet``) or a directory (problem directories, a saved dataset, or a
  directory holding the spec's default file name), absolute, relative to the working directory or
  relative to ``$TREX_BENCHMARKS_DIR``;
* otherwise a Hugging Face hub dataset name, read with ``datasets.load_dataset(name, split=...)``
  (needs network access).

Ground-truth conventions per benchmark (sentinels, empty solutions, "No Best Solution") are explicit
in the spec and in :func:`~eval.benchmark_formats.parse_answer`; a non-optimal status always carries
``extra["truth_note"]``.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eval.benchmark_formats import (
    FORMATS,
    BenchmarkItem,
    RecordContext,
    SkipItem,
    is_saved_dataset,
    read_hub,
    read_json_records,
    read_parquet_records,
    read_problem_dirs,
    read_saved_dataset,
)
from trex.core.refs import content_hash, dir_files, file_sha256

__all__ = ["BENCHMARKS", "BenchmarkItem", "BenchmarkSpec", "LoadedBenchmark", "benchmarks_root",
           "list_benchmarks", "load_benchmark", "resolve_source", "source_hash"]

ENV_ROOT = "TREX_BENCHMARKS_DIR"
INDUSTRYOR_SENTINELS = frozenset({-9999.0, -99999.0})


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to find and parse one benchmark.

    ``default_path`` is relative to ``$TREX_BENCHMARKS_DIR`` (``None``: a path must be given);
    ``dir_file`` is the file to read when ``path`` is a directory that is not itself the data;
    ``sentinels`` are answers that mean "infeasible" for this benchmark only.
    """

    key: str
    title: str
    format: str
    default_path: str | None
    scoring: str = "objective"  # "objective" | "lp_structure"
    sentinels: frozenset[float] = frozenset()
    dir_file: str | None = None
    hub_split: str = "test"
    default_api: str = "gurobipy"
    template: str = "reference"
    notes: str = ""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"{self.key}: unknown format {self.format!r}; expected one of {sorted(FORMATS)}")


def _spec(*args: Any, **kwargs: Any) -> tuple[str, BenchmarkSpec]:
    s = BenchmarkSpec(*args, **kwargs)
    return s.key, s


BENCHMARKS: dict[str, BenchmarkSpec] = dict([
    _spec("nl4opt", "NL4OPT test (SLAI-T-Rex copy, 289)", "qa", "SLAI-T-Rex/NL4OPT/test.parquet",
          notes="en_question/en_answer parquet, as evaluated by the reference system"),
    _spec("nl4opt-orlm", "NL4OPT ORLM-format test (245)", "qa", "NL4Opt/ORLM245_via_OptMATH/NL4OPT.jsonl",
          notes="17 answers 'No Best Solution' -> infeasible"),
    _spec("nl4opt-lpwp", "NL4Opt as CoE LPWP problem directories (288)", "problem_dirs",
          "NL4Opt/CoE_LPWP_dirs", notes="numbers only in sample.json (data.json); 7 outputs null -> unknown"),
    _spec("optibench", "OptiBench (SLAI-T-Rex copy, 600)", "qa", "SLAI-T-Rex/optibench/OptiBench.json",
          notes="JSON array of en_question/en_answer"),
    _spec("b4o-feasible", "Bench4Opt feasible (344)", "b4o", "SLAI-T-Rex/bench4opt_feasible/test.jsonl",
          dir_file="test.jsonl", notes="data file -> data.json; optimal_value; reference LP in extra"),
    _spec("b4o-orgeval", "Bench4Opt ORGEval (394)", "b4o", "SLAI-T-Rex/bench4opt/test.jsonl",
          scoring="lp_structure", dir_file="test.jsonl",
          notes="scored by LP structural equivalence with extra['reference_lp']; no objective"),
    _spec("mamo-easylp", "MAMO EasyLP (652)", "qa", "MAMO/original/mamo_easy_lp.jsonl"),
    _spec("mamo-complexlp", "MAMO ComplexLP (211)", "qa", "MAMO/original/mamo_complex_lp.jsonl"),
    _spec("industryor", "IndustryOR original 2024 (100)", "qa",
          "IndustryOR/original_LLM4OR-mirror/IndustryOR.jsonl", sentinels=INDUSTRYOR_SENTINELS,
          notes="-9999/-99999 answers are the source's infeasible sentinels; question_type -> category"),
    _spec("industryor-v2", "IndustryOR expert-revised fixedV2 (100)", "qa",
          "IndustryOR/SIRL_fixedV2/IndustryOR_fixedV2.json", sentinels=INDUSTRYOR_SENTINELS),
    _spec("optmath", "OptMATH-Bench (166)", "qa", "OptMATH/original/OptMATH_Bench.jsonl",
          notes="the .jsonl file holds one JSON array"),
    _spec("nlp4lp", "NLP4LP (udell-lab via LLM4OR mirror, 269)", "problem_dirs",
          "NLP4LP/LLM4OR_mirror_of_udell-lab", hub_split="test",
          notes="parameters.json -> data.json; 27 empty solution.json -> unknown (infeasible or unbounded)"),
    _spec("complexor", "ComplexOR (CoE repository, 18)", "problem_dirs", "ComplexOR/CoE_repo18_dirs",
          notes="abstract description; sample input -> data.json; gt_model.txt in extra"),
    _spec("complexor-44", "ComplexOR original 44 (LLM4OR)", "problem_dirs", "ComplexOR/LLM4OR_original44_dirs"),
    _spec("synthetic", "T-Rex held-out synthetic split", "synthetic", None, default_api="highspy",
          template="synthetic", notes="the curate stage's eval/ directory (datasets.save_to_disk)"),
])


@dataclass
class LoadedBenchmark:
    """Items of one benchmark plus every row that was skipped, as ``(id, reason)``."""

    name: str
    source: str
    items: list[BenchmarkItem]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    rows: int = 0  # rows read from the source (== len(items) + len(skipped))
    content_hash: str | None = None  # sha256 of the data file(s) read (see :func:`source_hash`)
    hashed_files: int = 0  # how many files went into ``content_hash`` (0: a hub dataset, hashed by name)

    @property
    def counts(self) -> dict[str, int]:
        """Rows, items, skipped and items per status."""
        status = Counter(i.status for i in self.items)
        return {"rows": self.rows, "items": len(self.items), "skipped": len(self.skipped),
                **{s: status.get(s, 0) for s in ("optimal", "infeasible", "unknown")}}

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[BenchmarkItem]:
        return iter(self.items)


def benchmarks_root() -> Path | None:
    """``$TREX_BENCHMARKS_DIR`` as a path, or None when unset."""
    root = os.environ.get(ENV_ROOT)
    return Path(root) if root else None


def get_spec(name: str) -> BenchmarkSpec:
    """The spec of a registered benchmark; ValueError lists the known names."""
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; registered: {', '.join(BENCHMARKS)}") from None


def list_benchmarks() -> list[dict[str, Any]]:
    """One row per registered benchmark (for a CLI listing): key, title, format, scoring, default path,
    whether that default exists under ``$TREX_BENCHMARKS_DIR``, and notes."""
    root = benchmarks_root()
    out = []
    for s in BENCHMARKS.values():
        available = bool(root and s.default_path and (root / s.default_path).exists())
        out.append({"key": s.key, "title": s.title, "format": s.format, "scoring": s.scoring,
                    "default_path": s.default_path, "available": available, "notes": s.notes})
    return out


def resolve_source(spec: BenchmarkSpec, path: str | Path | None) -> tuple[str, Path | str]:
    """``("local", Path)`` or ``("hub", name)`` for a benchmark source; see the module docstring."""
    root = benchmarks_root()
    if path is None:
        if spec.default_path is None:
            raise ValueError(f"benchmark {spec.key!r} has no default location: pass a path")
        if root is None:
            raise ValueError(f"benchmark {spec.key!r}: pass a path or set {ENV_ROOT} to the benchmarks directory")
        p = root / spec.default_path
        if not p.exists():
            raise FileNotFoundError(f"{p}: default data of {spec.key!r} not found under {ENV_ROOT}={root}")
        return "local", p
    p = Path(path).expanduser()
    if p.exists():
        return "local", p
    if root is not None and not p.is_absolute() and (root / p).exists():
        return "local", root / p
    name = str(path)
    if p.is_absolute() or name.startswith(".") or p.suffix in (".jsonl", ".json", ".parquet") or name.count("/") != 1:
        raise FileNotFoundError(f"{path}: no such file or directory (nor under {ENV_ROOT}), "
                                "and not a hub dataset name of the form owner/name")
    return "hub", name


def _records(spec: BenchmarkSpec, kind: str, src: Path | str) -> tuple[Iterator[tuple[str, Any]], Path | None]:
    """The raw records of a source and the directory relative data paths resolve against."""
    if kind == "hub":
        return read_hub(str(src), spec.hub_split), None
    p = Path(src)
    if p.is_dir():
        if is_saved_dataset(p):
            return read_saved_dataset(p), p
        if spec.dir_file and (p / spec.dir_file).is_file():
            p = p / spec.dir_file
        elif spec.format == "problem_dirs":
            return read_problem_dirs(p), p
        else:
            raise ValueError(f"{p}: a directory, but not a saved dataset"
                             + (f" and has no {spec.dir_file}" if spec.dir_file else "")
                             + f"; {spec.key} expects a file")
    if p.suffix == ".parquet":
        return read_parquet_records(p), p.parent
    if p.suffix in (".jsonl", ".json", ".ndjson"):
        return read_json_records(p), p.parent
    raise ValueError(f"{p}: unsupported file type {p.suffix!r} (use .jsonl, .json, .parquet or a directory)")


def source_hash(spec: BenchmarkSpec, kind: str, src: Path | str) -> tuple[str, int]:
    """``(sha256, files hashed)`` of the data a benchmark is read from, independent of where it lies.

    A records file: its content hash. Bench4Opt records name data and reference-LP files beside them, so
    their whole directory is hashed; a directory source (saved dataset, problem directories): every file
    under it, as the hash of ``{relative name: sha256}``. A hub dataset is identified by its name and split
    only (``0`` files hashed).
    """
    if kind == "hub":
        return hashlib.sha256(f"hub:{src}:{spec.hub_split}".encode()).hexdigest(), 0
    p = Path(src)
    if p.is_dir() and spec.dir_file and not is_saved_dataset(p) and (p / spec.dir_file).is_file():
        p = p / spec.dir_file
    if p.is_file() and spec.format == "b4o":
        p = p.parent
    if p.is_file():
        return file_sha256(p), 1
    files = dir_files(p)
    return content_hash(files), len(files)


def _source_label(spec: BenchmarkSpec, kind: str, src: Path | str) -> str:
    root = benchmarks_root()
    if kind == "local" and root is not None:
        try:
            return f"{spec.key}:{Path(src).resolve().relative_to(root.resolve())}"
        except ValueError:
            pass
    return f"{spec.key}:{src}"


def load_benchmark(name: str, path: str | Path | None = None, limit: int | None = None) -> LoadedBenchmark:
    """Load a registered benchmark (see the module docstring for ``path``).

    ``limit`` stops after that many items (the rows read up to then are all accounted for). Malformed
    input raises ``ValueError`` naming the file and line; a duplicate id raises ``ValueError`` naming
    both rows.
    """
    spec = get_spec(name)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    kind, src = resolve_source(spec, path)
    records, base_dir = _records(spec, kind, src)
    parse = FORMATS[spec.format]
    label = _source_label(spec, kind, src)
    out = LoadedBenchmark(name=spec.key, source=str(src), items=[])
    out.content_hash, out.hashed_files = source_hash(spec, kind, src)
    seen: dict[str, str] = {}
    for index, (origin, rec) in enumerate(records):
        if limit is not None and len(out.items) >= limit:
            break
        out.rows += 1
        ctx = RecordContext(origin=origin, index=index, source=label, base_dir=base_dir,
                            sentinels=spec.sentinels, options={"scoring": spec.scoring})
        try:
            item = parse(rec, ctx)
        except SkipItem as e:
            rid = rec.get("id", rec.get("index", index)) if isinstance(rec, dict) else index
            out.skipped.append((str(rid), f"{origin}: {e}"))
            continue
        if item.id in seen:
            raise ValueError(f"{origin}: duplicate id {item.id!r} (first at {seen[item.id]})")
        seen[item.id] = origin
        out.items.append(item)
    return out
