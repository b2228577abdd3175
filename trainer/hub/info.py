"""What a checkpoint directory holds, from ``config.json`` and the safetensors headers (no weights read):
``trex model-info --checkpoint DIR``."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from trainer.hub.names import hub_kind
from trainer.hub.reader import CheckpointReader, detect_format
from trainer.models.deepseek_v4.model import Transformer
from trainer.models.deepseek_v4.state_dict_adapter import model_config_from_hf

_GROUP_NAMES = {"fp8": "FP8 block-quantised linears", "expert": "routed experts", "bf16": "norms / embeddings / "
                "router / compressor", "f32": "mHC / sinks / position and gate biases", "i64": "hash routing tables"}


def parameter_counts(config: dict) -> dict:
    """Total / activated / MTP parameters of the architecture a (hub, transformers or T-Rex) ``config.json``
    describes, counted on the meta device."""
    from trainer.models.deepseek_v4.args import ModelArgs

    if "trex_model_config" in config:
        args, vocab = ModelArgs(**config["trex_model_config"]), config["vocab_size"]
    else:
        args, vocab = model_config_from_hf(config)
    with torch.device("meta"):
        counts = Transformer(args, vocab).num_params()
    return {**counts, "vocab_size": vocab, "layers": args.num_layers, "experts": args.n_routed_experts}


def _group(name: str, layout: str, quantised: bool) -> str:
    if layout == "hub":
        if quantised and name.endswith(".scale"):
            return "scales of " + ("routed experts" if ".experts." in name else "FP8 linears")
        return _GROUP_NAMES[hub_kind(name)]
    return "routed experts" if ".experts." in name else "other"


def checkpoint_info(root: str | Path) -> dict:
    """Format, shards, dtypes and bytes per tensor group, expert dtype, parameter counts. A directory with
    only ``config.json`` gets the parameter counts alone."""
    root = Path(root)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{root}: no config.json")
    config = json.loads(config_file.read_text())
    info: dict = {"path": str(root), "params": parameter_counts(config)}
    has_weights = (root / "model.safetensors").is_file() or (root / "model.safetensors.index.json").is_file()
    if not has_weights:
        return {**info, "format": "config-only", "expert_dtype": config.get("expert_dtype"),
                "quantization": config.get("quantization_config")}
    info["format"] = detect_format(root)
    with CheckpointReader(root) as reader:  # validates the tensor set against the config
        groups: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "dtypes": set()})
        sizes = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "I64": 8, "I32": 4}
        for name, h in reader.headers.items():
            quantised = reader.scheme is not None and reader.scheme.scale_dtype is not None
            g = groups[_group(name, reader.layout, quantised)]
            g["tensors"] += 1
            g["dtypes"].add(h["dtype"])
            n = 1
            for d in h["shape"]:
                n *= d
            g["bytes"] += n * sizes.get(h["dtype"], 0)
        shards = sorted(set(reader.files.values()))
        info.update(shards=len(shards), tensors=len(reader.headers),
                    shard_bytes_max=max((root / s).stat().st_size for s in shards),
                    scheme=reader.scheme.name if reader.scheme else None,
                    expert_dtype=(reader.scheme.experts if reader.scheme else
                                  next(iter(groups.get("routed experts", {"dtypes": {"?"}})["dtypes"]))),
                    groups={k: {**v, "dtypes": sorted(v["dtypes"])} for k, v in sorted(groups.items())})
    return info
