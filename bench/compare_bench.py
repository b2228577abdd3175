"""Native engine vs the baseline recipe (transformers' DeepseekV4ForCausalLM + DeepSpeed ZeRO), side by side.

Same model config (``--config``'s model, without the MTP head, which transformers lacks), same initial
weights (the native ``build_model(cfg, vocab, seed)``, converted for HF), same data (synthetic learnable
documents of exactly ``seq`` tokens, one per row, so that the native document mask and the HF model's plain
causal mask compute the same thing), same global batch and optimizer, on the same machine. Every run is a
fresh ``torchrun`` job; layouts alternate (round r runs them in order, round r+1 reversed). Layouts:

- ``native:1``   the native engine itself (``trainer.engines.single.train``), one process;
- ``native:N``   the native distributed engine (``trainer/engines/distributed.py``: FSDP2 over N processes;
                 ``native:N:ep=2`` or ``native:N:pp=2`` etc. for other layouts, ``parallel`` keys separated by ``/``,
                 e.g. ``native:2:reshard_after_forward=0/reduce_dtype=bf16``);
- ``deepspeed:N``  ``trainer/engines/deepspeed.py``, ZeRO ``--zero-stage``, N processes.

Each process gets ``cores / N`` threads, with ``OMP_WAIT_POLICY=ACTIVE`` unless the caller names another policy
(``wait_policy``; ``OMP_WAIT_POLICY`` when run as a script): a benchmark is a dedicated run, and sleeping OpenMP
workers cost the 2-thread process a wake-up per parallel region (native 1 process 5,153 -> 6,877 tokens/s,
DeepSpeed 3,863 -> 4,158 on the tiny config here). On cores shared with other jobs pass ``PASSIVE``: spinning
workers then slow a 2-thread process up to ~100x. The policy is part of the result. Both
engines run on the CPU (the native loop is CPU-only today; ``DS_ACCELERATOR=cpu`` unless set). Reported:
median tokens/s over the steps after the first; MFU of the whole job (``training_flops_per_token`` x
tokens/s over the machine's peak: on CPU one matmul probe with all ``cores`` threads, shared by every
layout, so MFU is proportional to tokens/s; with ``TREX_DEVICE_PEAK`` set, that device's peak times the
process count); peak memory per rank (RSS on CPU); first/final loss; native/baseline throughput ratios. A job
that fails is run once more (gloo jobs can abort in teardown after their measurement); the result lists it
under ``failures`` and the table says so; a second failure stops the benchmark.
``--set train.cpt.compile=true`` compiles both engines (the native blocks; transformers' model through
DeepSpeed's ``engine.compile``). Run: ``trex bench compare --config configs/tiny.yaml`` or
``python bench/compare_bench.py``; at the ~20 M-activated config, both engines compiled, with the baseline's better
ZeRO stage there: ``trex bench compare --config configs/bench_20m.yaml --zero-stage 1 --dtype bf16`` (docs/baseline.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_LAYOUTS = "native:1,native:2,deepspeed:2,deepspeed:1"


# ------------------------------------------------------------------------------------------- data
def synthetic_docs(n: int, seq_len: int, vocab: int, seed: int = 0, branching: int = 4):
    """Documents of exactly ``seq_len`` tokens from a random sparse Markov chain (``branching`` successors
    per token): learnable (the loss falls from ln V towards ln ``branching``), full rows, no padding."""
    import torch

    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, branching), generator=g)
    docs = []
    for _ in range(n):
        ids = [int(torch.randint(0, vocab, (1,), generator=g))]
        choice = torch.randint(0, branching, (seq_len - 1,), generator=g).tolist()
        for c in choice:
            ids.append(int(table[ids[-1], c]))
        docs.append((ids, [1] * seq_len))
    return docs


# ------------------------------------------------------------------------------- native worker (rank)
def _native_worker(spec) -> None:
    """One rank of the native layouts (under torchrun): ``native:1`` the single-process engine, ``native:N``
    the native distributed engine (``trainer/engines/distributed.py``) in N processes, FSDP2 data parallel
    over all of them unless the layout says otherwise (``native:N:ep=2``)."""
    import torch
    import torch.distributed as dist

    from trainer.data import load_packed
    from trainer.engines.distributed import train_parallel
    from trainer.engines.single import train
    from trainer.export import build_model
    from trainer.parallel.dims import Layout, exit_rank, init_distributed
    from trainer.torchrun import RESULT_PREFIX, emit, emit_metrics, peak_memory_mb

    torch.set_num_threads(spec.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = load_packed(spec.data)
    model = build_model(spec.model, spec.vocab_size, spec.seed)

    def log(step: int, m: dict) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            emit_metrics(step, m)

    if world == 1:
        r = train(model, data, spec.train, spec.ckpt_dir, spec.seed, on_log=log)
        emit(RESULT_PREFIX, {"steps": r.steps, "final_loss": r.final_loss, "tokens_per_s": r.tokens_per_s,
                             "mfu": r.mfu, "peak_mem_mb": [peak_memory_mb(torch.device("cpu"))], "world": 1})
        return
    device = init_distributed("gloo")
    r = train_parallel(model, data, spec.train, Layout.from_config(spec.parallel, dist.get_world_size()),
                       spec.ckpt_dir, spec.seed, on_log=log, device=device)
    mem = [None] * dist.get_world_size()
    dist.all_gather_object(mem, peak_memory_mb(torch.device("cpu")))
    if dist.get_rank() == 0:
        emit(RESULT_PREFIX, {"steps": r.steps, "final_loss": r.final_loss, "tokens_per_s": r.tokens_per_s,
                             "mfu": r.mfu, "peak_mem_mb": mem, "world": dist.get_world_size()})
    exit_rank()


# ------------------------------------------------------------------------------------------ harness
def machine_peak(cores: int, dtype: str = "fp32") -> float | None:
    """FLOP/s of the whole machine on CPU in ``dtype`` (the best of three matmul probes with ``cores`` threads),
    shared by every layout so that MFU is comparable across process counts; None when ``TREX_DEVICE_PEAK``
    names a device (then each rank counts that device's peak)."""
    if os.environ.get("TREX_DEVICE_PEAK"):
        return None
    from trainer.metrics import cpu_peaks_apart

    return cpu_peaks_apart(cores, (dtype,), probes=3)[dtype]  # one probe can hit a slow moment


def run_layout(engine: str, nproc: int, model_cfg: dict, vocab: int, train: dict, data_path: str, workdir: Path,
               seed: int, cores: int, quiet: bool = True, peak: float | None = None,
               parallel: dict | None = None, wait_policy: str = "ACTIVE") -> dict:
    from trainer.torchrun import JobSpec, launch

    threads = max(1, cores // nproc)
    env = {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": wait_policy,
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    if peak is not None:  # every rank counts its share of the machine
        env["TREX_DEVICE_PEAK"] = str(peak / nproc)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = workdir / "ckpt"
    spec = JobSpec(model=model_cfg, vocab_size=vocab, train={**train, "engine": engine, "nproc": nproc}, seed=seed,
                   data=data_path, ckpt_dir=str(ckpt), threads=threads, parallel=parallel or {})
    steps: list[dict] = []
    target = None if engine == "deepspeed" else [str(Path(__file__).resolve()), "--native-worker"]
    t0 = time.perf_counter()
    r = launch(spec, workdir, nproc, on_metrics=lambda s, m: steps.append({"step": s, **m}),
               on_line=None if quiet else print, target=target, env=env)
    r["wall_s"] = time.perf_counter() - t0
    r["per_step"] = steps
    return r


def parse_layout(text: str) -> tuple[str, int, dict]:
    """``engine:N[:key=value/key=value]`` -> (engine, N, parallel keys)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ("native", "deepspeed") or not parts[1].isdigit():
        raise ValueError(f"layout {text!r}: expected native|deepspeed:N[:key=value/...]")
    extra = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in (kv.split("=") for kv in parts[2].split("/"))
             } if len(parts) == 3 else {}
    return parts[0], int(parts[1]), extra


def summarise(engine: str, nproc: int, runs: list[dict], zero_stage: int, extra: dict | None = None) -> dict:
    def med(key):
        values = [x[key] for r in runs for x in r["per_step"][1:]]  # step 1 warms up
        return None if None in values else statistics.median(values)  # MFU: None on a device of unknown peak

    layout = f"{nproc} proc" + ("s" if nproc > 1 else "")
    if engine == "deepspeed":
        layout += f", ZeRO-{zero_stage}"
    elif nproc > 1:
        layout += ", " + ("/".join(f"{k}={v}" for k, v in extra.items()) if extra else "FSDP")
    return {"engine": engine, "nproc": nproc, "layout": layout, "tokens_per_s": med("tokens_per_s"),
            "mfu": med("mfu"), "peak_mem_mb_per_rank": max(max(r["peak_mem_mb"]) for r in runs),
            "first_loss": runs[0]["per_step"][0]["loss"], "final_loss": runs[0]["final_loss"],
            "tokens_per_s_runs": [statistics.median(x["tokens_per_s"] for x in r["per_step"][1:]) for r in runs],
            "tokens_per_s_steps": [[round(x["tokens_per_s"], 1) for x in r["per_step"]] for r in runs]}


def _pairs(rows: dict[str, dict]):
    """(name, native layout, baseline layout) for every native x baseline pair of the run."""
    for n in (k for k in rows if k.startswith("native:")):
        for b in (k for k in rows if k.startswith("deepspeed:")):
            yield f"{n}_over_{b}".replace(":", "").replace("=", "").replace("/", "_"), n, b


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    return {name: rows[n]["tokens_per_s"] / rows[b]["tokens_per_s"] for name, n, b in _pairs(rows)}


def ceilings(rows: dict[str, dict]) -> dict[str, float]:
    """For each ratio of :func:`ratios`, its ceiling on this machine: both engines train the same FLOPs per token
    and their MFUs share one measured peak, so a ratio of tokens/s is a ratio of MFUs, and a native step at 100 %
    of that peak would run ``1 / (the baseline's MFU)`` times the baseline's tokens/s (no entry without an MFU;
    only for the machine's measured peak: with ``TREX_DEVICE_PEAK`` each layout's peak scales with its processes).
    A target above the ceiling cannot be met on this machine by any engine; where GEMMs are most of a step (a CPU
    without AMX, a GPU at large shapes) the baseline's MFU is high and the ceiling low."""
    return {name: 1.0 / rows[b]["mfu"] for name, _, b in _pairs(rows) if rows[b].get("mfu")}


def compare(config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None, steps: int = 6,
            batch: int = 8, seq: int | None = None, rounds: int = 2, zero_stage: int = 2,
            layouts: str = DEFAULT_LAYOUTS, cores: int | None = None, seed: int = 0, dtype: str | None = None,
            out: str | None = None, log_mlflow: bool = True, quiet: bool = True, wait_policy: str = "ACTIVE") -> dict:
    from trainer.allocator import for_jobs
    from trainer.data import pack, save_packed
    from trainer.torchrun import EngineError
    from trex.core.config import load_config

    if wait_policy.upper() not in ("ACTIVE", "PASSIVE"):
        raise ValueError(f"OpenMP wait policy: ACTIVE or PASSIVE, not {wait_policy!r}")
    wait_policy = wait_policy.upper()
    cfg = load_config(config, overrides or [])
    stage = cfg.train.cpt
    seq = seq or stage.seq_len
    model_cfg = {**cfg.model.model_dump(mode="json"), "mtp_layers": 0}  # transformers has no MTP head
    vocab = cfg.tokenizer.vocab_size
    cores = cores or os.cpu_count() or 1
    train = {**stage.model_dump(mode="json"), "steps": steps, "batch_size": batch, "seq_len": seq, "grad_accum": 1,
             "log_every": 1, "ckpt_every": 10 ** 6, "zero_stage": zero_stage, "offload": False,
             "dtype": dtype or stage.dtype, "async_checkpoint": False, "activation_checkpointing": "none",
             "optimizer": "adamw"}  # the same optimizer on both sides, whatever the recipe trains with
    wanted = [(x, *parse_layout(x)) for x in layouts.split(",")]
    for x, e, n, _ in wanted:
        if batch % n:
            raise ValueError(f"layout {x}: batch ({batch}) not divisible by {n}")
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="trex-compare-"))
    data = pack(synthetic_docs(batch * steps, seq, vocab, seed), seq, pad_id=0)
    data_path = str(save_packed(data, root / "packed.pt"))
    peak = machine_peak(cores, train["dtype"])
    allocator = for_jobs()  # what trainer.torchrun.launch gives both engines' jobs
    runs: dict[str, list[dict]] = {x: [] for x, *_ in wanted}
    failures: list[dict] = []  # jobs that failed and were run again (reported, never hidden)
    for r in range(rounds):
        for x, e, n, extra in (wanted if r % 2 == 0 else wanted[::-1]):
            where = root / f"r{r}_{x.replace(':', '_')}"
            try:
                res = run_layout(e, n, model_cfg, vocab, train, data_path, where, seed, cores, quiet, peak, extra,
                                 wait_policy)
            except EngineError as err:  # once: gloo jobs can abort at exit (a rank's SIGABRT in teardown)
                print(f"round {r + 1} {e:9s} x{n}: failed, run again once ({str(err).splitlines()[0]})", flush=True)
                failures.append({"round": r + 1, "layout": x, "error": str(err)[-2000:]})
                res = run_layout(e, n, model_cfg, vocab, train, data_path, where.with_name(where.name + "_retry"),
                                 seed, cores, quiet, peak, extra, wait_policy)
            for done in (where, where.with_name(where.name + "_retry")):  # metrics read: the weights can go
                shutil.rmtree(done / "ckpt", ignore_errors=True)  # (bench_20m: ~0.7 GB a job, ~8 GB a campaign)
            runs[x].append(res)
            med = statistics.median(x["tokens_per_s"] for x in res["per_step"][1:])
            print(f"round {r + 1} {e:9s} x{n}: {med:9.1f} tokens/s  final loss {res['final_loss']:.4f}  "
                  f"({res['wall_s']:.0f} s)", flush=True)
    rows = {}
    for x, e, n, extra in wanted:
        rows[x] = summarise(e, n, runs[x], zero_stage, extra)
    rat = ratios(rows)
    result = {"config": config, "overrides": overrides or [], "model": model_cfg, "vocab": vocab, "batch": batch,
              "seq_len": seq, "steps": steps, "rounds": rounds, "zero_stage": zero_stage, "cores": cores,
              "dtype": train["dtype"], "compiled": bool(train.get("compile")), "omp_wait_policy": wait_policy,
              "allocator": allocator, "peak_flops": peak,
              "rows": rows, "ratios": rat, "ratio_ceilings": ceilings(rows) if peak else {}, "workdir": str(root),
              "failures": failures}
    print_table(result)
    (root / "compare.json").write_text(json.dumps(result, indent=2))
    if log_mlflow:
        result["mlflow_run_id"] = log_result(cfg, result, root / "compare.json")
    _prefect_artifact(result)
    return result


def table_rows(result: dict) -> list[dict]:
    return [{"engine": r["engine"], "layout": r["layout"], "tokens_per_s": round(r["tokens_per_s"], 1),
             "mfu": None if r["mfu"] is None else round(r["mfu"], 5),
             "peak_mem_mb_per_rank": round(r["peak_mem_mb_per_rank"]),
             "first_loss": round(r["first_loss"], 5), "final_loss": round(r["final_loss"], 5)}
            for r in result["rows"].values()]


def print_table(result: dict) -> None:
    print(f"\nmodel {result['config']} (no MTP), global batch {result['batch']} x {result['seq_len']} tokens, "
          f"{result['steps']} steps, {result['rounds']} alternating rounds, {result['cores']} cores, {result['dtype']}, "
          f"{'compiled' if result.get('compiled') else 'eager'}, "
          f"OMP_WAIT_POLICY={result.get('omp_wait_policy', 'PASSIVE')}, "
          f"allocator {result.get('allocator', 'system')}"
          + (f", machine peak {result['peak_flops'] / 1e9:.1f} GFLOP/s (measured)" if result.get("peak_flops") else ""))
    print(f"{'engine':10s} {'layout':34s} {'tokens/s':>10s} {'MFU':>8s} {'peak MB/rank':>13s} {'first loss':>11s} "
          f"{'final loss':>11s}")
    for r in table_rows(result):
        mfu = "?" if r["mfu"] is None else f"{r['mfu']:.3%}"
        print(f"{r['engine']:10s} {r['layout']:34s} {r['tokens_per_s']:10.1f} {mfu:>8s} "
              f"{r['peak_mem_mb_per_rank']:13.0f} {r['first_loss']:11.5f} {r['final_loss']:11.5f}")
    ceiling = result.get("ratio_ceilings", {})
    for k, v in result["ratios"].items():
        bound = f"  (ceiling {ceiling[k]:.2f}x: the baseline runs at {1 / ceiling[k]:.1%} of the peak)" \
            if k in ceiling else ""
        print(f"throughput {k.replace('_over_', ' / ')}: {v:.2f}x{bound}")
    for f in result.get("failures", []):
        print(f"round {f['round']} {f['layout']}: the job failed and was run again ({f['error'].splitlines()[0]})")


def log_result(cfg, result: dict, json_file: Path) -> str | None:
    """One MLflow run ``bench-compare``: params, per-layout metrics, ratios, the table and the JSON."""
    from trex.tracking.runs import start_run, tracking_settings

    tracking = tracking_settings(cfg.tracking, cfg.run.state_dir)
    run = start_run(tracking, "bench-compare", None, {"kind": "engine-comparison"})
    run.params({k: result[k] for k in ("config", "batch", "seq_len", "steps", "rounds", "zero_stage", "cores",
                                       "dtype", "compiled", "vocab", "omp_wait_policy",
                                       "allocator")}
               | {"layouts": ",".join(result["rows"])})
    metrics = dict(result["ratios"])
    metrics.update({f"{k}_ceiling": v for k, v in result.get("ratio_ceilings", {}).items()})
    for key, r in result["rows"].items():
        p = key.replace(":", "_").replace("=", "").replace("/", "_") + "p"
        metrics.update({f"{p}_tokens_per_s": r["tokens_per_s"], f"{p}_mfu": r["mfu"],
                        f"{p}_peak_mem_mb_per_rank": r["peak_mem_mb_per_rank"], f"{p}_final_loss": r["final_loss"]})
    run.metrics(metrics)
    run.table(table_rows(result), "comparison.json")
    run.artifact(json_file)
    run.finish()
    return run.run_id


def _prefect_artifact(result: dict) -> None:
    """A Prefect table artifact, only inside a flow or task run."""
    try:
        from prefect.context import FlowRunContext, TaskRunContext

        if FlowRunContext.get() is None and TaskRunContext.get() is None:
            return
        from prefect.artifacts import create_table_artifact

        create_table_artifact(table=table_rows(result), key="engine-comparison",
                              description="native vs DeepSpeed baseline: " + ", ".join(
                                  f"{k} {v:.2f}x" for k, v in result["ratios"].items()))
    except Exception as e:  # noqa: BLE001 - the artifact is a convenience
        print(f"(no Prefect artifact: {e})", file=sys.stderr)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--native-worker":  # one rank of a native layout, under torchrun
        ap = argparse.ArgumentParser()
        ap.add_argument("--native-worker", action="store_true")
        ap.add_argument("--spec", required=True)
        from trainer.torchrun import JobSpec

        _native_worker(JobSpec.model_validate_json(Path(ap.parse_args(argv).spec).read_text()))
        return None
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="default: the config's train.cpt.seq_len")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS)
    ap.add_argument("--cores", type=int, default=None)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-mlflow", action="store_true")
    ap.add_argument("--omp-wait-policy", choices=["ACTIVE", "PASSIVE"],
                    default=os.environ.get("OMP_WAIT_POLICY", "ACTIVE"),
                    help="the jobs' OpenMP wait policy (default: $OMP_WAIT_POLICY, else ACTIVE; PASSIVE on shared "
                         "cores)")
    a = ap.parse_args(argv)
    return compare(a.config, a.overrides, a.steps, a.batch, a.seq, a.rounds, a.zero_stage, a.layouts, a.cores,
                   dtype=a.dtype, out=a.out, log_mlflow=not a.no_mlflow, wait_policy=a.omp_wait_policy)


if __name__ == "__main__":
    main()
