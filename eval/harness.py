"""Zero-shot Pass@1 on held-out OR problems by executing the model's solver program.

For each problem: chat prompt -> generation (native backend) -> last fenced Python block ->
sandboxed execution (:mod:`eval.sandbox`) -> the printed optimum compared with the ground truth
(|p-g|/(|g|+1) <= rel_tol), or, for a problem with no feasible solution, "infeasible" reported. Writes ``samples.jsonl`` (one line per problem) and ``report.json``
(Pass@1 overall and per family/category, execution-error rate, sampling parameters).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from eval.extract import extract_program
from eval.sandbox import ExecResult, run_program
from trex.config import EvalConfig

Progress = Callable[[str, int, int], None]


def is_pass(pred: float | None, truth: float, rel_tol: float) -> bool:
    return pred is not None and abs(pred - truth) / (abs(truth) + 1.0) <= rel_tol


def is_correct(objective: float | None, reported: str | None, truth: float | None, truth_status: str,
               rel_tol: float) -> bool:
    """An optimal problem needs the optimum within ``rel_tol``; an infeasible one needs 'infeasible' reported."""
    if truth_status == "infeasible":
        return reported == "infeasible"
    return reported == "optimal" and truth is not None and is_pass(objective, truth, rel_tol)


def load_problems(eval_data_dir: str | Path, limit: int | None = None) -> list[dict]:
    import datasets

    path = Path(eval_data_dir)
    if not (path / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{path}: not a held-out eval dataset (no dataset_info.json)")
    rows = datasets.load_from_disk(str(path)).to_list()
    return rows[:limit] if limit else rows


def generate_answers(model_dir: str | Path, problems: list[dict], cfg: EvalConfig,
                     progress: Progress | None = None) -> list[str]:
    """Completions of the native model for each problem's chat prompt."""
    from ordata.curate import SYSTEM_PROMPT, user_prompt
    from trainer.export import load_export
    from trainer.generate import generate
    from trainer.tokenizer import ChatTokenizer

    model = load_export(model_dir)
    tok = ChatTokenizer(model_dir)
    prompts = [tok.encode_chat([{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": user_prompt(p["question"], p.get("api", "highspy"))}],
                               add_generation_prompt=True)[0] for p in problems]
    # sort by length so batches pad little; restore order afterwards
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    completions: list[str] = [""] * len(prompts)
    for s in range(0, len(order), cfg.batch_size):
        chunk = order[s:s + cfg.batch_size]
        outs = generate(model, [prompts[i] for i in chunk], cfg.max_new_tokens, {tok.end_id, tok.eos_id},
                        tok.pad_id, cfg.temperature, cfg.top_p, cfg.seed + s)
        for i, o in zip(chunk, outs):
            completions[i] = tok.decode(o)
        if progress:
            progress("generate", min(s + cfg.batch_size, len(order)), len(order))
    return completions


def score(problems: list[dict], completions: list[str], cfg: EvalConfig, out_dir: str | Path,
          progress: Progress | None = None) -> dict:
    """Execute every extracted program, judge it and write samples.jsonl + report.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    programs = [extract_program(c) for c in completions]
    done = 0

    def run(i: int) -> ExecResult | None:
        nonlocal done
        files = {k: v.encode() for k, v in json.loads(problems[i].get("files") or "{}").items()}
        res = None if programs[i] is None else run_program(programs[i], cfg.timeout_s, cfg.memory_mb, files)
        done += 1
        if progress:
            progress("execute", done, len(programs))
        return res

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=cfg.workers) as pool:
        results = list(pool.map(run, range(len(programs))))
    exec_seconds = time.perf_counter() - t0

    groups: dict[str, dict[str, list[int]]] = {"family": defaultdict(list), "category": defaultdict(list),
                                               "representation": defaultdict(list)}
    samples, passes, errors = [], 0, 0
    isolation = None
    for p, comp, prog, res in zip(problems, completions, programs, results):
        if res is None:
            outcome = "no_program"
        else:
            outcome = res.status
            isolation = res.isolation
        ok = res is not None and is_correct(res.objective, res.reported, p["objective"], p.get("status", "optimal"),
                                            cfg.rel_tol)
        passes += ok
        errors += outcome not in ("ok", "no_solve", "no_program")
        for g in groups:
            groups[g][p.get(g, "DP")].append(int(ok))
        samples.append({"id": p["id"], "family": p["family"], "category": p["category"], "question": p["question"],
                        "completion": comp, "program": prog, "outcome": outcome,
                        "objective": None if res is None else res.objective,
                        "reported": None if res is None else res.reported, "ground_truth": p["objective"],
                        "ground_truth_status": p.get("status", "optimal"),
                        "pass": ok, "exec": None if res is None else res.to_dict()})
    n = len(problems)
    report = {
        "n": n,
        "pass@1": passes / n if n else 0.0,
        "execution_error_rate": errors / n if n else 0.0,
        "no_program_rate": sum(s["outcome"] == "no_program" for s in samples) / n if n else 0.0,
        "per_family": {k: sum(v) / len(v) for k, v in sorted(groups["family"].items())},
        "per_category": {k: sum(v) / len(v) for k, v in sorted(groups["category"].items())},
        "per_representation": {k: sum(v) / len(v) for k, v in sorted(groups["representation"].items())},
        "rule": f"|p-g|/(|g|+1) <= {cfg.rel_tol}; infeasible problems: the program reports infeasible",
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
                     "max_new_tokens": cfg.max_new_tokens, "samples": 1},
        "isolation": isolation,
        "exec_seconds": exec_seconds,
    }
    with open(out / "samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def evaluate(model_dir: str | Path, eval_data_dir: str | Path, cfg: EvalConfig, out_dir: str | Path,
             progress: Progress | None = None) -> dict:
    problems = load_problems(eval_data_dir, cfg.limit)
    t0 = time.perf_counter()
    completions = generate_answers(model_dir, problems, cfg, progress)
    gen_seconds = time.perf_counter() - t0
    report = score(problems, completions, cfg, out_dir, progress)
    report["generate_seconds"] = gen_seconds
    report["model_dir"] = str(model_dir)
    (Path(out_dir) / "report.json").write_text(json.dumps(report, indent=2))
    return report
