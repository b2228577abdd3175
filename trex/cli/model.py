"""``trex model-info``, ``trex generate`` and ``trex score``: inspect, sample from and score models.

Model directories are T-Rex exports, stage outputs holding ``export/`` (CPT/SFT), or any DeepSeek-V4
Hugging Face directory (``config.json`` + safetensors).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from eval.backends import resolve_model_dir
from trex.cli.common import ConfigOpt, SetOpt, err, load, run
from trex.core.refs import MissingInputError

REFERENCE = {"deepseek-v4-flash": (284e9, 13e9), "deepseek-v4-pro": (1.6e12, 49e9)}


def register(app: typer.Typer) -> None:
    @app.command("model-info")
    def model_info(config: ConfigOpt = "configs/tiny.yaml", set_: SetOpt = None,
                   vocab_size: int = typer.Option(129280, help="vocabulary size to count the embedding/LM head with"),
                   checkpoint: Annotated[Optional[str], typer.Option(
                       help="describe this checkpoint directory instead (hub, transformers or T-Rex format; "
                            "config.json alone gives the parameter counts)")] = None) -> None:
        """Build the configured model on the meta device (no memory) and report its parameter counts; or,
        with --checkpoint, a checkpoint's format, shards, dtypes per tensor group and parameter counts."""
        import torch
        from rich.console import Console
        from rich.table import Table

        if checkpoint:
            _checkpoint_info(checkpoint)
            return

        from trainer.metrics import training_flops_per_token
        from trainer.models.deepseek_v4.model import Transformer

        cfg = load(config, set_)
        with torch.device("meta"):
            model = Transformer(cfg.model, vocab_size)
        n = model.num_params()
        table = Table(title=f"{cfg.run.name}: DeepSeek-V4 parameters (vocab {vocab_size})")
        for col in ("total", "activated / token", "MTP head", "train FLOPs / token @ cpt.seq_len"):
            table.add_column(col, justify="right")
        flops = training_flops_per_token(cfg.model, vocab_size, cfg.train.cpt.seq_len)
        table.add_row(f"{n['total'] / 1e9:.2f} B", f"{n['active'] / 1e9:.2f} B", f"{n['mtp'] / 1e9:.2f} B", f"{flops:.3e}")
        ref = REFERENCE.get(cfg.run.name)
        if ref:
            table.add_row(f"reference {ref[0] / 1e9:g} B", f"reference {ref[1] / 1e9:g} B", "", "")
        Console().print(table)
        typer.echo(json.dumps({"name": cfg.run.name, **n, "train_flops_per_token": flops}))

    @app.command()
    def generate(model: Annotated[str, typer.Option(help="model directory")],
                 prompt: Annotated[Optional[list[str]], typer.Option(help="a user message (repeatable)")] = None,
                 input: Annotated[Optional[str], typer.Option(help="JSONL with a 'prompt' or 'messages' field per line")] = None,
                 output: Annotated[Optional[str], typer.Option(help="write JSONL here (default: stdout)")] = None,
                 max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, seed: int = 42,
                 batch_size: int = 8, stop: Annotated[Optional[list[str]], typer.Option(help="stop string")] = None,
                 raw: bool = typer.Option(False, help="feed the prompt as plain text, without the chat template")) -> None:
        """Generate completions (batched, cached decoding; greedy or temperature/top-p sampling)."""
        run(_generate, model=model, prompts=prompt or [], input=input, output=output, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, seed=seed, batch_size=batch_size, stop=stop or [], raw=raw)

    @app.command()
    def score(model: Annotated[str, typer.Option(help="model directory")],
              input: Annotated[str, typer.Option(help="JSONL with a 'text' (or 'messages') field per line")],
              output: Annotated[Optional[str], typer.Option(help="write JSONL here (default: stdout)")] = None,
              adapter: Annotated[Optional[str], typer.Option(help="a LoRA adapter directory (a LoRA stage's "
                                                              "adapter/) applied to the model, unmerged")] = None
              ) -> None:
        """Per-token log-probabilities of each input under the model (perplexity, outside parity checks)."""
        run(_score, model=model, input=input, output=output, adapter=adapter)


