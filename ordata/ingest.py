"""Ingest external seed data (JSONL / JSON / parquet) into one normalised schema, with quarantine.

Recognised record shapes:

* ORLM style ``{"en_question", "en_answer"}`` (also IndustryOR, MAMO, NL4OPT, OptMATH in that format);
* LLMOPT style ``{"question", "answer"}``;
* OptiBench style ``{"question", "results": {..., "objective"?}}`` or ``{"en_question", "en_answer"}``;
* chat ``{"messages": [{"role", "content"}, ...]}`` whose assistant turn may hold a program.

Every record becomes ``{id, question, answer, program, objective, status, source, licence, origin}``
where ``origin`` is ``file:line`` (or ``file#index``). A line that is not valid UTF-8 or JSON, or a
record that fits no shape, goes to the quarantine list with its ``file:line`` and reason; an input
file that cannot be read at all raises :class:`IngestError` naming it. Nothing is dropped silently.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eval.extract import extract_program
from eval.audit import side_effect_detail
from eval.sandbox import SOLVER_PRELOAD, rejection_reason, run_programs
from eval.scoring import is_correct

INFEASIBLE_MARKERS = {"no best solution", "infeasible", "no feasible solution", "unbounded"}


class IngestError(RuntimeError):
    """An input file could not be read at all."""


@dataclass
class IngestResult:
    records: list[dict] = field(default_factory=list)
    quarantined: list[dict] = field(default_factory=list)
    read: int = 0

    @property
    def accounting(self) -> dict[str, int]:
        return {"in": self.read, "kept": len(self.records), "quarantined": len(self.quarantined)}


def _raw_records(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """Yield ``(origin, record_or_None, error)`` for every line / element / row of ``path``."""
    suffix = path.suffix.lower()
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise IngestError(f"{path}: cannot read input file ({e.strerror or e})") from e
    if suffix in (".jsonl", ".ndjson"):
        for i, line in enumerate(blob.split(b"\n"), start=1):
            if not line.strip():
                continue
            origin = f"{path}:{i}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield origin, None, f"not UTF-8 (byte {e.start})"
                continue
            try:
                yield origin, json.loads(text), None
            except json.JSONDecodeError as e:
                yield origin, None, f"malformed JSON: {e.msg} (column {e.colno})"
    elif suffix == ".json":
        try:
            data = json.loads(blob.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise IngestError(f"{path}: not a valid UTF-8 JSON document ({e})") from e
        if isinstance(data, dict):
            data = data.get("data", data.get("examples", list(data.values())))
        if not isinstance(data, list):
            raise IngestError(f"{path}: expected a JSON list of records")
        for i, rec in enumerate(data):
            yield f"{path}#{i}", rec, None
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - any reader failure means the file is unreadable
            raise IngestError(f"{path}: cannot read parquet ({e})") from e
        for i, rec in enumerate(table.to_pylist()):
            yield f"{path}#{i}", rec, None
    else:
        raise IngestError(f"{path}: unsupported input format {suffix!r} (use .jsonl, .json or .parquet)")


def parse_objective(answer: Any) -> tuple[float | None, str]:
    """``(objective, status)`` from a benchmark answer: a number, or an infeasibility marker."""
    if answer is None:
        return None, "unknown"
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return (float(answer), "optimal") if math.isfinite(answer) else (None, "unknown")
    text = str(answer).strip()
    if text.lower().rstrip(".") in INFEASIBLE_MARKERS:
        return None, "infeasible"
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None, "unknown"
    if value in (-9999.0, -99999.0):  # sentinels some benchmarks use for "infeasible"
        return None, "infeasible"
    return value, "optimal"


OBJECTIVE_KEY_WORDS = ("objective", "optimal", "maxim", "minim", "total")


def _objective_from_results(results: dict) -> Any:
    """OptiBench (ReSocratic) keeps ``{description: value}``; the objective's description names it."""
    for key in ("objective", "optimal_value"):
        if key in results:
            return results[key]
    for key, value in results.items():
        if any(w in str(key).lower() for w in OBJECTIVE_KEY_WORDS):
            return value
    return None


def _message_text(content: Any) -> tuple[str | None, str | None]:
    """A chat message's text: a string, or OpenAI-style ``[{"type": "text", "text": ...}]`` parts joined."""
    if isinstance(content, str):
        return content, None
    if content is None:
        return None, "content is null"
    if isinstance(content, list):
        if all(isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str)
               for p in content):
            return "".join(p["text"] for p in content), None
        return None, "content is a list with parts that are not text"
    return None, f"content is a {type(content).__name__}, not text"


def _question_of(rec: Any) -> str | None:
    """The question text of a record of any recognised shape, whatever its answer (for decontamination)."""
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("messages"), list):
        for m in rec["messages"]:
            if isinstance(m, dict) and m.get("role") == "user":
                text, _ = _message_text(m.get("content"))
                if text and text.strip():
                    return text.strip()
        return None
    low = {str(k).lower(): v for k, v in rec.items()}
    q = low.get("en_question", low.get("question"))
    return q.strip() if isinstance(q, str) and q.strip() else None


def all_questions(paths: list[str | Path]) -> tuple[list[str], dict[str, dict[str, int]]]:
    """Every question of the benchmark files, parsable answer or not, with counts per file.

    Per file: ``records`` read, ``questions`` taken, ``unparsable_answer`` (questions whose answer the
    ingest would quarantine — still used), ``without_question`` (lines with no question text: bad JSON or
    no question field; nothing to match against).
    """
    questions: list[str] = []
    counts: dict[str, dict[str, int]] = {}
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise IngestError(f"{path}: input file does not exist")
        c = counts.setdefault(str(path), {"records": 0, "questions": 0, "unparsable_answer": 0, "without_question": 0})
        for origin, rec, error in _raw_records(path):
            c["records"] += 1
            q = None if error else _question_of(rec)
            if q is None:
                c["without_question"] += 1
                continue
            questions.append(q)
            c["questions"] += 1
            if normalise(rec, origin, "", "")[0] is None:
                c["unparsable_answer"] += 1
    return questions, counts


