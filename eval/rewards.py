"""The RL stage's reward: the model's program run in the attested sandbox, judged as evaluation judges it.

:class:`ProgramReward` is the callable ``tasks/rl.py`` builds and passes to the trainer (``trainer.rollout``
imports nothing of ``eval``): for each sampled answer, the last fenced Python block runs in the sandbox
(:func:`eval.sandbox.run_programs`, ``workers`` sandboxes side by side, one process per program) with the
problem's data files, and

- reward **1** when the last **attested** solve reaches the problem's optimum within ``rel_tol`` (or reports an
  infeasible problem infeasible) and the program did nothing else -- no side effect of the audit
  (:mod:`eval.audit`): a program with one gets **0**, whatever it solved;
- otherwise, for a program that reached a solver (at least one attested solve), the configured partial rewards:
  ``format`` (its answer held a python block), ``executes`` (it also ran to the end without error), ``feasible``
  (the attested solve was optimal, of the wrong value). A program that no solver attested -- one that only prints
  a number, crashes first or times out before solving -- gets 0;
- a timeout, a crash or a limit is a reward, never an exception.
"""

from __future__ import annotations

import json
import math

from eval.extract import extract_program
from eval.sandbox import SOLVER_PRELOAD, Program, rejection_reason, run_programs
from eval.scoring import is_correct


def _truth(value) -> float | None:
    if value in (None, "", "None"):
        return None
    return float(value)


class ProgramReward:
    """``reward(rows, completions) -> [{"reward", "correct", "outcome", "side_effects"}]`` (module docstring).
    ``rows``: the problems (``files`` as JSON text or a dict, ``objective``, ``status``)."""

    def __init__(self, timeout_s: float = 20.0, memory_mb: int = 2048, workers: int = 2, rel_tol: float = 1e-6,
                 isolation: str = "auto", allow_unisolated: bool = False, format_reward: float = 0.0,
                 executes_reward: float = 0.0, feasible_reward: float = 0.0):
        self.timeout_s, self.memory_mb, self.workers, self.rel_tol = timeout_s, memory_mb, workers, rel_tol
        self.isolation, self.allow_unisolated = isolation, allow_unisolated
        self.partial = {"format": format_reward, "executes": executes_reward, "feasible": feasible_reward}

    @classmethod
    def from_config(cls, rl, ev) -> "ProgramReward":
        """From ``train.rl`` (the partial rewards) and ``eval`` (sandbox, limits, tolerance: as evaluation judges)."""
        return cls(ev.timeout_s, ev.memory_mb, ev.workers, ev.rel_tol, ev.isolation, ev.allow_unisolated,
                   rl.reward_format, rl.reward_executes, rl.reward_feasible)

    def __call__(self, rows: list[dict], completions: list[str]) -> list[dict]:
        programs = [extract_program(c) for c in completions]
        todo = [i for i, p in enumerate(programs) if p is not None]
        out = [{"reward": 0.0, "correct": False, "outcome": "no_program", "side_effects": []} for _ in completions]
        if not todo:
            return out
        files = [rows[i]["files"] for i in todo]
        files = [json.loads(f) if isinstance(f, str) else dict(f or {}) for f in files]
        results = run_programs([Program(programs[i], {k: v.encode() for k, v in fs.items()})
                                for i, fs in zip(todo, files)], self.timeout_s, self.memory_mb,
                               isolation=self.isolation, allow_unisolated=self.allow_unisolated,
                               preload=SOLVER_PRELOAD, workers=self.workers,
                               batch_size=max(1, math.ceil(len(todo) / self.workers)), setting="eval.isolation")
        for i, res in zip(todo, results):
            row = rows[i]
            correct = is_correct(res.objective, res.reported, _truth(row.get("objective")), row.get("status") or
                                 "optimal", self.rel_tol)
            reason = rejection_reason(res, correct)
            effects = [e["event"] for e in res.side_effects]
            if reason is None:
                reward = 1.0
            elif effects:
                reward = 0.0
            elif res.solves == 0:
                reward = 0.0
            else:
                reward = (self.partial["format"] + self.partial["executes"] * (res.status == "ok")
                          + self.partial["feasible"] * (res.reported == "optimal"))
            out[i] = {"reward": float(min(reward, 1.0)), "correct": reason is None, "outcome": res.status,
                      "side_effects": effects}
        return out
