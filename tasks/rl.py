"""RL task: the SFT model trained on rollouts rewarded by the attested sandbox (``trainer.entry.train_rl``).

Output (a ``model`` reference, like the train task's): ``checkpoints/`` (DCP steps, each with the rollout in
progress) and ``export/``. The directory is keyed by the inputs and never wiped: an interrupted run resumes from its
newest checkpoint on the same trajectory. Prompts: the SFT split's problems whose answers are programs (their
system + user turns, as evaluation prompts them); the reward: :class:`eval.rewards.ProgramReward`, built here from
``train.rl`` and ``eval`` and handed to the trainer. MLflow: every step's reward, pass rate, dropped groups,
clipping, KL, entropy, lengths, rollout and update tokens/s, the rollout/training log-probability mismatch, the
experts' load; a reward curve.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import datasets
from prefect import task

from eval.rewards import ProgramReward
from tasks.common import TASK_OPTIONS, StageContext, log_data_split, plain, stage_dir, stage_key, stage_result
from tasks.plots import plot_dir, publish_plot
from tasks.progress import stage_progress
from trainer.entry import train_rl
from trainer.rollout import RLPrompt
from trainer.tokenizer import ChatTokenizer
from trex.core.config import EvalConfig, RLConfig
from trex.core.refs import MANIFEST, read_manifest, write_manifest
from trex.tracking.plots import loss_curve
from trex.tracking.runs import start_run

CURVES = ("reward_mean", "pass_rate")


def rl_prompts(data_dir: Path, tok: ChatTokenizer) -> list[RLPrompt]:
    """The SFT split's problems answered by a program: each one's prompt (every turn before the answer, with the
    generation prompt) and what the reward needs (data files, optimum, status)."""
    rows = datasets.load_from_disk(str(data_dir / "sft")).to_list()
    out = []
    for r in rows:
        if r.get("style") in ("math_model", "repair"):  # no program to execute; a repair dialogue's later turns
            continue
        msgs = r["messages"] if isinstance(r["messages"], list) else json.loads(r["messages"])
        ids = tok.encode_chat(msgs[:-1], add_generation_prompt=True)[0]
        out.append(RLPrompt(ids, {"id": r["id"], "files": r["files"], "objective": r["objective"],
                                  "status": r["status"]}))
    if not out:
        raise ValueError(f"{data_dir / 'sft'}: no SFT problem answered by a program to run RL on")
    return out


@task(name="rl", **TASK_OPTIONS)
def rl_task(rl: RLConfig, eval_cfg: EvalConfig, seed: int, init_ref: dict, data_ref: dict, tok_ref: dict,
            ctx: StageContext) -> dict:
    t0 = time.perf_counter()
    for ref, kind in ((init_ref, "model"), (data_ref, "data"), (tok_ref, "tokenizer")):
        read_manifest(ref["path"], kind)
    reward = ProgramReward.from_config(rl, eval_cfg)
    sandbox = {"timeout_s": eval_cfg.timeout_s, "memory_mb": eval_cfg.memory_mb, "rel_tol": eval_cfg.rel_tol,
               "isolation": eval_cfg.isolation}  # what of eval the reward depends on (eval.workers does not)
    key = stage_key(rl=rl, sandbox=sandbox, seed=seed, init=init_ref["hash"], data=data_ref["hash"],
                    tokenizer=tok_ref["hash"])
    out = stage_dir(ctx, "rl", key)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    tok = ChatTokenizer(tok_ref["path"])
    prompts = rl_prompts(Path(data_ref["path"]), tok)
    run = start_run(ctx.tracking, "rl", ctx.parent_run_id, {"stage": "rl"}, resume_key=f"rl:{key}")
    run.params({"rl": plain(rl), "reward_sandbox": sandbox, "seed": seed, "init": init_ref["hash"],
                "data_hash": data_ref["hash"], "tokenizer_hash": tok_ref["hash"], "prompts": len(prompts)})
    log_data_split(run, data_ref, "sft", "training")
    history: dict[str, list[tuple[int, float]]] = {k: [] for k in CURVES}

    def on_log(step: int, m: dict) -> None:
        run.metrics(m, step)
        for k in history:
            if k in m:
                history[k].append((step, float(m[k])))

    with stage_progress("rl") as progress, run.system_metrics(ctx.tracking.get("system_metrics", True)):
        result = train_rl(rl, seed, prompts, reward, out, tok_ref["path"], str(Path(init_ref["path"]) / "export"),
                          {tok.end_id, tok.eos_id}, tok.pad_id, tok.decode, on_log=on_log,
                          on_step=lambda step: progress("steps", step, rl.steps))
    for k in history:  # a resumed run's curve includes the steps logged before the crash
        stored = run.metric_history(k)
        if stored and len(stored) >= len(history[k]):
            history[k] = stored
    if history["reward_mean"]:
        png = loss_curve(history, plot_dir(ctx, out) / "reward_rl.png", "RL: reward and pass rate of the rollouts",
                         ylabel="mean reward / pass rate")
        publish_plot(run, png, "trex-reward-rl", "RL reward curve")
    last = {k: v[-1][1] for k, v in history.items() if v}
    summary = {"steps": result.steps, "resumed_from": result.resumed_from, "skipped_steps": result.skipped_steps,
               "final_reward": last.get("reward_mean"), "final_pass_rate": last.get("pass_rate"),
               "first_reward": history["reward_mean"][0][1] if history["reward_mean"] else None,
               "prompts": len(prompts)}
    ref = write_manifest(out, "model", {"stage": "rl", "summary": summary,
                                        "inputs": {"init": init_ref, "data": data_ref, "tokenizer": tok_ref}})
    run.metrics({k: v for k, v in summary.items() if isinstance(v, (int, float)) and v is not None})
    run.tags({"content_hash": ref["hash"], "output_dir": ref["path"], "checkpoint": result.checkpoint})
    run.finish()
    return stage_result(ref, summary, t0, run.run_id)
