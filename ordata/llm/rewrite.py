"""Rewrite (optional stage): an endpoint paraphrases rendered problems into natural, varied wording.

For every instance of ``data.llm.rewrite.splits`` (SFT, CPT, the out-of-distribution held-out split; never the
in-distribution one), in the representation it was rendered in (DP / DT / DPS, :func:`eval.prompts.rewrite_messages`):

1. the rewrite is kept only if its text passes :func:`ordata.llm.judge.check_rewrite` (every number still
   there as often as before, none added, a DPS problem's file and keys named) and
2. a **forward-modelling check** passes: the endpoint models the rewritten text into a program (the reference
   prompt, the row's solver API and data files), which, executed in the sandbox, must reach the instance's
   optimum by an attested solve (:func:`ordata.llm.judge.judge_programs`).
3. A rewrite that fails either gets **one repair attempt** (``data.llm.rewrite.repair``): the error is fed back
   in the same conversation (the rewrite's, for a text check; the program's, for the forward check -- without
   the optimum), and the repaired answer is checked again (a repaired rewrite still has to pass the forward check).

A rejected rewrite leaves the instance with its template wording; the reason is recorded (``rewrite_*``,
``forward_<program reason>``, ``llm_error``, ``llm_budget_exhausted``). Accounting: ``in`` = instances offered,
``kept`` = rewritten, ``rejected`` by reason.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eval.extract import extract_program
from eval.prompts import PROGRAM_REPAIR, REWRITE_REPAIR, rewrite_messages
from ordata.instances import Instances, account, read_instances, write_instances
from ordata.llm.client import Ask, LLMClient, Reply, Usage, failure, request_seed
from ordata.llm.judge import check_rewrite, extract_problem, judge_programs, model_messages
from trex.core.config import DataConfig, LLMBudget

Progress = Callable[[str, int, int], None]


@dataclass
class _Try:
    """One instance going through the rewrite: the current text and, once decided, why it is not kept."""

    row: dict
    text: str = ""
    model: str | None = None
    reason: str | None = None
    detail: str = ""
    repaired: str | None = None  # the step its one repair turn went to: "rewrite" or "forward"
    history: list[str] = field(default_factory=list)

    def fail(self, reason: str, detail: str) -> None:
        self.reason, self.detail = reason, detail
        self.history.append(f"{reason}: {detail}"[:500])


class Rewriter:
    """Rewrites a chunk of instances: rewrite requests, text checks, their repairs, forward models, their repairs."""

    def __init__(self, cfg: DataConfig, client: LLMClient, usage: Usage):
        self.cfg, self.stage, self.client, self.usage = cfg, cfg.llm.rewrite, client, usage

    def _ask(self, messages: list[dict], row: dict, purpose: str, forward: bool = False) -> Ask:
        s = self.stage
        return Ask(messages, s.forward_temperature if forward else s.temperature, s.top_p,
                   s.forward_max_tokens if forward else s.max_tokens, request_seed(self.cfg.seed, row["id"], purpose))

    def _text_check(self, t: _Try, reply: Reply) -> None:
        if not reply.ok:
            t.fail(failure(reply), reply.error or "")
            return
        t.text, t.model = extract_problem(reply.text), reply.model
        bad = check_rewrite(t.row["question"], t.text, t.row["representation"], json.loads(t.row["files"]))
        if bad:
            t.fail(*bad)
        else:
            t.reason = None

    def run(self, rows: list[dict]) -> list[_Try]:
        tries = [_Try(r) for r in rows]
        first = [rewrite_messages(r["question"], r["representation"]) for r in rows]
        replies = self.client.ask([self._ask(m, r, "rewrite") for m, r in zip(first, rows)], self.usage)
        for t, reply in zip(tries, replies):
            self._text_check(t, reply)
        if self.stage.repair:  # one repair of a rewrite whose text failed its checks
            todo = [k for k, t in enumerate(tries) if t.reason and t.reason.startswith("rewrite_")]
            asks = [self._ask(first[k] + [{"role": "assistant", "content": replies[k].text},
                                          {"role": "user", "content": REWRITE_REPAIR.format(problem=tries[k].detail)}],
                              rows[k], "rewrite-repair") for k in todo]
            for k, reply in zip(todo, self.client.ask(asks, self.usage)):
                tries[k].repaired = "rewrite"
                self._text_check(tries[k], reply)
        self._forward([t for t in tries if t.reason is None])
        return tries

    def _forward(self, tries: list[_Try]) -> None:
        msgs = [model_messages(t.row, t.text) for t in tries]
        replies = self.client.ask([self._ask(m, t.row, "forward", True) for m, t in zip(msgs, tries)], self.usage)
        verdicts = self._judge(tries, replies)
        if not self.stage.repair:
            return
        todo = [k for k, (t, v) in enumerate(zip(tries, verdicts)) if t.reason and t.repaired is None and v is not None]
        asks = [self._ask(msgs[k] + [{"role": "assistant", "content": replies[k].text},
                                     {"role": "user", "content": PROGRAM_REPAIR.format(problem=verdicts[k].feedback)}],
                          tries[k].row, "forward-repair", True) for k in todo]
        again = self.client.ask(asks, self.usage)
        for k in todo:
            tries[k].repaired = "forward"
        self._judge([tries[k] for k in todo], again)

    def _judge(self, tries: list[_Try], replies: list[Reply]) -> list:
        """Judge each forward answer's program; returns its verdict (None where the endpoint gave no answer)."""
        programs = [extract_program(r.text) if r.ok else None for r in replies]
        verdicts = judge_programs(programs, [t.row for t in tries], self.cfg)
        out = []
        for t, reply, v in zip(tries, replies, verdicts):
            if not reply.ok:
                t.fail(failure(reply), f"forward model: {reply.error}")
                out.append(None)
                continue
            if v.reason:
                t.fail(f"forward_{v.reason}", v.detail)
            else:
                t.reason = None
            out.append(v)
        return out


