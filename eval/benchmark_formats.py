"""Benchmark file formats: raw readers, ground-truth parsing and one record parser per format.

Readers turn a source into ``(origin, record)`` pairs, ``origin`` being ``file:line`` (JSONL),
``file#index`` (JSON array, parquet, saved dataset, hub split) or the problem directory. Parsers turn
one record into a :class:`BenchmarkItem` or raise :class:`SkipItem` with the reason; the loader in
:mod:`eval.benchmarks` collects those reasons, so no row disappears silently. Input that cannot be read
at all (malformed JSON, a record that is not an object) raises ``ValueError`` naming file and line.

Formats (``FORMATS``):

* ``qa`` - question + answer records: ORLM (``en_question``/``en_answer``), LLMOPT (``question``/
  ``answer``/``index``), MAMO (``Question``/``Answer``/``Type``), OptiBench (``en_question``/``en_answer``,
  or ReSocratic ``question`` + ``results`` dict), IndustryOR (``question_type`` -> category).
* ``b4o`` - Bench4Opt (SLAI-T-Rex): ``problem`` text, ``data_path`` to the instance JSON (given to the
  program as ``data.json``), ``reference_lp_path``, ``optimal_value`` / ``gt_optimal_value``.
* ``problem_dirs`` - one directory per problem (CoE / NLP4LP layout): ``description.txt`` plus
  ``sample.json`` ``[{input, output}]`` or ``parameters.json`` + ``solution.json`` ``{variables, objective}``,
  optionally ``gt_model.txt``; or the rows of a ``__consolidated.jsonl`` file of such directories.
* ``synthetic`` - the project's held-out split (``datasets.save_to_disk``): id, question, objective,
  status, family, category, api, files (JSON string), representation.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

STATUSES = ("optimal", "infeasible", "unknown")
DATA_FILE = "data.json"  # the name under which a problem's instance data reaches the program

# answers that state there is no optimum; all normalised to lower case without a final full stop
INFEASIBLE_MARKERS = {
    "no best solution": "answer 'No Best Solution' (ORLM convention: the reference solver found no feasible solution)",
    "infeasible": "answer states the problem is infeasible",
    "no feasible solution": "answer states there is no feasible solution",
}
UNKNOWN_MARKERS = {
    "unbounded": "answer states the problem is unbounded",
    "infeasible or unbounded": "answer states the problem is infeasible or unbounded",
}


class SkipItem(Exception):
    """A row that cannot become a benchmark item; the message is the reason recorded by the loader."""


@dataclass
class BenchmarkItem:
    """One normalised benchmark problem.

    ``files`` maps a file name to its text (e.g. ``{"data.json": "..."}``): the program finds these
    files in its working directory. ``ground_truth`` is the optimal objective when ``status`` is
    ``"optimal"`` and ``None`` otherwise; ``extra["truth_note"]`` says why a status is not ``optimal``.
    """

    id: str
    question: str
    files: dict[str, str]
    ground_truth: float | None
    status: str
    category: str | None
    source: str
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"item {self.id}: status {self.status!r} is not one of {STATUSES}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy of every field."""
        return asdict(self)

    def as_problem(self, family: str, api: str = "gurobipy") -> dict[str, Any]:
        """The row shape :func:`eval.harness.score` consumes (``files`` as a JSON string)."""
        return {"id": self.id, "question": self.question, "objective": self.ground_truth, "status": self.status,
                "family": family, "category": self.category or "unknown",
                "representation": "DPS" if self.files else "DP", "api": api, "files": json.dumps(self.files)}


@dataclass(frozen=True)
class Truth:
    """A parsed ground truth: the objective (or None), the status and why it is not a plain optimum."""

    value: float | None
    status: str
    note: str | None = None


@dataclass(frozen=True)
class RecordContext:
    """What a parser knows besides the record: where it came from and the benchmark's conventions."""

    origin: str  # file:line, file#index or a directory
    index: int  # 0-based position of the record in its source
    source: str  # benchmark key + file, copied into BenchmarkItem.source
    base_dir: Path | None = None  # directory that relative data paths are resolved against
    sentinels: frozenset[float] = frozenset()  # answers that mean "infeasible" for this benchmark
    options: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------- ground truth

