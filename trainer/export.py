"""HF export directory: ``model.safetensors`` (``DeepseekV4ForCausalLM`` names and layouts) +
``config.json`` (a ``DeepseekV4Config``, plus ``trex_model_config``) + tokenizer files.

``transformers`` (and vLLM) load it as a DeepSeek-V4 model; ``load_export`` rebuilds the native model
from it, or from any DeepSeek-V4 HF directory (used by evaluation, serving and as an init checkpoint).

An export is atomic: it is written into a hidden sibling ``.<name>.partial``, fsynced and renamed into
place, so a kill mid-export leaves the previous export (or none), never weights without a config or a
truncated ``model.safetensors``; the next export clears the leftover.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.checkpoint import kill_point
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.model import Transformer
from trainer.models.deepseek_v4.state_dict_adapter import from_hf, hf_config, model_config_from_hf, to_hf
from trainer.tokenizer import ChatTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export(model: Transformer, tokenizer_dir: str | Path, out_dir: str | Path, extra: dict | None = None) -> Path:
    """Write the export directory ``out_dir`` atomically (see the module docstring); files of an existing
    ``out_dir`` that the export does not write are kept."""
    final = Path(out_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    out = final.parent / f".{final.name}.partial"
    if out.exists():
        shutil.rmtree(out)  # a killed export's leftover
    out.mkdir()
    state = {k: v.detach().contiguous().clone() for k, v in to_hf(model.state_dict(), model.cfg).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    kill_point("export:weights")
    config = {**hf_config(model.cfg, model.vocab_size), "torch_dtype": "float32",
              "trex_model_config": model.cfg.model_dump(mode="json"), **(extra or {})}
    special = _special_ids(tokenizer_dir)
    if special:  # so that transformers / vLLM / SGLang start with BOS and stop at the end of a turn
        config.update({"bos_token_id": special["bos"], "eos_token_id": [special["end"], special["eos"]],
                       "pad_token_id": special["pad"]})
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": special["bos"], "eos_token_id": [special["end"], special["eos"]],
             "pad_token_id": special["pad"], "do_sample": False}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copy2(src, out / name)
    return _publish(out, final)


def _publish(staged: Path, final: Path) -> Path:
    """fsync ``staged`` and rename it to ``final``; an existing ``final`` is swapped out (its other files
    carried over) and removed only after the new one is in place."""
    if final.is_dir():
        for old in final.iterdir():
            if not (staged / old.name).exists():
                (shutil.copytree if old.is_dir() else shutil.copy2)(old, staged / old.name)
    for f in staged.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    previous = final.parent / f".{final.name}.previous"
    if previous.exists():
        shutil.rmtree(previous)
    if final.exists():
        os.replace(final, previous)
    os.replace(staged, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(previous, ignore_errors=True)
    return final


def _special_ids(tokenizer_dir: str | Path) -> dict[str, int] | None:
    try:
        tok = ChatTokenizer(tokenizer_dir)
    except (FileNotFoundError, KeyError):
        return None
    return {"bos": tok.bos_id, "eos": tok.eos_id, "end": tok.end_id, "pad": tok.pad_id}


def build_model(cfg: ModelArgs, vocab_size: int, seed: int) -> Transformer:
    model = Transformer(cfg, vocab_size)
    model.init_weights(seed)
    return model


def load_export(path: str | Path) -> Transformer:
    p = Path(path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{p}: no config.json (not a model export directory)")
    config = json.loads(cfg_file.read_text())
    if "trex_model_config" in config:
        cfg, vocab = ModelArgs(**config["trex_model_config"]), config["vocab_size"]
    elif config.get("model_type") == "deepseek_v4":
        cfg, vocab = model_config_from_hf(config)
    else:
        raise ValueError(f"{cfg_file}: model_type {config.get('model_type')!r} is not deepseek_v4")
    model = Transformer(cfg, vocab)
    state = from_hf(load_file(str(p / "model.safetensors")), cfg)
    if not cfg.mtp_layers:
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    model.load_state_dict(state)
    model.eval()
    return model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
