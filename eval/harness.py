"""Zero-shot Pass@1 by executing the model's solver programs: any backend, any registered benchmark.

For each item: chat prompt (:mod:`eval.prompts`) -> completion (:mod:`eval.backends`) -> the last fenced
Python block (or LP text) -> sandboxed execution (:mod:`eval.sandbox`) -> the **last attested solve**
judged against the ground truth under three rules side by side (:mod:`eval.scoring`); B4O-ORGEval items are
judged by structural equivalence of the produced LP model with the reference (:mod:`eval.lp_equiv`).

Results: ``samples.jsonl`` (one line per item: prompt, completion, program, sandbox outcome, objective,
verdicts, run fingerprint), appended chunk by chunk and fsynced, so a crashed run continues where it stopped;
``report.json`` (Pass@1 per rule, overall / per benchmark / per category / per representation / per family /
per difficulty tier (:mod:`ordata.tiers`, generated rows), execution-error rate, sampling parameters, isolation, fingerprint) is always recomputed from the lines of
``samples.jsonl``.

Run fingerprint (:func:`run_fingerprint`): a short hash of what produced a row - the model's content hash,
the backend kind and its output-changing options, the prompt template (version and rendered text), the
sampling parameters, the benchmark data's content hash, the scoring rules (version, tolerances) and the
sandbox limits. A run resumes only rows with its own fingerprint; a directory holding rows of another
fingerprint is refused (:class:`FingerprintMismatch`, naming what differs) unless ``overwrite`` discards them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Callable

from eval.audit import side_effect_kinds
from eval.backends import SamplingParams, make_backend
from eval.benchmark_formats import BenchmarkItem
from eval.benchmarks import load_benchmark
from eval.extract import extract_lp, extract_program
from eval.prompts import API_NAMES, PROMPT_VERSION, build_messages
from eval.repair import repair, repair_summary
from eval.sandbox import SOLVER_PRELOAD, ExecResult, Program, run_programs
from eval.scoring import ABS_TOL, ORLM_TOL, RULES, SCORING_VERSION, verdicts
from eval.stats import DEFAULT_CONFIDENCE, mean_pass_at_k, pass_rate
from trex.core.config import EvalConfig
from trex.core.refs import MANIFEST, content_hash, file_sha256

Progress = Callable[[str, int, int], None]
SAMPLES, REPORT = "samples.jsonl", "report.json"
LP_FILE = "model.lp"
EXEC_FAILURES = ("error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed")
SAMPLE_SEED_STRIDE = 1_000_003  # sample j of a problem is drawn with seed + j * stride (j = 0: the single-sample seed)
PASS_AT_K = (1, 2, 4, 8, 16, 32, 64, 128)


# ------------------------------------------------------------------------------------------- samples
def read_samples(out_dir: str | Path) -> list[dict]:
    """Every complete line of ``samples.jsonl`` (a torn last line from a crash is dropped and rewritten)."""
    path = Path(out_dir) / SAMPLES
    if not path.is_file():
        return []
    rows, good_bytes = [], 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
            good_bytes += len(line)
    if good_bytes != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return rows


def _append(out_dir: Path, rows: list[dict]) -> None:
    with open(out_dir / SAMPLES, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------- fingerprint
FINGERPRINT_LEN = 12  # hex digits of the run fingerprint
COMPONENT_HASH_LEN = 16  # hex digits of the content hashes shown among its components
# backend options that do not change what is generated (connection handling, memory headroom)
NEUTRAL_OPTIONS = frozenset({"api_key_env", "max_concurrency", "timeout_s", "max_retries", "backoff_s",
                             "max_backoff_s", "gpu_memory_utilization", "base_url"})
# files of a model directory that determine its outputs: weights, configs, tokenizer, custom code, chat templates
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".txt", ".tiktoken",
                       ".py", ".jinja", ".vocab")
_model_hash_cache: dict[tuple, dict] = {}


class FingerprintMismatch(ValueError):
    """The output directory holds rows produced by a different run (another model, prompt, sampling, ...)."""


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def model_identity(model: str | None, kind: str | None = None, base_url: str | None = None,
                   model_hash: str | None = None) -> dict:
    """What identifies the weights behind a backend.

    ``model_hash`` given (a stage reference's content hash): that. An endpoint: its base URL and the served
    model name. A local directory: the content hash of its (or its parent stage directory's, for
    ``.../export``) ``manifest.json``, else the hash of its weight / config / tokenizer files' contents.
    Anything else (a hub id): the name.
    """
    if model_hash:
        return {"sha256": model_hash[:COMPONENT_HASH_LEN], "from": "reference"}
    if base_url or kind == "openai":
        return {"endpoint": base_url, "name": model}
    p = Path(model) if model else None
    if p is None or not p.is_dir():
        return {"name": model}

    stage = next((d for d in (p, p.parent if p.name == "export" else None) if d and (d / MANIFEST).is_file()), None)
    if stage is not None:
        try:
            h = json.loads((stage / MANIFEST).read_text())["content_hash"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{stage / MANIFEST}: unreadable manifest, no content_hash ({e})") from None
        return {"sha256": str(h)[:COMPONENT_HASH_LEN], "from": "manifest"}
    d = p / "export" if (p / "export" / "config.json").is_file() else p
    files = sorted(f for f in d.rglob("*") if f.is_file() and f.name.endswith(MODEL_FILE_SUFFIXES)
                   and not any(part.startswith(".") for part in f.relative_to(d).parts))
    if not files:
        return {"name": str(p), "files": 0}
    key = (str(d.resolve()), tuple((f.relative_to(d).as_posix(), st.st_size, st.st_mtime_ns)
                                   for f in files for st in [f.stat()]))
    if key not in _model_hash_cache:  # weights are large: hash each unchanged directory once per process

        h = content_hash({f.relative_to(d).as_posix(): file_sha256(f) for f in files})
        _model_hash_cache[key] = {"sha256": h[:COMPONENT_HASH_LEN], "from": "files", "files": len(files)}
    return dict(_model_hash_cache[key])


def prompt_hash(template: str, api: str | None) -> str:
    """Hash of the template text as rendered for probe items (plain, with a data file, LP-output), so any
    change of wording, of an API's description or of the SFT prompt changes it; independent of the items."""

    probes = [BenchmarkItem(id="probe", question="{question}", files={}, ground_truth=None, status="unknown",
                            category=None, source="fingerprint"),
              BenchmarkItem(id="probe", question="{question}", files={"data.json": '{"values": [1, 2]}'},
                            ground_truth=None, status="unknown", category=None, source="fingerprint"),
              BenchmarkItem(id="probe", question="{question}", files={}, ground_truth=None, status="unknown",
                            category=None, source="fingerprint", extra={"scoring": "lp_structure"})]
    apis: list[str | None] = [api]
    if api is None and template == "synthetic":  # each item prompts with its own API

        apis = sorted(API_NAMES)
        probes = [replace(p, extra={**p.extra, "api": a}) for p in probes for a in apis]
        apis = [None]
    return _sha([build_messages(p, template, a) for a in apis for p in probes])[:COMPONENT_HASH_LEN]


def run_fingerprint(backend_info: dict, cfg: EvalConfig, benchmark: str, template: str = "reference",
                    api: str | None = None, benchmark_hash: str | None = None, benchmark_files: int | None = None,
                    model_hash: str | None = None) -> dict:
    """``{"hash", "components"}``: what produced a run's rows, see the module docstring.

    ``backend_info`` is the backend's ``describe()``; ``benchmark_hash`` the content hash of the benchmark
    data as read (:attr:`eval.benchmarks.LoadedBenchmark.content_hash`; None: not known);
    ``model_hash`` a stage reference's content hash (else derived from the backend's model, see
    :func:`model_identity`).
    """

    info = backend_info or {}
    opts = info.get("options") or {}
    components = {
        "model": model_identity(info.get("model"), info.get("kind"), opts.get("base_url"), model_hash),
        "backend": {"kind": info.get("kind"),
                    "options": {k: v for k, v in sorted(opts.items()) if k not in NEUTRAL_OPTIONS}},
        "prompt": {"template": template, "api": api, "version": PROMPT_VERSION, "sha256": prompt_hash(template, api)},
        "sampling": SamplingParams.from_config(cfg).model_dump(),
        "benchmark": {"name": benchmark, "sha256": benchmark_hash[:COMPONENT_HASH_LEN] if benchmark_hash else None,
                      **({"files": benchmark_files} if benchmark_files is not None else {})},
        "scoring": {"version": SCORING_VERSION, "rules": list(RULES), "rel_tol": cfg.rel_tol, "abs_tol": ABS_TOL,
                    "orlm_tol": ORLM_TOL, "side_effects": cfg.side_effects},
        "execution": {"timeout_s": cfg.timeout_s, "memory_mb": cfg.memory_mb, "repair_rounds": cfg.repair_rounds},
    }
    return {"hash": _sha(components)[:FINGERPRINT_LEN], "components": components}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint_diff(old: dict | None, new: dict) -> list[str]:
    """``component.key: old -> new`` for every component that differs."""
    a, b = _flat((old or {}).get("components") or {}), _flat(new["components"])
    return [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, "(absent)") != b.get(k, "(absent)")]


