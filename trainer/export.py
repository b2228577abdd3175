"""HF-style export directory: ``model.safetensors`` + ``config.json`` + tokenizer files.

``load_export`` rebuilds the native model from such a directory (used by evaluation and serving).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.models.deepseek_v4.model import Transformer
from trex.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export(model: Transformer, tokenizer_dir: str | Path, out_dir: str | Path, extra: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["TrexDeepseekV4ForCausalLM"],
        "model_type": "trex_deepseek_v4",
        "vocab_size": model.vocab_size,
        "torch_dtype": "float32",
        "trex_model_config": model.cfg.model_dump(mode="json"),
        **(extra or {}),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copy2(src, out / name)
    return out


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> Transformer:
    model = Transformer(cfg, vocab_size)
    model.init_weights(seed)
    return model


def load_export(path: str | Path) -> Transformer:
    p = Path(path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{p}: no config.json (not a T-Rex export directory)")
    config = json.loads(cfg_file.read_text())
    model = Transformer(ModelConfig(**config["trex_model_config"]), config["vocab_size"])
    state = load_file(str(p / "model.safetensors"))
    if model.cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state)
    model.eval()
    return model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
