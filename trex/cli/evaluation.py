"""``trex eval ...``: run single programs, benchmark references and benchmark evaluations.

- ``trex eval exec --code FILE [--data FILE]...``: one program through the sandbox; prints one JSON result.
- ``trex eval references --benchmark b4o-feasible [--data-dir DIR]``: the benchmark's own reference LP
  files through the execution path, compared with its ground truth (every mismatch listed).
- ``trex eval benchmarks``: the registered benchmarks and where their data is looked for.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from trex.core.config import ConfigError, load_config

eval_app = typer.Typer(help="Evaluation tools: sandboxed execution, benchmark references, benchmark runs.",
                       no_args_is_help=True)


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


@eval_app.command("exec")
def exec_(code: Annotated[str, typer.Option(help="Python program to run (a .py file, or '-' for stdin)")],
          data: Annotated[Optional[list[str]], typer.Option(help="data file given to the program under its own name (repeatable)")] = None,
          timeout: Annotated[float, typer.Option(help="wall-clock limit, seconds")] = 20.0,
          memory_mb: Annotated[int, typer.Option(help="address-space limit, MiB")] = 2048,
          isolation: Annotated[str, typer.Option(help="auto (= bwrap) | bwrap | rlimits (needs --allow-unisolated)")] = "auto",
          allow_unisolated: Annotated[bool, typer.Option(help="permit rlimits-only isolation")] = False) -> None:
    """Run one program in the sandbox and print its result as JSON (status, objective, solver, isolation, time)."""
    from eval.sandbox import SandboxUnavailable, run_program

    text = sys.stdin.read() if code == "-" else None
    if text is None:
        if not Path(code).is_file():
            _fail(f"{code}: no such program file")
        text = Path(code).read_text()
    files = {}
    for d in data or []:
        p = Path(d)
        if not p.is_file():
            _fail(f"{d}: no such data file")
        files[p.name] = p.read_bytes()
    try:
        res = run_program(text, timeout_s=timeout, memory_mb=memory_mb, files=files, isolation=isolation,
                          allow_unisolated=allow_unisolated)
    except (SandboxUnavailable, ValueError) as e:
        _fail(str(e))
    out = res.to_dict()
    typer.echo(json.dumps({k: out[k] for k in ("status", "objective", "reported", "solver", "solves", "isolation",
                                               "seconds", "returncode", "printed_objective", "printed_status",
                                               "rejected_records", "limits", "stdout_tail", "stderr_tail")}, indent=2))


@eval_app.command("references")
def references(benchmark: Annotated[str, typer.Option(help="b4o-feasible (reference LP files + optimal values) or b4o-orgeval (self-equivalence check)")] = "b4o-feasible",
               data_dir: Annotated[Optional[str], typer.Option(help="benchmark directory (default: under $TREX_BENCHMARKS_DIR)")] = None,
               limit: Annotated[Optional[int], typer.Option(help="only the first N problems")] = None,
               workers: Annotated[int, typer.Option(help="parallel executions")] = 2,
               timeout: Annotated[float, typer.Option(help="per-program wall-clock limit, seconds")] = 60.0,
               out: Annotated[Optional[str], typer.Option(help="write the full report (JSON) here")] = None) -> None:
    """Run a benchmark's own reference models through the execution path and compare with its ground truth."""
    from eval import references as refs

    default = {"b4o-feasible": "SLAI-T-Rex/bench4opt_feasible", "b4o-orgeval": "SLAI-T-Rex/bench4opt"}
    if benchmark not in default:
        _fail(f"unknown benchmark {benchmark!r}: choose {', '.join(default)}")
    if data_dir is None:
        root = os.environ.get("TREX_BENCHMARKS_DIR")
        if not root:
            _fail("give --data-dir or set TREX_BENCHMARKS_DIR")
        data_dir = str(Path(root) / default[benchmark])
    if not Path(data_dir).is_dir():
        _fail(f"{data_dir}: no such benchmark directory")
    if benchmark == "b4o-feasible":
        report = refs.run_references(data_dir, limit=limit, workers=workers, timeout_s=timeout)
    else:
        report = refs.orgeval_self_check(data_dir, limit=limit)
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
    summary = {k: v for k, v in report.items() if not isinstance(v, list)}
    typer.echo(json.dumps(summary, indent=2))
    for m in report.get("mismatches", []):
        typer.echo(f"MISMATCH {json.dumps(m)}")
    for m in report.get("failures", []):
        typer.echo(f"FAILURE {json.dumps(m)}")