def rewrite(inst: Instances, cfg: DataConfig, client: LLMClient, progress: Progress | None = None,
            chunk: int = 64) -> Instances:
    """The instances with the rewrites that passed; rejections, accounting and usage added (see the module docstring)."""
    stage = cfg.llm.rewrite
    usage = Usage(LLMBudget(max_requests=stage.max_requests, max_completion_tokens=stage.max_completion_tokens))
    rows = {split: [dict(r) for r in rs] for split, rs in inst.rows.items()}
    targets = [(split, r) for split in stage.splits for r in rows.get(split, [])]
    rewriter = Rewriter(cfg, client, usage)
    rejections, kept = [], Counter()
    repairs = {"rewrite": Counter(), "forward": Counter()}
    for s in range(0, len(targets), chunk):
        part = targets[s:s + chunk]
        for (split, row), t in zip(part, rewriter.run([r for _, r in part])):
            if t.repaired:
                repairs[t.repaired]["tried"] += 1
                repairs[t.repaired]["fixed"] += t.reason is None
            if t.reason is None:
                row.update(template_question=row["question"], question=t.text, question_source=f"rewrite@{t.model}")
                kept[split] += 1
                continue
            rejections.append({"id": row["id"], "family": row["family"], "split": split, "stage": "rewrite",
                               "reason": t.reason, "detail": t.detail[:1000], "repaired": t.repaired,
                               "history": t.history})
        if progress:
            progress("rewrite", min(s + chunk, len(targets)), len(targets))
    accounting = {**inst.accounting, "rewrite": account(len(targets), sum(kept.values()), rejections, "rewrite")}
    offered = Counter(split for split, _ in targets)
    report = {"per_split": {sp: {"in": offered[sp], "kept": kept[sp]} for sp in offered},
              "repairs": {k: dict(v) for k, v in repairs.items()},
              "models": dict(Counter(r["question_source"] for rs in rows.values() for r in rs
                                     if r.get("question_source", "").startswith("rewrite@")))}
    llm = {**inst.llm, "rewrite": {"usage": usage.to_dict(), "report": report}}
    return Instances(rows, inst.rejections + rejections, accounting, llm, inst.generated)


def rewrite_stage(cfg: DataConfig, src: str | Path, out: str | Path, cache_dir: str | Path,
                  progress: Progress | None = None) -> dict:
    """The rewrite stage between two instance directories; returns the manifest info."""
    with LLMClient(cfg.llm.endpoints, cache_dir) as client:
        return write_instances(rewrite(read_instances(src), cfg, client, progress), Path(out))