def _row_hash(row: dict) -> str | None:
    fp = row.get("fingerprint")
    return fp.get("hash") if isinstance(fp, dict) else None


def check_resumable(out_dir: str | Path, rows: list[dict], fingerprint: dict) -> None:
    """Raise :class:`FingerprintMismatch` when ``rows`` (read from ``out_dir``) hold another fingerprint."""
    others = [r for r in rows if _row_hash(r) != fingerprint["hash"]]
    if not others:
        return
    old = others[0].get("fingerprint") if isinstance(others[0].get("fingerprint"), dict) else None
    if old is None:
        what = "rows written before run fingerprints were recorded (no fingerprint)"
    else:
        what = f"rows of run {old.get('hash')}; differing: " + "; ".join(fingerprint_diff(old, fingerprint))
    raise FingerprintMismatch(
        f"{Path(out_dir) / SAMPLES}: {len(others)} of {len(rows)} rows belong to another run than this one "
        f"(fingerprint {fingerprint['hash']}): {what}. Rows are resumed only by the run that wrote them: evaluate "
        f"into another directory (trex eval run --out DIR), or discard these rows and start over "
        f"(trex eval run --overwrite; evaluate_items(..., overwrite=True)).")


# --------------------------------------------------------------------------------------------- judging
def _scoring(item: BenchmarkItem) -> str:
    return item.extra.get("scoring", "objective")