def _read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise MissingInputError(f"{p}: input file does not exist")
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise MissingInputError(f"{p}:{i}: not JSON ({e.msg})") from e
        if not isinstance(row, dict) or not any(f in row for f in fields):
            raise MissingInputError(f"{p}:{i}: needs one of the fields {list(fields)}")
        rows.append(row)
    return rows


def _write(rows: list[dict], output: str | None) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if output:
        Path(output).write_text(text)
    else:
        sys.stdout.write(text)


def _generate(model: str, prompts: list[str], input: str | None, output: str | None, max_new_tokens: int,
              temperature: float, top_p: float, seed: int, batch_size: int, stop: list[str], raw: bool) -> None:
    from trainer.export import load_export
    from trainer.generate import generate, stop_strings
    from trainer.tokenizer import ChatTokenizer

    d = resolve_model_dir(model)
    net, tok = load_export(d), ChatTokenizer(d)
    items = [{"prompt": p} for p in prompts] + (_read_jsonl(input, ("prompt", "messages")) if input else [])
    if not items:
        raise typer.BadParameter("give --prompt or --input")
    encoded = []
    for it in items:
        if raw:
            encoded.append(tok.encode_text(it.get("prompt") or ""))
        else:
            messages = it.get("messages") or [{"role": "user", "content": it["prompt"]}]
            encoded.append(tok.encode_chat(messages, add_generation_prompt=True)[0])
    rows = []
    for s in range(0, len(items), batch_size):
        outs = generate(net, encoded[s:s + batch_size], max_new_tokens, {tok.end_id, tok.eos_id}, tok.pad_id,
                        temperature, top_p, seed + s, stop_strings(tok.decode, stop))
        for it, o in zip(items[s:s + batch_size], outs):
            rows.append({**it, "completion": tok.decode(o), "tokens": len(o)})
    _write(rows, output)


def _checkpoint_info(path: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from trainer.hub.info import checkpoint_info
    from trainer.hub.reader import CheckpointError

    try:
        info = checkpoint_info(path)
    except (CheckpointError, FileNotFoundError) as e:
        err.print(f"[red]error:[/] {e}", highlight=False)
        raise typer.Exit(2)
    p = info["params"]
    title = (f"{path}: {info['format']}" + (f", {info['shards']} shards" if "shards" in info else "")
             + (f", experts {info['expert_dtype']}" if info.get("expert_dtype") else ""))
    table = Table(title=title)
    for col in ("tensor group", "tensors", "dtypes", "MB"):
        table.add_column(col, justify="right")
    for name, g in info.get("groups", {}).items():
        table.add_row(name, str(g["tensors"]), ", ".join(g["dtypes"]), f"{g['bytes'] / 1e6:,.3f}")
    table.add_row("parameters", f"{p['total'] / 1e9:.2f} B total", f"{p['active'] / 1e9:.2f} B activated",
                  f"{p['mtp'] / 1e9:.2f} B MTP")
    Console().print(table)
    typer.echo(json.dumps(info, default=str))


def _score(model: str, input: str, output: str | None, adapter: str | None = None) -> None:
    import torch

    from trainer.export import load_export
    from trainer.tokenizer import ChatTokenizer

    d = resolve_model_dir(model)
    net, tok = load_export(d), ChatTokenizer(d)
    if adapter is not None:
        from trainer.lora import load_adapter

        load_adapter(net, adapter).eval()
    rows = []
    for row in _read_jsonl(input, ("text", "messages")):
        ids = tok.encode_chat(row["messages"])[0] if "messages" in row else tok.encode_text(row["text"])
        ids = ids[:net.cfg.max_seq_len]
        with torch.no_grad():
            logp = torch.log_softmax(net(torch.tensor([ids]))[0, :-1].float(), dim=-1)
        lp = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        rows.append({**row, "tokens": [tok.decode([t]) for t in ids[1:]], "token_ids": ids[1:], "logprobs": lp,
                     "sum_logprob": sum(lp), "perplexity": float(torch.tensor(lp).neg().mean().exp()) if lp else None})
    _write(rows, output)
