"""Self-distillation (optional stage): verified answers with reasoning, sampled from an endpoint.

For every SFT instance, ``k`` answers are sampled (``data.llm.distill``: temperature, top_p, max_tokens) with the
reference prompt (:func:`eval.prompts.reference_messages`: ``<think>`` reasoning, the ``<model>``, the
``<python>`` program, in the instance's solver API and with its data files). Every answer's program is executed
in the sandbox and judged by its attested solve against the instance's optimum (rejection sampling,
:func:`ordata.llm.judge.judge_programs`). A sample is **accepted** when its program is correct, the answer was
not cut off (``answer_truncated``) and it has its reasoning and model (``missing_think``, ``missing_model``); a
reasoning server's separate ``reasoning_content`` counts as ``<think>``.

Among several accepted samples, ``select: shortest`` keeps the one with the fewest characters (ties: the
earliest sample) -- the concise answer teaches the same model with fewer tokens; ``first`` keeps the earliest.
The instance's SFT answer is then built from its parts in the instance's answer style (``ordata/render.py``)
and marked ``answer_source: distilled@<model>``. An instance without an accepted sample keeps its template answer
(``on_failure: template``) or leaves the SFT set (``drop``).

Accounting: ``distill`` (instances: ``kept`` = distilled, rejected ``distill_no_accepted_sample``, with the
fallback counted) and ``distill_samples`` (``in`` = instances x k, ``kept`` = accepted, rejected by reason).
Pass rates (correct programs / samples) are reported per family x category x representation.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable

from eval.extract import extract_program
from ordata.instances import Instances, account, read_instances, write_instances
from ordata.llm.client import Ask, LLMClient, Reply, Usage, failure, request_seed
from ordata.llm.judge import judge_programs, model_messages
from trex.core.config import DataConfig, LLMBudget

Progress = Callable[[str, int, int], None]
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_MODEL = re.compile(r"<model>(.*?)</model>", re.DOTALL)


def parts(text: str) -> dict:
    """The reasoning, the model and the program of an answer ('' or None where absent). A completion that starts
    inside the reasoning (the chat template opened ``<think>``) has its reasoning before the first ``</think>``."""
    think = _THINK.search(text)
    reasoning = think.group(1) if think else (text.split("</think>", 1)[0] if "</think>" in text else "")
    model = _MODEL.findall(text)
    return {"think": reasoning.strip(), "model": model[-1].strip() if model else "", "program": extract_program(text)}


def sample_reason(reply: Reply, p: dict | None, program_reason: str | None) -> str | None:
    """Why a sample is not accepted (None: accepted), in the order the checks are reported."""
    if not reply.ok:
        return failure(reply)
    if p["program"] is None:
        return "no_program"
    if program_reason:
        return program_reason
    if reply.finish_reason == "length":
        return "answer_truncated"
    if not p["think"]:
        return "missing_think"
    if not p["model"]:
        return "missing_model"
    return None


def cell(row: dict) -> str:
    return f"{row['family']}/{row['category']}/{row['representation']}"


def distill(inst: Instances, cfg: DataConfig, client: LLMClient, progress: Progress | None = None,
            chunk: int = 16) -> Instances:
    """The instances with distilled SFT answers; rejections, accounting, pass rates and usage added."""
    stage = cfg.llm.distill
    usage = Usage(LLMBudget(max_requests=stage.max_requests, max_completion_tokens=stage.max_completion_tokens))
    rows = {split: [dict(r) for r in rs] for split, rs in inst.rows.items()}
    sft, keep = rows.get("sft", []), []
    rejections = []
    stats = defaultdict(Counter)
    for s in range(0, len(sft), chunk):
        part = sft[s:s + chunk]
        asks = [Ask(model_messages(r, r["question"]), stage.temperature, stage.top_p, stage.max_tokens,
                    request_seed(cfg.seed, r["id"], "distill") + j) for r in part for j in range(stage.k)]
        replies = client.ask(asks, usage)
        pieces = [parts(r.text) if r.ok else None for r in replies]
        verdicts = judge_programs([p["program"] if p else None for p in pieces],
                                  [r for r in part for _ in range(stage.k)], cfg)
        for n, row in enumerate(part):
            accepted = []
            for j in range(stage.k):
                m = n * stage.k + j
                reply, p, v = replies[m], pieces[m], verdicts[m]
                reason = sample_reason(reply, p, v.reason if reply.ok and p["program"] is not None else None)
                st = stats[cell(row)]
                st["samples"] += 1
                st["correct"] += reply.ok and p["program"] is not None and v.reason is None
                if reason is None:
                    st["accepted"] += 1
                    accepted.append((len(reply.text), j, reply, p, v))
                    continue
                detail = reply.error if reason.startswith("llm_") else v.detail if reason.startswith("program_") \
                    else reason
                rejections.append({"id": row["id"], "family": row["family"], "sample": j, "stage": "distill_samples",
                                   "reason": reason, "model": reply.model, "detail": (detail or "")[:500]})
            stats[cell(row)]["problems"] += 1
            if accepted:
                _, j, reply, p, v = min(accepted, key=lambda a: a[:2] if stage.select == "shortest" else (a[1],))
                row.update(distilled={**p, "sample": j, "objective": v.objective, "reported": v.reported},
                           answer_source=f"distilled@{reply.model}")
                stats[cell(row)]["distilled"] += 1
                keep.append(row)
                continue
            reason = "distill_no_accepted_sample"
            rejections.append({"id": row["id"], "family": row["family"], "stage": "distill", "reason": reason,
                               "fallback": stage.on_failure})
            if stage.on_failure == "template":
                keep.append(row)
        if progress:
            progress("distill", min(s + chunk, len(sft)), len(sft))
    if "sft" in rows:
        rows["sft"] = keep
    distilled = sum(c["distilled"] for c in stats.values())
    failed = len(sft) - distilled
    accounting = {**inst.accounting,
                  "distill": account(len(sft), distilled, rejections, "distill",
                                     fallback_template=failed if stage.on_failure == "template" else 0,
                                     dropped=failed if stage.on_failure == "drop" else 0),
                  "distill_samples": account(len(sft) * stage.k, sum(c["accepted"] for c in stats.values()),
                                             rejections, "distill_samples")}
    llm = {**inst.llm, "distill": {"usage": usage.to_dict(), "report": pass_rates(stats, stage.k)}}
    return Instances(rows, inst.rejections + rejections, accounting, llm, inst.generated)


def pass_rates(stats: dict, k: int) -> dict:
    """Per family/category/representation and overall: problems, samples, correct programs, accepted samples,
    problems distilled, ``pass_rate`` (correct / samples) and ``accept_rate`` (accepted / samples)."""
    def rates(c: Counter) -> dict:
        out = {key: int(c[key]) for key in ("problems", "samples", "correct", "accepted", "distilled")}
        out["pass_rate"] = c["correct"] / c["samples"] if c["samples"] else 0.0
        out["accept_rate"] = c["accepted"] / c["samples"] if c["samples"] else 0.0
        return out

    total = sum(stats.values(), Counter())
    return {"k": k, "overall": rates(total), "per_cell": {c: rates(v) for c, v in sorted(stats.items())},
            "rule": "pass_rate = samples whose program's attested solve reproduced the optimum / samples"}


def distill_stage(cfg: DataConfig, src: str | Path, out: str | Path, cache_dir: str | Path,
                  progress: Progress | None = None) -> dict:
    """The distillation stage between two instance directories; returns the manifest info."""
    with LLMClient(cfg.llm.endpoints, cache_dir) as client:
        return write_instances(distill(read_instances(src), cfg, client, progress), Path(out))