@eval_app.command("run")
def run(benchmark: Annotated[list[str], typer.Option(help="registered benchmark key (repeatable); see `trex eval benchmarks`")],
        model: Annotated[str, typer.Option(help="model directory (native/hf/vllm) or served model name (openai)")],
        backend: Annotated[str, typer.Option(help="native | hf | vllm | openai")] = "native",
        base_url: Annotated[Optional[str], typer.Option(help="openai backend: endpoint, e.g. http://127.0.0.1:8000/v1")] = None,
        data: Annotated[Optional[str], typer.Option(help="benchmark file/dir (one benchmark only; default: under $TREX_BENCHMARKS_DIR)")] = None,
        out: Annotated[str, typer.Option(help="results directory, OUT/<benchmark>/ per benchmark (samples.jsonl is resumed if it holds rows of this same run fingerprint; rows of another run are an error)")] = "eval-results",
        template: Annotated[str, typer.Option(help="reference | synthetic")] = "reference",
        api: Annotated[Optional[str], typer.Option(help="solver API the prompt asks for (default: gurobipy)")] = None,
        config: Annotated[Optional[str], typer.Option("--config", "-c", help="YAML whose eval: section sets sampling/sandbox")] = None,
        set_: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="override, e.g. eval.temperature=0.6")] = None,
        limit: Annotated[Optional[int], typer.Option(help="only the first N items of each benchmark")] = None,
        overwrite: Annotated[bool, typer.Option(help="discard the rows already in OUT/<benchmark>/ and start over")] = False) -> None:
    """Evaluate a model on registered benchmarks: generate, execute in the sandbox, judge (Pass@1 per rule).

    Every row and report carries the run fingerprint (model content, backend, prompt, sampling, benchmark
    file, scoring); a results directory holding rows of another fingerprint is refused (see docs/eval.md)."""
    from eval.backends import make_backend
    from eval.benchmarks import load_benchmark
    from eval.harness import evaluate_items

    if data and len(benchmark) != 1:
        _fail("--data names the file of one benchmark; give a single --benchmark")
    try:
        cfg = load_config(config, set_ or []).eval
    except ConfigError as e:
        _fail(str(e))
    opts = {"base_url": base_url} if backend == "openai" and base_url else {}
    if backend in ("native", "hf"):
        opts["batch_size"] = cfg.batch_size
    try:
        engine = make_backend(backend, model, **opts)
    except Exception as e:  # noqa: BLE001 - a clear message instead of a traceback
        _fail(f"backend {backend!r}: {e}")
    summary = {}
    for name in benchmark:
        try:
            loaded = load_benchmark(name, data, limit=limit or cfg.limit)
        except (KeyError, ValueError, FileNotFoundError) as e:
            _fail(str(e))
        for sid, why in loaded.skipped:
            typer.echo(f"skipped {name}/{sid}: {why}", err=True)
        try:
            report = evaluate_items(engine, loaded.items, Path(out) / name, cfg, name, template=template, api=api,
                                    progress=lambda what, i, n: typer.echo(f"{what}: {i}/{n}", err=True),
                                    benchmark_hash=loaded.content_hash, benchmark_files=loaded.hashed_files,
                                    overwrite=overwrite)
        except ValueError as e:  # rows of another run fingerprint, an unknown template/API, a bad manifest
            _fail(str(e))
        summary[name] = {"n": report["n"], "unjudged": report["unjudged"], **report["pass@1_by_rule"],
                         "pass@1_ci": report["pass@1_ci"], "pass@k": report["pass@k"],
                         "execution_error_rate": report["execution_error_rate"],
                         "fingerprint": report["fingerprint"]["hash"]}
    typer.echo(json.dumps(summary, indent=2))


@eval_app.command("compare")
def compare_cmd(result: Annotated[list[str], typer.Option("--result", "-r", help="NAME=DIR: a model's results (a directory with samples.jsonl, or one with a subdirectory per benchmark, as `trex eval run --out` writes); repeatable, the first NAME is the baseline; a NAME given again adds that directory's benchmarks (e.g. a lifecycle's held-out and out-of-distribution evaluations)")],
                out: Annotated[Optional[str], typer.Option(help="also write compare.md, compare.json and compare.png here")] = None,
                confidence: Annotated[float, typer.Option(help="interval level")] = 0.95) -> None:
    """Several models side by side over the benchmarks: Pass@1 with intervals, and each model's paired
    difference to the first (per benchmark and on the mean), as a Markdown table (docs/eval.md)."""
    from eval.compare import compare, load_results, markdown, merge_results

    models = {}
    for item in result:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            _fail(f"--result {item!r}: expected NAME=DIR")
        try:
            res = load_results(path)
            models[name] = merge_results(models[name], res, f"--result {item}") if name in models else res
        except (FileNotFoundError, ValueError) as e:
            _fail(str(e))
    table = compare(models, confidence)
    md = markdown(table)
    typer.echo(md)
    if out:
        from trex.tracking.plots import compare_bars

        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "compare.md").write_text(md + "\n")
        (d / "compare.json").write_text(json.dumps(table, indent=2))
        compare_bars(table, d / "compare.png")
        typer.echo(f"wrote {d / 'compare.md'}, compare.json, compare.png", err=True)


@eval_app.command("benchmarks")
def benchmarks() -> None:
    """List the registered benchmarks."""
    from eval.benchmarks import list_benchmarks

    for row in list_benchmarks():
        typer.echo(json.dumps(row))


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")
