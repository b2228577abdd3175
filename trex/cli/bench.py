"""``trex bench ...``: benchmark commands (a typer sub-app, ``bench_app``).

Registered by ``trex/cli/main.py`` with ``register(app)``; other bench commands add themselves to ``bench_app``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from trex.cli.common import USER_OMP_WAIT_POLICY, err, load
from trex.tracking.runs import tracking_uri

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks (throughput, MFU, memory).")
BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"  # trex/cli/bench.py -> the repository's bench/


def load_bench(name: str):
    """A module of ``bench/`` (scripts, not a package) by file name."""
    spec = importlib.util.spec_from_file_location(f"trex_bench_{name}", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, args: list[str]) -> None:
    """Run ``bench/<name>.py`` as its own process: its spawned workers re-import it by module path, which a
    module loaded from a file location (``load_bench``) does not have. A benchmark is a dedicated run, so its
    OpenMP threads spin while waiting (``OMP_WAIT_POLICY=ACTIVE``) unless the user set a policy: the CLI's
    PASSIVE default, right for shared cores, slowed the 2-thread MoE layer from 130 to 198 ms here."""
    env = {**os.environ, "OMP_WAIT_POLICY": USER_OMP_WAIT_POLICY or "ACTIVE"}
    rc = subprocess.call([sys.executable, str(BENCH_DIR / f"{name}.py"), *args], env=env)
    if rc:
        raise typer.Exit(rc)


@bench_app.command("compare")
def compare(
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="YAML config (model + train.cpt)")] = "configs/tiny.yaml",
    set_: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="override: section.key=value")] = None,
    steps: Annotated[int, typer.Option(help="optimizer steps per run (the first is warm-up)")] = 6,
    batch: Annotated[int, typer.Option(help="global batch (rows)")] = 8,
    seq: Annotated[Optional[int], typer.Option(help="row length (default: train.cpt.seq_len)")] = None,
    rounds: Annotated[int, typer.Option(help="alternating A/B rounds")] = 2,
    zero_stage: Annotated[int, typer.Option(help="DeepSpeed ZeRO stage of the baseline")] = 2,
    layouts: Annotated[str, typer.Option(help="engine:processes, comma-separated")] = "native:1,native:2,deepspeed:2,deepspeed:1",
    cores: Annotated[Optional[int], typer.Option(help="cores to share among a run's processes (default: all)")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="fp32 | bf16 (default: the config's)")] = None,
    out: Annotated[Optional[str], typer.Option(help="work directory (default: a temporary one)")] = None,
    mlflow: Annotated[bool, typer.Option("--mlflow/--no-mlflow", help="log the comparison to MLflow")] = True,
    omp_wait_policy: Annotated[Optional[str], typer.Option(help="the jobs' OpenMP wait policy, ACTIVE | PASSIVE "
                                                           "(default: $OMP_WAIT_POLICY if you set it, else ACTIVE; "
                                                           "PASSIVE on cores shared with other jobs)")] = None,
) -> None:
    """Native engine vs transformers + DeepSpeed ZeRO: same model, weights, data and global batch."""
    cfg = load(config, set_)  # validates the config, sets TREX_STATE_DIR
    if dtype not in (None, "fp32", "bf16"):
        err.print(f"[red]error:[/] --dtype takes fp32 or bf16, not {dtype!r}")
        raise typer.Exit(2)
    try:
        result = load_bench("compare_bench").compare(
            config, set_ or [], steps=steps, batch=batch, seq=seq, rounds=rounds, zero_stage=zero_stage,
            layouts=layouts, cores=cores, dtype=dtype, out=out, log_mlflow=mlflow and cfg.tracking.enabled,
            wait_policy=omp_wait_policy or USER_OMP_WAIT_POLICY or "ACTIVE")
    except ValueError as e:
        err.print(f"[red]error:[/] {e}", highlight=False)
        raise typer.Exit(2)
    if result.get("mlflow_run_id"):
        typer.echo(f"MLflow run {result['mlflow_run_id']} ({tracking_uri(cfg.tracking.tracking_uri, cfg.run.state_dir)})")


@bench_app.command("kernels", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def kernels(ctx: typer.Context) -> None:
    """Per kernel op: reference vs optimised time, peak memory and ratio (options: ``--ops``, ``--device``,
    ``--dtype``, ``--rounds``, ``--quick``; see ``python bench/kernels_bench.py --help``)."""
    run_script("kernels_bench", ctx.args)


@bench_app.command("model", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def model(ctx: typer.Context) -> None:
    """Native DeepSeek-V4 vs transformers' implementation: tokens/s, peak memory, MFU and their ratio
    (``--config``, ``--set``, ``--device``, ``--dtype``, ``--engines``; see ``python bench/model_bench.py --help``)."""
    run_script("model_bench", ctx.args)


@bench_app.command("step-ab", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def step_ab(ctx: typer.Context) -> None:
    """Kernel references against their definitions (or another backend) inside the training step, alternating in
    one process (``--config``, ``--dtype``, ``--swap op=module:function``, ``--old-backend op=backend``; see
    ``python bench/step_ab.py --help``)."""
    run_script("step_ab", ctx.args)


@bench_app.command("batch-ab", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def batch_ab(ctx: typer.Context) -> None:
    """Less padding per step: SFT batches grouped by length vs random, CPT rows best-fit vs in order, on a
    lifecycle's data, alternating in one process (``--stage``, ``--state-dir``; ``python bench/batch_ab.py --help``)."""
    run_script("batch_ab", ctx.args)