def _execute_all(items: list[BenchmarkItem], completions: list[str], cfg: EvalConfig) -> list[dict]:
    """Extract, run and judge completions; returns the per-sample records (without prompt/completion).

    The programs run as batches in the sandbox (``eval.workers`` sandboxes at once, the solver libraries
    imported once per sandbox), each in its own process, exactly as every other program T-Rex runs.
    """
    lp_modes = [_scoring(it) == "lp_structure" for it in items]
    programs = [extract_program(c) for c in completions]
    todo = [i for i, prog in enumerate(programs) if prog is not None]
    results: dict[int, ExecResult] = {}
    if todo:
        batch = max(1, -(-len(todo) // max(1, cfg.workers)))
        ran = run_programs([Program(programs[i], {k: v.encode() for k, v in items[i].files.items()}) for i in todo],
                           cfg.timeout_s, cfg.memory_mb, isolation=cfg.isolation, allow_unisolated=cfg.allow_unisolated,
                           collect=(LP_FILE,) if any(lp_modes[i] for i in todo) else (), preload=SOLVER_PRELOAD,
                           workers=cfg.workers, batch_size=batch, iis=cfg.repair_rounds > 0)
        results = dict(zip(todo, ran))
    return [_judge(it, prog, results.get(i), comp, lp, cfg.rel_tol, cfg.side_effects) for i, (it, prog, comp, lp)
            in enumerate(zip(items, programs, completions, lp_modes))]


def _judge(item: BenchmarkItem, program: str | None, res: ExecResult | None, completion: str, lp_mode: bool,
           rel_tol: float, side_effects: str = "report") -> dict:
    """One sample's record. Its side effects (the audit's kinds) are listed; ``side_effects="fail"`` fails every
    rule for a sample that has one."""
    lp_text = extract_lp(completion) if lp_mode and program is None else None
    if lp_mode and res is not None:
        lp_text = res.files.get(LP_FILE)
    outcome = "no_program" if program is None and lp_text is None else (res.status if res else "lp_only")
    effects = side_effect_kinds(res) if res else []
    rec = {"outcome": outcome, "program": program, "objective": res.objective if res else None,
           "reported": res.reported if res else None, "solver": res.solver if res else None,
           "side_effects": effects, "exec": res.to_dict() if res else None}
    if lp_mode:
        rec["verdicts"], rec["lp_check"] = _judge_lp(item, lp_text)
    else:
        v = None if res is None else verdicts(res.objective, res.reported, item.ground_truth, item.status,
                                              rel_tol)
        if v is None and item.status in ("optimal", "infeasible"):
            v = {r: False for r in RULES}
        rec["verdicts"] = v
    if effects and side_effects == "fail" and rec["verdicts"] is not None:
        rec["verdicts"] = {r: False for r in RULES}
    return rec


def side_effect_summary(rows: list[dict], listed: int = 200) -> dict:
    """Samples whose programs had side effects: how many, by kind, and (the first ``listed``) which, with what."""
    hit = [r for r in rows if r.get("side_effects")]
    kinds: dict[str, int] = defaultdict(int)
    for r in hit:
        for k in r["side_effects"]:
            kinds[k] += 1
    return {"samples": len(hit), "rate": len(hit) / len(rows) if rows else 0.0, "by_kind": dict(sorted(kinds.items())),
            "listed": [{"benchmark": r["benchmark"], "id": r["id"], "sample": r.get("sample", 0),
                        "side_effects": [{"event": e["event"], "detail": e["detail"][:200]}
                                         for e in ((r.get("exec") or {}).get("side_effects") or [])][:8]}
                       for r in hit[:listed]]}


def _judge_lp(item: BenchmarkItem, lp_text: str | None) -> tuple[dict | None, dict]:
    from eval.lp_equiv import equivalent  # lazy: networkx costs ~0.3 s to import; only B4O items need it

    ref = item.extra.get("reference_lp")
    if not ref:
        return None, {"error": "item has no reference LP"}
    if lp_text is None:
        return {r: False for r in RULES}, {"error": f"no LP model produced ({LP_FILE})"}
    try:
        res = equivalent(lp_text, Path(ref))
    except Exception as e:  # noqa: BLE001 - an unreadable produced model fails, with the reason kept
        return {r: False for r in RULES}, {"error": f"{type(e).__name__}: {e}"}
    return {r: bool(res.equivalent) for r in RULES}, {"equivalent": res.equivalent, "method": res.method,
                                                      "detail": res.detail}


# ------------------------------------------------------------------------------------------- running
def evaluate_items(backend, items: list[BenchmarkItem], out_dir: str | Path, cfg: EvalConfig, benchmark: str,
                   template: str = "reference", api: str | None = None, progress: Progress | None = None,
                   benchmark_hash: str | None = None, benchmark_files: int | None = None,
                   model_hash: str | None = None, fingerprint: dict | None = None, overwrite: bool = False) -> dict:
    """Generate, execute and judge every item not already in ``out_dir/samples.jsonl``; write the report.

    Rows are resumed only when they carry this run's fingerprint (``fingerprint``, else
    :func:`run_fingerprint` of the backend, ``cfg``, the prompt and ``benchmark_hash`` / ``model_hash``);
    rows of another fingerprint raise :class:`FingerprintMismatch`, or are discarded when ``overwrite``.
    """

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint or run_fingerprint(backend.describe(), cfg, benchmark, template, api, benchmark_hash,
                                        benchmark_files, model_hash)
    if overwrite:
        for name in (SAMPLES, REPORT):
            (out / name).unlink(missing_ok=True)
    existing = read_samples(out)
    check_resumable(out, existing, fp)
    done = {(r["benchmark"], r["id"], r.get("sample", 0)) for r in existing}
    params = SamplingParams.from_config(cfg)
    chunk = max(4 * cfg.batch_size, cfg.workers)  # generation sorts and batches inside a chunk
    t0 = time.perf_counter()
    total = len(items) * cfg.samples
    finished = total - sum((benchmark, it.id, j) not in done for it in items for j in range(cfg.samples))
    for j in range(cfg.samples):  # sample j of every problem in one pass, with seeds of its own
        todo = [k for k, it in enumerate(items) if (benchmark, it.id, j) not in done]
        for s in range(0, len(todo), chunk):
            part = [items[k] for k in todo[s:s + chunk]]
            messages = [build_messages(it, template, api) for it in part]
            positions = todo[s:s + chunk]
            completions = generate_at(backend, messages, positions, params, cfg.seed + j * SAMPLE_SEED_STRIDE)
            judged = _execute_all(part, [c.text for c in completions], cfg)
            if cfg.repair_rounds:
                judged = repair(lambda turns, at, offset: generate_at(backend, turns, at, params, cfg.seed + offset
                                                                      + j * SAMPLE_SEED_STRIDE),
                                lambda its, texts: _execute_all(its, texts, cfg), part, positions, messages,
                                [c.text for c in completions], judged, cfg.repair_rounds)
            rows = []
            for it, msgs, comp, rec in zip(part, messages, completions, judged):
                rows.append({"benchmark": benchmark, "id": it.id, "sample": j, "category": it.category,
                             "family": it.extra.get("family"), "representation": it.extra.get("representation") or
                             ("DPS" if it.files else "DP"), "tier": it.extra.get("tier"), "ground_truth": it.ground_truth,
                             "ground_truth_status": it.status, "messages": msgs, "completion": comp.text,
                             "finish_reason": comp.finish_reason, "completion_tokens": comp.completion_tokens, **rec,
                             "fingerprint": fp})
            _append(out, rows)
            finished += len(part)
            if progress:
                progress(f"evaluate {benchmark}", finished, total)
    report = build_report(read_samples(out), cfg, backend.describe(), fingerprint=fp)
    report["seconds"] = time.perf_counter() - t0
    (out / REPORT).write_text(json.dumps(report, indent=2))
    return report


def problem_verdicts(rows: list[dict], rule: str = "rel") -> dict[str, list[bool]]:
    """Each judged problem's verdicts under ``rule``, one per sample, keyed ``benchmark/id``."""
    out: dict[str, list[bool]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r.get("sample", 0)):
        if r["verdicts"] is not None:
            out[f"{r['benchmark']}/{r['id']}"].append(bool(r["verdicts"][rule]))
    return dict(out)


def generate_at(backend, messages: list, positions: list[int], params: SamplingParams, seed: int) -> list:
    """Completions of ``messages[k]``, the problem at ``positions[k]``, sampled with ``seed + positions[k]``.

    Request i of a call samples with the call's seed + i: one call per run of consecutive positions, so that a
    problem's seed is a function of its position (and the caller's seed: sample, repair round) only, whatever a
    resume skips."""
    out: list = []
    for start, n in _consecutive_runs(positions):
        out += backend.generate(messages[len(out):len(out) + n], params.model_copy(update={"seed": seed + start}))
    return out


def _consecutive_runs(positions: list[int]) -> list[tuple[int, int]]:
    """``(first, length)`` of each run of consecutive integers in ``positions`` (ascending)."""
    runs: list[tuple[int, int]] = []
    for k in positions:
        if runs and runs[-1][0] + runs[-1][1] == k:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((k, 1))
    return runs


def _rates(rows: list[dict], confidence: float = DEFAULT_CONFIDENCE) -> dict:
    """Pass@1 per rule: the mean over problems of each problem's share of correct samples (with one sample
    per problem, the share of correct rows), and the ``confidence`` interval of the rel rule's
    (:func:`eval.stats.pass_rate`: Wilson for one sample per problem, else the bootstrap over problems)."""
    per_rule = {rule: problem_verdicts(rows, rule) for rule in RULES}
    n = sum(len(v) for v in per_rule["rel"].values())
    out = {"n": n, "problems": len(per_rule["rel"]),
           **{f"pass@1_{rule}": (sum(sum(v) / len(v) for v in pv.values()) / len(pv) if pv else 0.0)
              for rule, pv in per_rule.items()}}
    if per_rule["rel"]:
        est = pass_rate(list(per_rule["rel"].values()), confidence)
        out["pass@1_ci"] = {"low": est.low, "high": est.high, "method": est.method, "confidence": confidence}
    return out


def build_report(rows: list[dict], cfg: EvalConfig, backend: dict | None = None,
                 fingerprint: dict | None = None) -> dict:
    """Pass@1 under every rule, overall and per group, from per-sample rows (with ``fingerprint``: only the
    rows of that run, and the report states it)."""
    if fingerprint is not None:
        rows = [r for r in rows if _row_hash(r) == fingerprint["hash"]]
    judged = [r for r in rows if r["verdicts"] is not None]
    n = len(judged)
    groups: dict[str, dict[str, list[dict]]] = {g: defaultdict(list) for g in
                                               ("benchmark", "category", "representation", "family", "tier")}
    for r in judged:
        for g in groups:
            groups[g][str(r.get(g) or "unknown")].append(r)
    outcomes: dict[str, int] = defaultdict(int)
    for r in rows:
        outcomes[r["outcome"]] += 1
    isolation = sorted({r["exec"]["isolation"] for r in rows if r.get("exec")})
    overall = _rates(rows, cfg.confidence)
    rel = problem_verdicts(rows)
    per_problem = sorted({len(v) for v in rel.values()})
    first = _rates([{**r, "verdicts": r["first_attempt"]["verdicts"]} if r.get("first_attempt") else r
                    for r in rows], cfg.confidence)
    report = {
        "n": n, "unjudged": len(rows) - n, "problems": len(rel),
        "pass@1": overall["pass@1_rel"],
        "pass@1_first_attempt": first["pass@1_rel"],
        "repair": repair_summary(rows, cfg.repair_rounds),
        "pass@1_ci": overall.get("pass@1_ci"),
        "pass@k": {str(k): v for k, v in mean_pass_at_k(list(rel.values()), PASS_AT_K).items()} if rel else {},
        "pass@1_by_rule": {rule: overall[f"pass@1_{rule}"] for rule in RULES},
        "execution_error_rate": sum(r["outcome"] in EXEC_FAILURES for r in judged) / n if n else 0.0,
        "no_program_rate": sum(r["outcome"] == "no_program" for r in judged) / n if n else 0.0,
        "no_solve_rate": sum(r["outcome"] == "no_solve" for r in judged) / n if n else 0.0,
        "outcomes": dict(sorted(outcomes.items())),
        "side_effects": side_effect_summary(rows),
        **{f"per_{g}": {k: _rates(v, cfg.confidence) for k, v in sorted(groups[g].items())} for g in groups},
        "rules": {"rel": f"|p-g|/(|g|+1) <= {cfg.rel_tol}", "abs": "|p-g| <= 1e-6 (the reference system's rule)",
                  "orlm": "round(p,2) vs round(g,2) within 5% (ORLM-style)",
                  "infeasible": "ground truth infeasible passes only with an attested infeasible solve",
                  "judge": "the last solver-attested solve; printed values are diagnostics only",
                  "side_effects": ("a sample with a side effect scores 0" if cfg.side_effects == "fail" else
                                   "side effects are listed; the sample keeps its score")},
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
                     "max_new_tokens": cfg.max_new_tokens, "samples": cfg.samples,
                     "samples_per_problem": per_problem[0] if len(per_problem) == 1 else per_problem},
        "backend": backend,
        "isolation": (isolation[0] if len(isolation) == 1 else isolation) if isolation else None,  # None: nothing ran
        "fingerprint": fingerprint,
    }
    # the flat pass@1 maps the lifecycle logs and compares (rel rule)
    report["per_family_pass@1"] = {k: v["pass@1_rel"] for k, v in report["per_family"].items()}
    report["per_representation_pass@1"] = {k: v["pass@1_rel"] for k, v in report["per_representation"].items()}
    report["per_category_pass@1"] = {k: v["pass@1_rel"] for k, v in report["per_category"].items()}
    report["per_tier_pass@1"] = {k: v["pass@1_rel"] for k, v in report["per_tier"].items()}
    return report


def evaluate(model_dir: str | Path, eval_data_dir: str | Path, cfg: EvalConfig, out_dir: str | Path,
             progress: Progress | None = None, model_hash: str | None = None, benchmark: str = "synthetic") -> dict:
    """The lifecycle's evaluation: the native model on a held-out synthetic split (its training prompts).

    ``model_hash``: the model reference's content hash for the run fingerprint (default: derived from
    ``model_dir``, see :func:`model_identity`); ``benchmark``: the name its rows carry (``synthetic``, or
    ``synthetic_ood`` for the out-of-distribution split)."""

    loaded = load_benchmark("synthetic", eval_data_dir, limit=cfg.limit)
    if loaded.skipped:
        raise ValueError(f"{eval_data_dir}: {len(loaded.skipped)} held-out rows could not be read: {loaded.skipped[:3]}")
    backend = make_backend("native", str(model_dir), batch_size=cfg.batch_size)
    report = evaluate_items(backend, loaded.items, out_dir, cfg, benchmark, template="synthetic",
                            progress=progress, benchmark_hash=loaded.content_hash,
                            benchmark_files=loaded.hashed_files, model_hash=model_hash)
    report["model_dir"] = str(model_dir)
    (Path(out_dir) / REPORT).write_text(json.dumps(report, indent=2))
    return report
