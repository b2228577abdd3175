"""``trex convert`` and ``trex hub-fixture``: DeepSeek-V4 checkpoints between the published (hub), transformers
and T-Rex formats (docs/checkpoints.md), and a tiny stand-in for the published checkpoint."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from trex.cli.common import err


def register(app: typer.Typer) -> None:
    @app.command()
    def convert(src: Annotated[str, typer.Argument(help="a hub / transformers / T-Rex checkpoint directory, or a "
                                                        "training run's DCP checkpoint (a step, or its checkpoints/)")],
                dst: Annotated[str, typer.Argument(help="output directory (written atomically)")],
                to: Annotated[str, typer.Option(help="hub-fp8 | hub-bf16 | hf")] = "hub-fp8",
                scheme: Annotated[Optional[str], typer.Option(
                    help="hub-fp8: flash (FP8 + E8M0, MXFP4 experts) | flash-base (FP8 + float32 scales); "
                         "default: the source's own, else flash")] = None,
                like: Annotated[Optional[str], typer.Option(
                    help="a published checkpoint whose config.json and scheme a hub target keeps (and whose "
                         "bytes its unchanged quantised tensors keep)")] = None,
                tokenizer: Annotated[Optional[str], typer.Option(help="tokenizer directory to copy in")] = None,
                shard_gb: Annotated[float, typer.Option(help="maximum shard size in GB")] = 4.0,
                workers: Annotated[Optional[int], typer.Option(
                    help="tensors converted at once (default: the CPUs, at most 4)")] = None,
                fsync: Annotated[bool, typer.Option(
                    help="flush each shard to disk as it is finished, before the output is published")] = True,
                adapter: Annotated[Optional[str], typer.Option(
                    help="a LoRA adapter directory (a LoRA stage's adapter/, PEFT layout) merged into SRC's "
                         "weights: float32, then the target's scheme")] = None) -> None:
        """Convert a checkpoint tensor by tensor (memory: about one shard), never gathering the model."""
        from trainer.hub.convert import convert as run_convert
        from trainer.hub.reader import CheckpointError, CheckpointReader

        ref = None
        try:
            source_config = None
            if like:
                ref = CheckpointReader(like)
                source_config = ref.config if ref.format == "hub" else None
                if scheme is None and ref.scheme is not None and ref.scheme.scale_dtype is not None:
                    scheme = ref.scheme.name
                if ref.format != "hub":
                    ref.close()
                    ref = None
            summary = run_convert(src, dst, to, scheme, tokenizer, int(shard_gb * 1e9), source_config=source_config,
                                  reference=ref, workers=workers, fsync=fsync, adapter=adapter)
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            err.print(f"[red]error:[/] {e}", highlight=False)
            raise typer.Exit(2)
        finally:
            if ref is not None:
                ref.close()
        typer.echo(json.dumps(summary))

    @app.command("hub-fixture")
    def hub_fixture(out: Annotated[str, typer.Argument(help="output directory")],
                    variant: Annotated[str, typer.Option(help="flash (FP8 + E8M0, MXFP4 experts) | flash-base "
                                                             "(FP8 + float32 scales)")] = "flash",
                    tokenizer: Annotated[Optional[str], typer.Option(help="tokenizer directory to ship with it")] = None,
                    seed: int = 0) -> None:
        """Write a tiny random checkpoint in the exact published DeepSeek-V4 layout (a stand-in for the hub
        download: same names, dtypes, quantisation, shards, index and MTP block)."""
        import tempfile

        from trainer.hub.fixture import write_hub_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            if tokenizer is None:  # a DeepSeek-V4-style tokenizer (its special tokens and chat format), trained here
                tokenizer = str(_stand_in_tokenizer(tmp))
            path = write_hub_checkpoint(out, variant, seed=seed, tokenizer_dir=tokenizer)
        typer.echo(str(path))


def _stand_in_tokenizer(tmp: str, vocab_size: int = 512):
    """A small byte-level BPE with DeepSeek-V4's special tokens, trained on the prompt text of OR problems."""
    from pathlib import Path

    from eval.prompts import SYSTEM_PROMPT
    from trainer.tokenizer import train_tokenizer

    words = ("maximise minimise profit cost subject to capacity demand supply x y z import pulp model += "
             "print solve LpProblem LpVariable lowBound value status objective constraint 0 1 2 3 4 5 6 7 8 9")
    texts = [SYSTEM_PROMPT, words] * 20
    out = Path(tmp) / "tokenizer"
    train_tokenizer(texts, out, vocab_size, 1, style="deepseek_v4")
    return out
