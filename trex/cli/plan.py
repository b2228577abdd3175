"""``trex plan``: judge a parallel layout without hardware -- per-rank memory and pipeline bubble."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from trex.cli.common import ConfigOpt, SetOpt, load


def register(app: typer.Typer) -> None:
    @app.command()
    def plan(config: ConfigOpt = "configs/deepseek_v4_flash.yaml", set_: SetOpt = None,
             nodes: Annotated[int, typer.Option(help="nodes")] = 1,
             devices_per_node: Annotated[int, typer.Option("--devices-per-node", help="ranks per node")] = 8,
             device: Annotated[str, typer.Option(help="910b | 910c | a100 | h100 | h200 (memory per device)")] = "910c",
             stage: Annotated[str, typer.Option(help="which train section sets batch, seq_len, optimizer")] = "cpt",
             memory_gib: Annotated[Optional[float], typer.Option(help="device memory (default: from --device)")] = None,
             reserve_gib: Annotated[float, typer.Option(help="workspace, buffers, fragmentation")] = 4.0,
             vocab_size: Annotated[int, typer.Option(help="vocabulary (V4: 129280)")] = 129280,
             lora: Annotated[bool, typer.Option(help="LoRA / QLoRA on one node instead of full training: the "
                                                     "frozen base (quantised unless train.<stage>.lora.base says "
                                                     "otherwise) and the adapters per device")] = False,
             lora_rank: Annotated[Optional[int], typer.Option(help="--lora: the rank (default: the stage's "
                                                                   "lora.rank, else 16)")] = None) -> None:
        """Per-rank parameter, gradient, optimizer and activation memory of the config's ``parallel`` layout on
        ``nodes x devices-per-node`` devices, the pipeline bubble, and whether it fits (exit 1 if not). With
        ``--lora``: the per-device memory of LoRA over every expert on ``devices-per-node`` devices (``--stage``
        defaults to sft)."""
        from rich.console import Console

        from trainer.parallel.dims import LayoutError, ParallelDims
        from trainer.engines.plan import DEVICE_MEMORY_GIB, plan_layout

        cfg = load(config, set_)
        console = Console()
        device = device.lower()
        if device not in DEVICE_MEMORY_GIB and memory_gib is None:
            console.print(f"[red]unknown device {device!r}[/]; known: {sorted(DEVICE_MEMORY_GIB)} (or --memory-gib)")
            raise typer.Exit(2)
        world = nodes * devices_per_node
        if lora:
            _plan_lora(cfg, console, "sft" if stage == "cpt" else stage, devices_per_node, device, memory_gib,
                       reserve_gib, vocab_size, lora_rank)
            return
        try:
            dims = ParallelDims.from_config(cfg.parallel, world)
        except LayoutError as e:
            console.print(f"[red]layout error:[/] {e}", highlight=False)
            raise typer.Exit(1)
        tc = getattr(cfg.train, stage)
        pc = cfg.parallel
        p = plan_layout(cfg.model, vocab_size, dims, tc.seq_len, tc.batch_size, device, pc.pp_schedule,
                        pc.pp_microbatches, pc.pp_layers, tc.optimizer, tc.activation_checkpointing, reserve_gib,
                        memory_gib, pc.sequence_parallel)
        w = p.worst
        rows = [("world", f"{p.world}"), ("pipeline schedule", pc.pp_schedule if dims.pp > 1 else "-"),
                ("micro-batches x rows x seq_len", f"{p.microbatches} x {p.micro_batch_rows} x {p.seq_len}"),
                ("pipeline bubble", f"{p.bubble:.1%}"),
                ("heaviest rank: stage, decoder layers", f"{w.stage}, {w.layers}"),
                ("parameters on it", f"{w.params / 1e9:.2f} B"),
                ("weights (fp32)", f"{w.weights_gib:.1f} GiB"), ("gradients (fp32)", f"{w.grads_gib:.1f} GiB"),
                (f"optimizer ({tc.optimizer})", f"{w.optimizer_gib:.1f} GiB"),
                ("FSDP unsharded buffers", f"{w.fsdp_buffers_gib:.1f} GiB"),
                (f"activations (recompute: {tc.activation_checkpointing}"
                 + (", sequence parallel)" if pc.sequence_parallel and dims.tp > 1 else ")"), f"{w.activations_gib:.1f} GiB"),
                ("reserve", f"{reserve_gib:.1f} GiB"), ("total", f"{w.total_gib:.1f} GiB")]
        _verdict(console, f"{cfg.run.name}: {p.layout} on {nodes}x{devices_per_node} {device} "
                 f"({p.capacity_gib:g} GiB)", "quantity", rows, p.feasible, p.reasons,
                 f"{w.total_gib:.1f} of {p.capacity_gib:g} GiB on the heaviest rank")


def _verdict(console, title: str, first: str, rows: list[tuple[str, str]], feasible: bool, reasons: list[str],
             fits: str) -> None:
    """The plan's table, then feasible (return) or each reason it is not (exit 1)."""
    from rich.table import Table

    t = Table(title=title)
    t.add_column(first)
    t.add_column("value", justify="right")
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if feasible:
        console.print(f"[green]feasible[/]: {fits}")
        return
    for reason in reasons:
        console.print(f"[red]infeasible[/]: {reason}", highlight=False)
    raise typer.Exit(1)


def _plan_lora(cfg, console, stage: str, devices: int, device: str, memory_gib, reserve_gib: float, vocab_size: int,
               rank: int | None) -> None:
    from trainer.engines.plan import plan_lora

    tc = getattr(cfg.train, stage)
    lc = tc.lora
    r = rank or lc.rank or 16
    recompute = tc.activation_checkpointing if tc.activation_checkpointing != "none" else "block"
    p = plan_lora(cfg.model, vocab_size, devices, tc.seq_len, r, list(lc.targets), device, recompute,
                  quantised=lc.base == "auto", reserve_gib=reserve_gib, capacity_gib=memory_gib)
    base = "quantised (FP8 / MXFP4)" if lc.base == "auto" else "float32"
    rows = [("frozen base: routed experts / ep", f"{p.base_experts_gib:.1f} GiB"),
                 ("frozen base: the rest (replicated)", f"{p.base_dense_gib:.1f} GiB"),
                 (f"  (whole base, {base})", f"{p.quantised_file_gib:.1f} GiB"),
                 ("adapter parameters", f"{p.adapter_params / 1e6:.1f} M"),
                 ("adapters: fp32 weights + grads + AdamW", f"{p.adapter_gib:.1f} GiB"),
                 (f"activations ({p.micro_batch_rows} x {p.seq_len} tokens, recompute: {recompute})",
                  f"{p.activations_gib:.1f} GiB"),
                 ("one projection dequantised (bf16)", f"{p.dequant_gib:.2f} GiB"),
                 ("reserve", f"{p.reserve_gib:.1f} GiB"), ("total", f"{p.total_gib:.1f} GiB")]
    _verdict(console, f"{cfg.run.name}: LoRA r={r} on 1x{devices} {device} ({p.capacity_gib:g} GiB), ep={p.ep}",
             "per device", rows, p.feasible, p.reasons, f"{p.total_gib:.1f} of {p.capacity_gib:g} GiB per device")