@bench_app.command("chaos", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def chaos(ctx: typer.Context) -> None:
    """SIGKILL training at seeded random points (steps, sync and async saves, export), resume, compare the final
    weights with an uninterrupted run; then one rank of a 2-process job (``--kills``, ``--rank-kills``,
    ``--seed``, ``--quick``; see ``python bench/chaos.py --help``)."""
    run_script("chaos", ctx.args)


@bench_app.command("sandbox", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sandbox(ctx: typer.Context) -> None:
    """Sandbox overhead against a bare subprocess and sandboxed executions/s (``--rounds``, ``--workers``)."""
    sys.argv = ["sandbox_bench", *ctx.args]
    load_bench("sandbox_bench").main()


@bench_app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(ctx: typer.Context) -> None:
    """``trex serve`` under load on localhost: requests/s and tokens/s at client concurrency 1, 4, 16 (``--model``,
    ``--concurrency``, ``--requests``, ``--max-tokens``, ``--max-batch``; see ``python bench/serve_bench.py --help``)."""
    run_script("serve_bench", ctx.args)


@bench_app.command("decode", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def decode(ctx: typer.Context) -> None:
    """Batched decoding (evaluation, serving, RL rollouts): the decoder against the former one, side by side
    (``--rows``, ``--prompt``, ``--min-new``, ``--max-new``, ``--temperature``, ``--logprobs``, ``--rounds``)."""
    run_script("decode_bench", ctx.args)


@bench_app.command("convert", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def convert(ctx: typer.Context) -> None:
    """``trex convert`` on a generated >= 1 GB multi-shard V4-Flash checkpoint (hub-fp8 -> hub-bf16, hf, hub-fp8):
    GB/s and peak RSS against the largest shard, target <= 3x (``--size-gb``, ``--rounds``, ``--cache-dir``,
    ``--json``, ``--to``, ``--source``; see ``python bench/convert_bench.py --help``)."""
    run_script("convert_bench", ctx.args)


@bench_app.command("rl", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def rl(ctx: typer.Context) -> None:
    """The RL stage's rollout and update tokens/s on the config's model (``--config``, ``--set``, ``--steps``,
    ``--prompt``, ``--max-new``; see ``python bench/rl_bench.py --help``)."""
    run_script("rl_bench", ctx.args)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