def parse_answer(raw: Any, sentinels: frozenset[float] = frozenset()) -> Truth:
    """Parse a benchmark answer explicitly.

    Numbers (or numeric strings, thousands separators allowed) are optima, unless they are one of the
    benchmark's ``sentinels`` (e.g. IndustryOR's -9999/-99999 for infeasible); known markers such as
    ``"No Best Solution"`` map to ``infeasible`` / ``unknown`` with a note; ``None`` means the source
    gives no answer (``unknown``). Anything else raises :class:`SkipItem` quoting the value.
    """
    if raw is None:
        return Truth(None, "unknown", "the source gives no answer (null)")
    if isinstance(raw, bool):
        raise SkipItem(f"answer {raw!r} is a boolean, not an objective value")
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str):
        text = raw.strip()
        key = text.lower().rstrip(".").strip()
        if key in INFEASIBLE_MARKERS:
            return Truth(None, "infeasible", INFEASIBLE_MARKERS[key])
        if key in UNKNOWN_MARKERS:
            return Truth(None, "unknown", UNKNOWN_MARKERS[key])
        if not text:
            return Truth(None, "unknown", "the source gives an empty answer")
        try:
            value = float(text.replace(",", ""))
        except ValueError:
            raise SkipItem(f"answer {text[:80]!r} is neither a number nor a known marker") from None
    elif isinstance(raw, list) and len(raw) == 1:  # CoE sample.json keeps the output as a 1-element list
        return parse_answer(raw[0], sentinels)
    else:
        raise SkipItem(f"answer of type {type(raw).__name__} ({str(raw)[:60]!r}) is not an objective value")
    if math.isnan(value):
        raise SkipItem("answer is NaN")
    if math.isinf(value):
        return Truth(None, "unknown", f"answer is {value} (unbounded)")
    if value in sentinels:
        return Truth(None, "infeasible", f"sentinel {raw!r}: this benchmark's marker for an infeasible problem")
    return Truth(value, "optimal")


# --------------------------------------------------------------------------------------------- readers

def _json_error(path: Path, e: json.JSONDecodeError, line: int | None = None) -> ValueError:
    return ValueError(f"{path}:{line or e.lineno}: malformed JSON ({e.msg}, column {e.colno})")


