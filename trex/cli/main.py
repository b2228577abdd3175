"""``trex``: the command-line entry point (typer).

Every command takes ``--config FILE`` and any number of ``--set section.key=value``, parsed once here
(``trex.cli.common.load``) into a ``TrexConfig`` that the command hands to its flow as ``cfg``; ``config`` and
``overrides`` go along only as the flow run's record of where it came from (``flows/common.py:
resolve_config`` parses them for deployment runs, which have no ``cfg``). Configuration errors and missing
inputs exit with code 2 and a message naming the key or path. Flow modules are imported
inside the commands (start-up time: Prefect costs ~2 s to import, and ``trex config`` needs none of it).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from trex.cli import bench, checkpoint, evaluation, model, ops, plan, serve
from trex.cli.common import ConfigOpt, SetOpt, app, check_inputs, err
from trex.cli.common import load as _load
from trex.cli.common import run as _run
from trex.core.config import dump_config


@app.command()
def lifecycle(config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
    """Run every stage: curate, tokenizer, CPT, SFT, evaluate, register."""
    cfg = _load(config, set_)
    from flows.lifecycle import lifecycle_flow

    _run(lifecycle_flow, sandbox=("data", "eval"), cfg=cfg, config=config, overrides=set_ or [])


CURATE_ONLY = {"all": [], "sft": ["data.cpt.documents=0"], "cpt": ["data.sft.samples=0"]}


@app.command()
def curate(what: Annotated[str, typer.Argument(help="all | sft | cpt (sft: no CPT corpus; cpt: no SFT samples)")] = "all",
           config: ConfigOpt = "configs/or_data.yaml", set_: SetOpt = None) -> None:
    """Generate, solve and verify the OR datasets (default: the full grid); print the data directory."""
    if what not in CURATE_ONLY:
        err.print(f"[red]error:[/] curate takes all, sft or cpt, not {what!r}")
        raise typer.Exit(2)
    overrides = [*(set_ or []), *CURATE_ONLY[what]]
    cfg = _load(config, overrides)
    from flows.curate import curate_flow

    # config and overrides both travel in its dataset event
    ref = _run(curate_flow, sandbox=("data",), cfg=cfg, config=config, overrides=overrides)
    typer.echo(ref["path"])


def _train(stage: str, data: str, tokenizer: str | None, init: str | None, config: str | None,
           overrides: list[str], check_layout: bool = False) -> None:
    """Run the ``stage`` flow (cpt | sft) on the parsed configuration and print the model directory. With
    ``check_layout`` (``trex train``), a layout the world size cannot hold exits 2 before anything starts."""
    cfg = _load(config, overrides)
    if check_layout:
        from trainer.parallel.dims import LayoutError, ParallelDims  # lazy: imports torch (start-up time)

        try:
            ParallelDims.from_config(cfg.parallel, cfg.parallel.world_size)
        except LayoutError as e:
            err.print(f"[red]layout error:[/] {e}", highlight=False)
            raise typer.Exit(2)
    check_inputs(data=(data, "data"), tokenizer=(tokenizer, "tokenizer"), init=(init, "model"))
    from flows.train import cpt_flow, sft_flow

    flow = cpt_flow if stage == "cpt" else sft_flow
    ref = _run(flow, data_dir=data, tokenizer_dir=tokenizer, init_dir=init, cfg=cfg, config=config,
               overrides=overrides)
    typer.echo(ref["path"])


DataOpt = Annotated[str, typer.Option(help="curated data directory")]
TokenizerOpt = Annotated[Optional[str], typer.Option(help="tokenizer directory (default: train one)")]


@app.command()
def cpt(data: DataOpt, tokenizer: TokenizerOpt = None,
        init: Annotated[Optional[str], typer.Option(help="model directory to start from")] = None,
        config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
    """Continual pre-training on a curated data directory."""
    _train("cpt", data, tokenizer, init, config, set_ or [])


@app.command()
def sft(data: DataOpt,
        init: Annotated[Optional[str], typer.Option(help="CPT model directory to start from")] = None,
        tokenizer: TokenizerOpt = None, config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
    """Supervised fine-tuning (assistant-only loss) on a curated data directory."""
    _train("sft", data, tokenizer, init, config, set_ or [])


@app.command()
def rl(data: DataOpt, init: Annotated[str, typer.Option(help="SFT model directory to start from")],
       tokenizer: Annotated[Optional[str], typer.Option(help="tokenizer directory (default: the SFT model's)")] = None,
       config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
    """RL (GRPO, train.rl) of an SFT model on the curated data's problems, rewarded by the attested sandbox; print
    the model directory."""
    cfg = _load(config, set_)
    check_inputs(data=(data, "data"), tokenizer=(tokenizer, "tokenizer"), init=(init, "model"))
    from flows.train import rl_flow

    ref = _run(rl_flow, sandbox=("eval",), data_dir=data, init_dir=init, tokenizer_dir=tokenizer, cfg=cfg,
               config=config, overrides=set_ or [])
    typer.echo(ref["path"])


@app.command()
def train(stage: Annotated[str, typer.Argument(help="cpt | sft")], data: DataOpt,
          init: Annotated[Optional[str], typer.Option(help="model directory to start from")] = None,
          tokenizer: TokenizerOpt = None,
          nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", help="ranks per node (torchrun)")] = 1,
          nnodes: Annotated[int, typer.Option(help="nodes (run the same command on each)")] = 1,
          rdzv_endpoint: Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="host:port of the rendezvous")] = None,
          config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
    """Train one stage with the native engine under the config's ``parallel`` layout, as a torchrun job of
    nproc-per-node x nnodes ranks (docs/parallel.md); prints the model directory."""
    if stage not in ("cpt", "sft"):
        err.print(f"[red]error:[/] train takes cpt or sft, not {stage!r}")
        raise typer.Exit(2)
    overrides = [*(set_ or []), f"parallel.nproc_per_node={nproc_per_node}", f"parallel.nnodes={nnodes}"]
    if rdzv_endpoint:
        overrides.append(f"parallel.rdzv_endpoint={rdzv_endpoint}")
    _train(stage, data, tokenizer, init, config, overrides, check_layout=True)


@app.command()
def evaluate(model: Annotated[str, typer.Option(help="trained model directory (CPT or SFT stage output)")],
             data: Annotated[str, typer.Option(help="curated data directory with the held-out split")],
             config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
    """Zero-shot Pass@1 of a model on the held-out split."""
    cfg = _load(config, set_)
    check_inputs(model=(model, "model"), data=(data, "data"))
    from flows.evaluate import evaluate_flow

    summary = _run(evaluate_flow, sandbox=("eval",), model_dir=model, data_dir=data, cfg=cfg, config=config,
                   overrides=set_ or [])
    typer.echo(f"pass@1={summary['pass@1']:.4f} (n={summary['n']})")


@app.command()
def retrain(config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None,
            data_seed: Annotated[Optional[int], typer.Option(help="data seed (default: from the ISO week)")] = None,
            data_dir: Annotated[Optional[str], typer.Option(help="a curated data directory (skips curation)")] = None
            ) -> None:
    """Retrain with champion/challenger promotion: continue the champion on new data, evaluate both on the
    same benchmarks, promote only a better model (the first run makes the first champion)."""
    cfg = _load(config, set_)
    check_inputs(data_dir=(data_dir, "data"))
    from flows.retrain import retrain_flow

    res = _run(retrain_flow, sandbox=("data", "eval"), cfg=cfg, config=config, overrides=set_ or [],
               data_seed=data_seed, data_dir=data_dir)
    typer.echo(json.dumps({k: v for k, v in res.items() if k != "rows"}, default=str))


@app.command("config")
def show_config(config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None) -> None:
    """Print the resolved configuration (after overrides) as YAML."""
    typer.echo(dump_config(_load(config, set_)))


for module in (model, checkpoint, evaluation, serve, bench, plan, ops):  # each takes what it needs from trex.cli.common
    module.register(app)


def main(prefix: list[str] | None = None) -> None:
    """Entry point (``trex``, ``python -m trex``); ``prefix`` prepends a subcommand."""
    app(args=[*(prefix or []), *sys.argv[1:]], prog_name="trex")
