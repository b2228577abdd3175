"""Chaos, measured: SIGKILL a training run at random points, resume, compare with an uninterrupted run.

Single process (``trainer.engines.single.train`` + ``trainer.export.export`` in a child process): ``--kills``
trials, each a fresh run killed once at a point drawn from a seeded RNG -- a random step and a random phase: after
an optimizer step, or inside a synchronous save, inside an asynchronous save (its shards in flight, or
at any point of its publication), or inside the export -- then run again with the same command until it
ends. A trial is *bit-identical* when the resumed run's exported weights equal those of an uninterrupted run
(``torch.equal``, every tensor), the restart resumed from the newest checkpoint that was complete at the
kill, and no torn export was visible after it. The first three trials are always a synchronous save, an
asynchronous save and the export.

Two ranks (``trainer.engines.distributed.train_parallel``, DP2 / FSDP2 over gloo, under ``torchrun``):
``--rank-kills`` trials, each killing one rank (rank and point drawn likewise): the job must fail fast --
the seconds from the kill to the job's exit are measured against the collective timeout (``--pg-timeout``)
-- and a restart must resume from the last complete checkpoint and end bit-identical to an uninterrupted
2-rank run.

The kills use the named points of ``trainer.checkpoint.kill_point`` (``TREX_KILL_AT=<point>@<step>``,
``TREX_KILL_RANK``). Prints one line per trial and ``N/20 bit-identical``.

Usage: ``python bench/chaos.py [--kills 20] [--rank-kills 6] [--seed 0] [--quick] [--json out.json]``
(``trex bench chaos ...``). ``--quick`` is the short version ``make test`` runs: 3 kills (a sync save, an
async save, the export) and one killed rank.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = "CHAOS_RESULT "
# small enough for seconds per run, with every attention type, both MoE routings and an MTP head
MODEL = dict(hidden_size=32, num_layers=3, num_heads=4, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2,
             o_lora_rank=8, sliding_window=16, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                            "heavily_compressed_attention"],
             compress_rate_csa=4, compress_rate_hca=8, index_n_heads=2, index_head_dim=8, index_topk=4,
             mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16, hc_mult=2, max_seq_len=64, mtp_layers=1)
VOCAB, SEQ, SEED = 97, 32, 1
SAVE_POINTS = ("save:staged", "save:written", "save:complete", "save:renamed")
RANK0_POINTS = ("save:complete", "save:renamed", "export:weights")


# ------------------------------------------------------------------------------------------- the children
def _setup(a):
    import torch

    from trainer.data import pack
    from trex.core.config import StageTrainConfig

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(32):
        n = int(torch.randint(4, 20, (1,), generator=g))
        docs.append((torch.randint(0, VOCAB, (n,), generator=g).tolist(), [0] * (n // 2) + [1] * (n - n // 2)))
    data = pack(docs, SEQ, pad_id=0)
    cfg = StageTrainConfig(steps=a.steps, batch_size=4 if a.child == "single" else 8, seq_len=SEQ, lr=3e-3,
                           warmup_steps=2, log_every=a.steps, ckpt_every=a.ckpt_every, keep_last=2,
                           adam_eps=1e-6, optimizer=a.optimizer, async_checkpoint=bool(a.async_ckpt))
    return data, cfg


def child_single(a) -> None:
    """One training run (resuming from ``--ckpt``) and its export, as a stage of the lifecycle does it."""
    from trainer.engines.single import train
    from trainer.export import build_model, export
    from trainer.models.deepseek_v4.args import ModelArgs

    data, cfg = _setup(a)
    model = build_model(ModelArgs(**MODEL), VOCAB, SEED)
    r = train(model, data, cfg, a.ckpt, seed=SEED)
    export(model, a.tok, a.export)
    print(RESULT + json.dumps({"resumed_from": r.resumed_from, "steps": r.steps}), flush=True)


def _forked_single(argv: list[str], env: dict, log: str) -> None:
    """A single-process run in a child forked from the driver (torch and the trainer already imported:
    seconds less per run than a fresh interpreter). The kill is the same SIGKILL of the same process."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    for k in ("TREX_KILL_AT", "TREX_KILL_RANK"):
        os.environ.pop(k, None)
    os.environ.update(env)
    child_single(_parser().parse_args(argv))
    sys.stdout.flush()