def normalise(rec: Any, origin: str, source: str, licence: str) -> tuple[dict | None, str | None]:
    """Map one raw record to the schema, or return the reason it fits no known shape."""

    if not isinstance(rec, dict):
        return None, f"record is a {type(rec).__name__}, not an object"
    question = answer = program = None
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            return None, "messages must be a list of {role, content}"
        texts = []
        for j, m in enumerate(msgs):
            text, why = _message_text(m["content"])
            if why:
                return None, f"messages[{j}] ({m['role']}): {why}"
            texts.append(text)
        users = [t for m, t in zip(msgs, texts) if m["role"] == "user"]
        assistants = [t for m, t in zip(msgs, texts) if m["role"] == "assistant"]
        if not users or not assistants:
            return None, "chat without a user and an assistant turn"
        question, answer = users[0], assistants[-1]
        program = extract_program(answer)
        objective, status = None, "unknown"
    else:
        low = {str(k).lower(): v for k, v in rec.items()}  # MAMO writes Question / Answer
        question = low.get("en_question", low.get("question"))
        answer = low.get("en_answer", low.get("answer"))
        if answer is None and isinstance(low.get("results"), dict):
            answer = _objective_from_results(low["results"])
        if not isinstance(question, str) or not question.strip():
            return None, "no question field (en_question / question / messages)"
        objective, status = parse_objective(answer)
        if status == "unknown" and answer is not None:
            return None, f"answer is neither a number nor an infeasibility marker: {str(answer)[:60]!r}"
    return {
        "id": str(rec.get("id", rec.get("index", origin))), "question": question.strip(),
        "answer": None if answer is None else str(answer), "program": program,
        "objective": objective, "status": status, "source": source, "licence": licence, "origin": origin,
    }, None


def ingest(paths: list[str | Path], source: str | None = None, licence: str = "unknown") -> IngestResult:
    """Read and normalise every record of ``paths``; bad lines are quarantined with file:line."""
    out = IngestResult()
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise IngestError(f"{path}: input file does not exist")
        for origin, rec, error in _raw_records(path):
            out.read += 1
            if error is None:
                norm, error = normalise(rec, origin, source or path.stem, licence)
                if norm is not None:
                    out.records.append(norm)
                    continue
            raw = rec if rec is not None else None
            out.quarantined.append({"origin": origin, "reason": error, "raw": str(raw)[:300] if raw is not None else None})
    return out


def verify_programs(records: list[dict], rel_tol: float = 1e-6, isolation: str = "auto",
                    allow_unisolated: bool = False, timeout_s: float = 30.0,
                    workers: int = 1) -> tuple[list[dict], list[dict]]:
    """Execute the program of every record that has one, in the sandbox that runs model outputs.

    A record is kept when its program's **attested** solve matches the record's known optimum (or, with no
    known answer, when a solver attested an optimal or infeasible result); the verified objective and status
    are the attested ones. Printed numbers are never the verdict. Records without a program are kept
    unverified. Every result records the isolation it ran under.
    """
    with_code = [r for r in records if r["program"]]
    results = run_programs([r["program"] for r in with_code], timeout_s, memory_mb=4096, isolation=isolation,
                           allow_unisolated=allow_unisolated, preload=SOLVER_PRELOAD, workers=workers,
                           setting="data.isolation") if with_code else []
    kept = [r for r in records if not r["program"]]
    rejected = []
    for r, res in zip(with_code, results):
        known = r["objective"] is not None or r["status"] == "infeasible"
        correct = (is_correct(res.objective, res.reported, r["objective"], r["status"] or "optimal", rel_tol) if known
                   else res.reported in ("optimal", "infeasible"))
        reason = rejection_reason(res, correct)
        if reason == "program_mismatch" and not known:
            reason = f"program_reported_{res.reported}"
        if reason:
            rejected.append({"origin": r["origin"], "reason": reason, "isolation": res.isolation,
                             "detail": side_effect_detail(res) if res.side_effects else
                             f"attested {res.reported} {res.objective} (printed {res.printed_objective}) "
                             f"vs answer {r['status']} {r['objective']}"})
        else:
            kept.append({**r, "objective": res.objective, "status": res.reported, "verified": True,
                         "isolation": res.isolation})
    return kept, rejected


def read_corpora(paths: list[str | Path]) -> IngestResult:
    """Raw CPT text: a ``.txt`` file is one document; JSONL/JSON/parquet records need a ``text`` field."""
    out = IngestResult()
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise IngestError(f"{path}: input file does not exist")
        if path.suffix.lower() == ".txt":
            out.read += 1
            try:
                out.records.append({"id": str(path), "text": path.read_bytes().decode("utf-8"), "source": path.stem})
            except UnicodeDecodeError as e:
                out.quarantined.append({"origin": str(path), "reason": f"not UTF-8 (byte {e.start})", "raw": None})
            except OSError as e:
                raise IngestError(f"{path}: cannot read input file ({e})") from e
            continue
        for origin, rec, error in _raw_records(path):
            out.read += 1
            if error is None and not (isinstance(rec, dict) and isinstance(rec.get("text"), str)):
                error = "record has no 'text' string"
            if error:
                out.quarantined.append({"origin": origin, "reason": error, "raw": None if rec is None else str(rec)[:300]})
            else:
                out.records.append({"id": origin, "text": rec["text"], "source": path.stem})
    return out
