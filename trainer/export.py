"""The export directory of a training stage, in any of the checkpoint formats (``trainer.hub``):
``hf`` (default: ``DeepseekV4ForCausalLM`` names and layouts, float32, ``config.json`` a
``DeepseekV4Config`` plus ``trex_model_config``), ``hub-fp8`` or ``hub-bf16`` (the published layout), plus
the tokenizer files and ``generation_config.json``.

``transformers`` loads the ``hf`` form, vLLM and SGLang the hub forms; ``load_export`` rebuilds the native
model from any of them (used by evaluation, serving and as an init checkpoint).

An export is atomic: it is written into a hidden sibling ``.<name>.partial``, fsynced and renamed into
place, so a kill mid-export leaves the previous export (or none), never weights without a config or a
truncated shard; the next export clears the leftover.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from trainer.checkpoint import kill_point
from trainer.hub.convert import publish, stage_dir
from trainer.hub.dcp_source import DcpSource
from trainer.hub.reader import CheckpointReader, Scheme, load_model
from trainer.hub.writer import Target, write_checkpoint
from trainer.lora import has_lora, merge_state, merged_state
from trex.core.config import LoRAConfig
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.model import Transformer
from trainer.tokenizer import ChatTokenizer, copy_tokenizer_files


def export(model: Transformer, tokenizer_dir: str | Path, out_dir: str | Path, extra: dict | None = None,
           to: Target = "hf", scheme: Scheme | None = None, source_config: dict | None = None,
           reference: CheckpointReader | None = None) -> Path:
    """Write the export directory ``out_dir`` of an in-memory model atomically (see the module docstring),
    tensor by tensor; files of an existing ``out_dir`` that the export does not write (other than weights)
    are kept; a model with LoRA adapters is written with them merged (``trainer.lora.merged_state``). ``source_config``: a hub source's ``config.json``, kept as published for a hub target;
    ``reference``: a hub checkpoint whose bytes unchanged quantised tensors keep (``trainer.hub.writer.hub_stream``)."""
    state = merged_state(model) if has_lora(model) else ((k, v.detach()) for k, v in model.state_dict().items())
    return write_export(state, model.cfg, model.vocab_size, tokenizer_dir, out_dir, extra, to, scheme, source_config,
                        reference)


def export_checkpoint(ckpt: str | Path, tokenizer_dir: str | Path, out_dir: str | Path, extra: dict | None = None,
                      to: Target = "hf", scheme: Scheme | None = None, source_config: dict | None = None) -> Path:
    """The export of a training run's DCP checkpoint (a step directory, or the newest under ``ckpt``), written
    under any parallel layout: read a group of tensors at a time in this one process, never the whole model."""
    src = DcpSource(ckpt)
    tensors = src.iter_tensors()
    lora = src.lora()
    if lora is not None:  # a LoRA run: its adapters merged on the way
        tensors = merge_state(tensors, lora[0], LoRAConfig(**lora[1]).scale)
    return write_export(tensors, src.args, src.vocab_size, tokenizer_dir, out_dir, extra, to, scheme,
                        source_config)


def write_export(tensors: Iterable[tuple[str, torch.Tensor]], args: ModelArgs, vocab_size: int,
                 tokenizer_dir: str | Path, out_dir: str | Path, extra: dict | None = None, to: Target = "hf",
                 scheme: Scheme | None = None, source_config: dict | None = None,
                 reference: CheckpointReader | None = None) -> Path:
    final = Path(out_dir)
    out = stage_dir(final)
    special = _special_ids(tokenizer_dir)
    config_extra = dict(extra or {})
    if special:  # so that transformers / vLLM / SGLang start with BOS and stop at the end of a turn
        ids = {"bos_token_id": special["bos"], "eos_token_id": [special["end"], special["eos"]]
               if special["end"] != special["eos"] else special["eos"], "pad_token_id": special["pad"]}
        config_extra.update(ids)
        (out / "generation_config.json").write_text(json.dumps({**ids, "do_sample": False}, indent=2))
    write_checkpoint(out, tensors, args, vocab_size, to, scheme, source_config, config_extra,
                     on_weights=lambda: kill_point("export:weights"), reference=reference, fsync=True, prefetch=2,
                     writers=2)
    copy_tokenizer_files(tokenizer_dir, out)
    return publish(out, final)


def _special_ids(tokenizer_dir: str | Path) -> dict[str, int] | None:
    try:
        tok = ChatTokenizer(tokenizer_dir)
    except (FileNotFoundError, KeyError, ValueError):
        return None
    return {"bos": tok.bos_id, "eos": tok.eos_id, "end": tok.end_id, "pad": tok.pad_id}


def build_model(cfg: ModelArgs, vocab_size: int, seed: int) -> Transformer:
    model = Transformer(cfg, vocab_size)
    model.init_weights(seed)
    return model


def load_export(path: str | Path, args: ModelArgs | None = None) -> Transformer:
    """The native model (fp32, eval mode) from a hub, transformers or T-Rex checkpoint directory."""
    return load_model(path, args)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