def child_rank(a) -> None:
    """One rank of a 2-process DP2 (FSDP2) job: train (resuming), gather, rank 0 exports."""
    import torch.distributed as dist

    from trainer.engines.distributed import gather_full_state, train_parallel
    from trainer.export import build_model, export
    from trainer.models.deepseek_v4.args import ModelArgs
    from trainer.parallel.dims import Layout, exit_rank, init_distributed
    from trex.core.config import ParallelConfig

    data, cfg = _setup(a)
    device = init_distributed("gloo", a.pg_timeout)
    layout = Layout.from_config(ParallelConfig(), dist.get_world_size())
    mcfg = ModelArgs(**MODEL)
    r = train_parallel(build_model(mcfg, VOCAB, SEED), data, cfg, layout, a.ckpt, SEED, device=device)
    full = gather_full_state(r.parts)
    if dist.get_rank() == 0:
        model = build_model(mcfg, VOCAB, SEED)
        model.load_state_dict(full)
        export(model, a.tok, a.export)
        print(RESULT + json.dumps({"resumed_from": r.resumed_from, "steps": r.steps}), flush=True)
    exit_rank()


# ------------------------------------------------------------------------------------------- the driver
def _run(cmd: list[str], env: dict, deadline_s: float) -> dict:
    """Run ``cmd`` in its own process group; the time of the kill line, the exit, the result line. A job
    still running after ``deadline_s`` is killed (``hung``)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    hung = threading.Event()

    def expire() -> None:
        hung.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(deadline_s, expire)
    timer.start()
    t_kill, result, tail = None, None, []
    for line in proc.stdout:
        if line.startswith("TREX_KILL_AT") or "TREX_KILL_AT:" in line:
            t_kill = t_kill or time.monotonic()
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
        tail = (tail + [line.rstrip()])[-40:]
    rc = proc.wait()
    t_end = time.monotonic()
    timer.cancel()
    return {"rc": rc, "result": result, "hung": hung.is_set(), "seconds": t_end - t0,
            "exit_after_kill_s": None if t_kill is None else t_end - t_kill, "tail": tail}


def _run_forked(argv: list[str], env: dict, log: Path, deadline_s: float) -> dict:
    """:func:`_run` for a single-process child forked from this process."""
    import multiprocessing as mp

    t0 = time.monotonic()
    proc = mp.get_context("fork").Process(target=_forked_single, args=(argv, env, str(log)))
    proc.start()
    proc.join(deadline_s)
    hung = proc.is_alive()
    if hung:
        proc.kill()
        proc.join()
    t_end = time.monotonic()
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    result = next((json.loads(x[len(RESULT):]) for x in lines if x.startswith(RESULT)), None)
    killed = any("TREX_KILL_AT:" in x for x in lines)
    return {"rc": proc.exitcode, "result": result, "hung": hung, "seconds": t_end - t0,
            "exit_after_kill_s": 0.0 if killed and proc.exitcode == -signal.SIGKILL else None, "tail": lines[-40:]}


def _weights(export_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(export_dir / "model.safetensors"))


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _export_state(export_dir: Path) -> str:
    """``none``, ``complete`` (config + weights that load) or ``torn``."""
    if not export_dir.exists():
        return "none"
    try:
        json.loads((export_dir / "config.json").read_text())
        _weights(export_dir)
        return "complete"
    except Exception:  # noqa: BLE001 - anything unreadable is torn
        return "torn"


class Chaos:
    def __init__(self, a):
        self.a = a
        self.work = Path(a.out or tempfile.mkdtemp(prefix="trex-chaos-"))
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "tok").mkdir(exist_ok=True)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        for k in ("TREX_KILL_AT", "TREX_KILL_RANK", "TREX_FAULT_RANK", "TREX_FAULT_STEP"):
            self.env.pop(k, None)
            os.environ.pop(k, None)
        self.runs = 0
        import torch

        torch.set_num_threads(1)  # before any op: the forked children start with one thread, no OpenMP pool
        import trainer.export  # noqa: F401 - imported once here, inherited by every forked run
        import trainer.engines.single  # noqa: F401

    def child_args(self, kind: str, run_dir: Path, async_ckpt: bool) -> list[str]:
        a = self.a
        return ["--child", kind, "--ckpt", str(run_dir / "ckpt"), "--export", str(run_dir / "export"),
                "--tok", str(self.work / "tok"), "--steps", str(a.steps), "--ckpt-every", str(a.ckpt_every),
                "--optimizer", a.optimizer, "--async-ckpt", str(int(async_ckpt)), "--pg-timeout", str(a.pg_timeout)]

    def run(self, kind: str, run_dir: Path, async_ckpt: bool, kill: dict) -> dict:
        """One run of ``kind`` in ``run_dir`` (resuming from its checkpoints), with the kill-point variables
        ``kill`` (none: an ordinary run)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        args = self.child_args(kind, run_dir, async_ckpt)
        if kind == "single":
            self.runs += 1
            return _run_forked(args, kill, run_dir / f"log-{self.runs}.txt", self.a.deadline)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--monitor-interval=0.1", str(Path(__file__).resolve()), *args]
        return _run(cmd, {**self.env, **kill}, self.a.deadline)

    def reference(self, kind: str) -> dict:
        d = self.work / f"reference-{kind}"
        r = self.run(kind, d, False, {})
        if r["rc"] != 0:
            raise SystemExit(f"uninterrupted {kind} run failed:\n" + "\n".join(r["tail"]))
        return _weights(d / "export")

    def plan(self, n: int, ranks: bool, rng: random.Random) -> list[dict]:
        """``n`` kill points: (phase, step, async or not, rank); the first three of a single-process plan are
        a synchronous save, an asynchronous save and the export."""
        steps, every = self.a.steps, self.a.ckpt_every
        saves = list(range(every, steps + 1, every)) + ([steps] if steps % every else [])
        inner = [s for s in saves if s != steps] or saves  # async saves (the final one is synchronous)
        out = []
        for i in range(n):
            kind = ["sync-save", "async-save", "export"][i] if not ranks and i < 3 else \
                rng.choice(["step", "sync-save", "async-save", "async-save", "export"])
            if ranks and self.a.quick:
                kind = "async-save"
            if kind == "step":
                t = {"phase": "step", "step": rng.randint(1, steps), "async": rng.random() < 0.5}
            elif kind == "sync-save":
                t = {"phase": rng.choice(SAVE_POINTS), "step": rng.choice(saves), "async": False}
            elif kind == "async-save":
                t = {"phase": rng.choice(SAVE_POINTS[1:] + ("async:inflight", "async:inflight")),
                     "step": rng.choice(inner), "async": True}
            else:
                t = {"phase": "export:weights", "step": None, "async": rng.random() < 0.5}
            # rank 0 alone publishes checkpoints and writes the export: those points exist only on rank 0
            t["rank"] = (0 if t["phase"] in RANK0_POINTS else rng.randint(0, 1)) if ranks else None
            out.append(t)
        return out

    def trial(self, kind: str, i: int, t: dict, want: dict) -> dict:
        from trainer import checkpoint

        d = self.work / f"{kind}-{i:02d}"
        kill = {"TREX_KILL_AT": t["phase"] + (f"@{t['step']}" if t["step"] is not None else "")}
        if t["rank"] is not None:
            kill["TREX_KILL_RANK"] = str(t["rank"])
        killed = self.run(kind, d, t["async"], kill)
        latest = checkpoint.find_latest(d / "ckpt")
        expect = int(latest.name[5:]) if latest else None
        export_after_kill = _export_state(d / "export")
        again = self.run(kind, d, t["async"], {})
        row = {**t, "kind": kind, "killed": killed["exit_after_kill_s"] is not None and killed["rc"] != 0,
               "rc": killed["rc"], "hung": killed["hung"], "exit_after_kill_s": killed["exit_after_kill_s"],
               "latest_at_kill": expect, "export_after_kill": export_after_kill, "restart_rc": again["rc"],
               "resumed_from": (again["result"] or {}).get("resumed_from"),
               "seconds": killed["seconds"] + again["seconds"]}
        row["identical"] = again["rc"] == 0 and _equal(_weights(d / "export"), want)
        row["ok"] = (row["killed"] and not row["hung"] and row["identical"] and row["resumed_from"] == expect
                     and export_after_kill in ("none", "complete"))
        if not row["ok"]:
            row["tail"] = killed["tail"][-15:] + ["--- restart ---"] + again["tail"][-15:]
        return row