def read_json_records(path: Path) -> Iterator[tuple[str, Any]]:
    """Records of a JSONL file, or of a JSON array (some ``.jsonl`` files hold one array, some ``.json``
    files hold one object per line: the content decides). Malformed input raises ValueError(file:line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 (byte {e.start})") from e
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise _json_error(path, e) from e
        for i, rec in enumerate(data):
            yield f"{path}#{i}", rec
        return
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise _json_error(path, e, lineno) from e
        yield f"{path}:{lineno}", rec


def read_parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    """Rows of a parquet file as dicts."""
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - any reader failure means the file is unreadable
        raise ValueError(f"{path}: cannot read parquet ({e})") from e
    for i, rec in enumerate(rows):
        yield f"{path}#{i}", rec


def read_saved_dataset(path: Path) -> Iterator[tuple[str, Any]]:
    """Rows of a ``datasets.save_to_disk`` directory."""
    import datasets

    for i, rec in enumerate(datasets.load_from_disk(str(path)).to_list()):
        yield f"{path}#{i}", rec


def read_hub(name: str, split: str) -> Iterator[tuple[str, Any]]:
    """Rows of a Hugging Face hub dataset split (needs network access)."""
    import datasets

    for i, rec in enumerate(datasets.load_dataset(name, split=split)):
        yield f"{name}[{split}]#{i}", dict(rec)


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _read_json_file(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _json_error(path, e) from e


def read_problem_dirs(root: Path) -> Iterator[tuple[str, Any]]:
    """One record per sub-directory of ``root`` (natural order), with the files parsed into the keys of a
    ``__consolidated.jsonl`` row: description, samples, parameters, solution, gt_model (+ _dir)."""
    for d in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: _natural_key(p.name)):
        rec: dict[str, Any] = {"id": d.name, "_dir": str(d.resolve())}
        if (d / "description.txt").is_file():
            rec["description"] = (d / "description.txt").read_text(encoding="utf-8")
        for name, key in (("sample.json", "samples"), ("parameters.json", "parameters"),
                          ("solution.json", "solution")):
            if (d / name).is_file():
                rec[key] = _read_json_file(d / name)
                rec[f"_has_{key}"] = True
        if (d / "gt_model.txt").is_file():
            rec["gt_model"] = (d / "gt_model.txt").read_text(encoding="utf-8")
        yield str(d), rec


def is_saved_dataset(path: Path) -> bool:
    """True for a ``datasets.save_to_disk`` directory."""
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "state.json").is_file())


# --------------------------------------------------------------------------------------------- parsers

def _lower_keys(rec: dict) -> dict[str, Any]:
    return {str(k).lower(): v for k, v in rec.items()}


def _question(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SkipItem("no question text")
    return value.strip()


def _item(ctx: RecordContext, rid: Any, question: str, truth: Truth, category: str | None = None,
          files: dict[str, str] | None = None, **extra: Any) -> BenchmarkItem:
    extra = {"origin": ctx.origin, **{k: v for k, v in extra.items() if v is not None}}
    if truth.note:
        extra["truth_note"] = truth.note
    return BenchmarkItem(id=str(rid), question=question, files=files or {}, ground_truth=truth.value,
                         status=truth.status, category=category, source=ctx.source, extra=extra)


_CATEGORIES = {"lp": "LP", "ip": "IP", "mip": "MILP", "milp": "MILP", "nlp": "NLP", "minlp": "MINLP",
               "qp": "QP", "socp": "SOCP", "others": "Others"}


def _objective_from_results(results: dict) -> Any:
    """ReSocratic OptiBench ``results``: a single value is the objective; otherwise the one key naming
    the objective. Ambiguous dicts are skipped rather than guessed."""
    if len(results) == 1:
        return next(iter(results.values()))
    named = [k for k in results if "objective" in str(k).lower()]
    if len(named) == 1:
        return results[named[0]]
    raise SkipItem(f"results has {len(results)} values and {len(named)} keys naming the objective; "
                   "cannot tell which one is the optimum")


def parse_qa(rec: Any, ctx: RecordContext) -> BenchmarkItem:
    """ORLM / LLMOPT / MAMO / OptiBench / IndustryOR / OptMATH question-answer records."""
    if not isinstance(rec, dict):
        raise ValueError(f"{ctx.origin}: record is a {type(rec).__name__}, not a JSON object")
    low = _lower_keys(rec)
    if "description" in low and not ({"en_question", "question"} & set(low)):
        return parse_problem_dir(rec, ctx)  # a problem-directory row given to a question-answer benchmark
    question = _question(low.get("en_question", low.get("question")))
    if "en_answer" in low or "answer" in low:
        raw = low.get("en_answer", low.get("answer"))
    elif isinstance(low.get("results"), dict):
        raw = _objective_from_results(low["results"])
    else:
        raise SkipItem("no answer field (en_answer / answer / results)")
    truth = parse_answer(raw, ctx.sentinels)
    rid = low.get("id", low.get("index", ctx.index))
    qtype = low.get("question_type")
    category = _CATEGORIES.get(str(qtype).lower(), str(qtype)) if qtype else None
    return _item(ctx, rid, question, truth, category, question_type=qtype, difficulty=low.get("difficulty"),
                 type=low.get("type"), ori=low.get("ori"), raw_answer=None if truth.status == "optimal" else raw)


_PROBLEM_TYPE = re.compile(r"#\s*Problem type:\s*([A-Za-z]+)")


def parse_b4o(rec: Any, ctx: RecordContext) -> BenchmarkItem:
    """Bench4Opt records: the problem text, its data file (-> ``data.json``) and reference LP model.

    ``ctx.options["scoring"]`` is ``"objective"`` (B4O-Feasible: ``optimal_value`` is the ground truth) or
    ``"lp_structure"`` (B4O-ORGEval: scored by LP equivalence; ``gt_optimal_value`` when the file has it).
    """
    if not isinstance(rec, dict):
        raise ValueError(f"{ctx.origin}: record is a {type(rec).__name__}, not a JSON object")
    question = _question(rec.get("problem"))
    scoring = ctx.options.get("scoring", "objective")
    if "optimal_value" in rec or "gt_optimal_value" in rec:
        truth = parse_answer(rec.get("optimal_value", rec.get("gt_optimal_value")), ctx.sentinels)
    elif scoring == "lp_structure":
        truth = Truth(None, "unknown", "B4O-ORGEval has no objective: scored by LP structural equivalence")
    else:
        raise SkipItem("no optimal_value field")
    if ctx.base_dir is None:
        raise SkipItem("data_path cannot be resolved without a local benchmark directory")
    paths = {}
    for key in ("data_path", "reference_lp_path"):
        if not rec.get(key):
            raise SkipItem(f"no {key}")
        p = (ctx.base_dir / rec[key]).resolve()
        if not p.is_file():
            raise SkipItem(f"{key} {rec[key]!r} does not exist under {ctx.base_dir}")
        paths[key] = p
    m = _PROBLEM_TYPE.search(rec.get("reference_code") or "")
    category = m.group(1).upper() if m else None
    return _item(ctx, rec.get("id", ctx.index), question, truth, category,
                 {DATA_FILE: paths["data_path"].read_text(encoding="utf-8")}, scoring=scoring,
                 reference_lp=str(paths["reference_lp_path"]), data_path=str(paths["data_path"]),
                 initial_data_path=rec.get("initial_data_path"), wp_type=rec.get("wp_type"),
                 reference_code=rec.get("reference_code"))


def _as_obj(value: Any) -> Any:
    """Consolidated rows may hold nested JSON as a string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def parse_problem_dir(rec: Any, ctx: RecordContext) -> BenchmarkItem:
    """A CoE/NLP4LP problem directory (or its consolidated row): description + data + solution."""
    if not isinstance(rec, dict):
        raise ValueError(f"{ctx.origin}: record is a {type(rec).__name__}, not a JSON object")
    if "description" not in rec and {"en_question", "question"} & set(_lower_keys(rec)):
        return parse_qa(rec, ctx)  # e.g. LLMOPT's question/answer copy of NLP4LP or ComplexOR
    question = _question(rec.get("description"))
    files: dict[str, str] = {}
    extra: dict[str, Any] = {}
    samples = _as_obj(rec.get("samples"))
    if rec.get("_has_samples") or samples is not None:
        if isinstance(samples, dict):  # two ComplexOR problems keep one {input, output} object
            samples = [samples]
        if not isinstance(samples, list) or not samples or not isinstance(samples[0], dict):
            raise SkipItem(f"sample.json is not a list of {{input, output}} objects: {str(samples)[:60]!r}")
        if "output" not in samples[0]:
            raise SkipItem("sample.json has no output")
        truth = parse_answer(samples[0]["output"], ctx.sentinels)
        if samples[0].get("output") in ([None], None):
            truth = Truth(None, "unknown", "sample.json output is null: the source has no answer")
        files[DATA_FILE] = json.dumps(samples[0].get("input", {}), indent=2)
        if len(samples) > 1:
            extra["more_samples"] = len(samples) - 1  # only the first sample is the benchmark instance
    elif rec.get("_has_solution") or "solution" in rec:
        solution = _as_obj(rec.get("solution"))
        if not solution:  # NLP4LP leaves solution.json empty when there is no optimum
            truth = Truth(None, "unknown", "solution.json is empty: NLP4LP has no optimum for this problem "
                                           "(infeasible or unbounded; the source does not say which)")
        elif not isinstance(solution, dict) or "objective" not in solution:
            raise SkipItem(f"solution has no objective: {str(solution)[:60]!r}")
        else:
            truth = parse_answer(solution["objective"], ctx.sentinels)
        params = _as_obj(rec.get("parameters"))
        if params is not None:
            files[DATA_FILE] = json.dumps(params, indent=2)
    else:
        raise SkipItem("neither sample.json nor solution.json")
    return _item(ctx, rec.get("id", ctx.index), question, truth, None, files, **extra,
                 gt_model=rec.get("gt_model"), dir=rec.get("_dir"))


def parse_synthetic(rec: Any, ctx: RecordContext) -> BenchmarkItem:
    """A row of the project's held-out split (see :func:`ordata.curate.chat_row`)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{ctx.origin}: record is a {type(rec).__name__}, not an object")
    question = _question(rec.get("question"))
    status = rec.get("status") or "optimal"
    if status == "infeasible":
        truth = Truth(None, "infeasible", "generated as an infeasible variant")
    elif status == "optimal":
        truth = parse_answer(rec.get("objective"))
    else:
        raise SkipItem(f"status {status!r} is neither optimal nor infeasible")
    raw_files = rec.get("files") or "{}"
    try:
        files = json.loads(raw_files) if isinstance(raw_files, str) else dict(raw_files)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ctx.origin}: files column is not JSON ({e.msg})") from e
    return _item(ctx, rec.get("id", ctx.index), question, truth, rec.get("category"), files,
                 family=rec.get("family"), representation=rec.get("representation"), api=rec.get("api"),
                 tier=rec.get("tier"))


Parser = Callable[[Any, RecordContext], BenchmarkItem]
FORMATS: dict[str, Parser] = {"qa": parse_qa, "b4o": parse_b4o, "problem_dirs": parse_problem_dir,
                              "synthetic": parse_synthetic}