def _line(i: int, r: dict) -> str:
    at = r["phase"] + (f"@{r['step']}" if r["step"] is not None else "")
    rank = f" rank {r['rank']}" if r["rank"] is not None else ""
    fail = f" exit {r['exit_after_kill_s']:.1f}s after the kill" if r["exit_after_kill_s"] is not None else " (not killed)"
    return (f"  {i + 1:2d}. {at:22s}{rank:7s} {'async' if r['async'] else 'sync ':5s} killed:{'yes' if r['killed'] else 'NO '}"
            f"{fail if r['kind'] == 'rank' else ''} latest {r['latest_at_kill']} -> resumed {r['resumed_from']}"
            f" export {r['export_after_kill']:8s} {'bit-identical' if r['identical'] else 'DIFFERENT'}"
            f"{'' if r['ok'] else '  <-- FAIL'}  ({r['seconds']:.0f}s)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20, help="single-process trials (one kill each)")
    ap.add_argument("--rank-kills", type=int, default=6, help="2-rank trials (one rank killed each; 0: none)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill points")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ckpt-every", type=int, default=3)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    ap.add_argument("--pg-timeout", type=float, default=120.0, help="collective timeout of the 2-rank job (s)")
    ap.add_argument("--deadline", type=float, default=300.0, help="a run still going after this is a hang (s)")
    ap.add_argument("--quick", action="store_true", help="6 steps, 3 kills (sync save, async save, export) and 1 "
                    "killed rank (inside an async save)")
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the trials and totals here")
    # a child run (internal)
    ap.add_argument("--child", choices=["single", "rank"], default=None)
    ap.add_argument("--ckpt"), ap.add_argument("--export"), ap.add_argument("--tok")
    ap.add_argument("--async-ckpt", type=int, default=0)
    return ap


def _trials(chaos, kind: str, kills: int, rng) -> list[dict]:
    """``kills`` killed-and-resumed runs of ``kind`` ("single" or "rank"), each compared with the reference."""
    want = chaos.reference(kind)
    out = []
    for i, t in enumerate(chaos.plan(kills, kind == "rank", rng)):
        out.append(chaos.trial(kind, i, t, want))
        print(_line(i, out[-1]), flush=True)
        for x in out[-1].get("tail", []):
            print("      | " + x)
    return out


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.child == "single":
        child_single(a)
        return 0
    if a.child == "rank":
        child_rank(a)
        return 0
    if a.quick:  # (--kills 0 / --rank-kills 0 still leave a part out)
        a.kills, a.rank_kills, a.steps, a.ckpt_every = min(a.kills, 3), min(a.rank_kills, 1), 6, 2
    chaos = Chaos(a)
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    summary: dict = {"command": " ".join([Path(sys.executable).name, "bench/chaos.py", *(argv or sys.argv[1:])]),
                     "workdir": str(chaos.work)}
    print(f"chaos: tiny V4, {a.steps} steps, checkpoint every {a.ckpt_every}, {a.optimizer}; seed {a.seed}; "
          f"work in {chaos.work}", flush=True)
    rows, ranked = [], []
    if a.kills:
        print(f"single process: {a.kills} kills", flush=True)
        rows = _trials(chaos, "single", a.kills, rng)
        n = sum(r["ok"] for r in rows)
        summary["single"] = {"ok": n, "kills": a.kills}
        print(f"single process: {n}/{a.kills} bit-identical", flush=True)
    if a.rank_kills:
        print(f"2 ranks (DP2/FSDP2, gloo, collective timeout {a.pg_timeout:.0f}s): {a.rank_kills} kills of one rank",
              flush=True)
        ranked = _trials(chaos, "rank", a.rank_kills, rng)
        n = sum(r["ok"] for r in ranked)
        exits = [r["exit_after_kill_s"] for r in ranked if r["exit_after_kill_s"] is not None]
        summary["ranks"] = {"ok": n, "kills": a.rank_kills, "max_exit_after_kill_s": max(exits) if exits else None}
        print(f"2 ranks: {n}/{a.rank_kills} bit-identical; the job ended at most "
              f"{max(exits) if exits else float('nan'):.1f}s after a rank was killed (timeout {a.pg_timeout:.0f}s)",
              flush=True)
        rows += ranked
    summary["trials"] = rows
    summary["seconds"] = time.monotonic() - t0
    print(f"chaos: {summary['seconds']:.0f}s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
