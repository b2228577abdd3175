"""The native model of a published (quantised) checkpoint with its FP8 and MXFP4 weights left quantised: the
frozen base of QLoRA (``train.<stage>.lora.base: auto``; ``trainer.qbase``).

Built on the meta device, then filled one tensor at a time: each FP8 ``nn.Linear`` becomes a
``FrozenQuantLinear`` over the file's own codes and block scales, each MoE layer's routed experts a
``FrozenQuantExperts`` over the experts' stacked codes (MXFP4 or FP8) and scales, the grouped ``wo_a`` a dense
bfloat16 copy (exact: FP8 times a power of two), everything else (norms, embeddings, router, hyper-connections,
the BF16 compressor / indexer weights, the MTP head's fused ``eh_proj``) dense float32 as ``load_model`` gives it. Every parameter is frozen; the
routed experts' dense parameters stay on the meta device (``MoE.frozen_experts`` replaces them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainer.hub.quant import dequant_fp4, dequant_fp8
from trainer.hub.reader import CheckpointError, CheckpointReader, check_args
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.model import MoE, Transformer
from trainer.qbase import FrozenQuantExperts, FrozenQuantLinear

_EXPERT_LEAF = {"w_gate": "gate", "w_up": "up", "w_down": "down"}


def dequant(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[out, in]`` of MXFP4 (int8 pairs, E8M0 per 32) or FP8 (128 x 128 block scales) codes, in ``dtype``."""
    if codes.dtype == torch.int8:
        return dequant_fp4(codes, scale, dtype)
    return dequant_fp8(codes, scale, dtype=dtype)


def is_quantised(root: str | Path) -> bool:
    """A published-layout checkpoint with FP8 block weights (what ``lora.base: auto`` keeps quantised)."""
    with CheckpointReader(root) as reader:
        return reader.layout == "hub" and reader.scheme is not None and reader.scheme.scale_dtype is not None


def _set(model: nn.Module, key: str, value: torch.Tensor) -> None:
    path, leaf = key.rsplit(".", 1)
    module = model.get_submodule(path)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise KeyError(key)


def _fp8_linear(model: nn.Module, key: str, reader: CheckpointReader, file_name: str) -> bool:
    """Replace the Linear of weight ``key`` by a ``FrozenQuantLinear`` over the file's codes (False: not FP8)."""
    path = key.rsplit(".", 1)[0]
    module = model.get_submodule(path)
    stored = reader.stored_quantised(file_name)
    if not isinstance(module, nn.Linear) or stored is None or stored[0].dtype != torch.float8_e4m3fn:
        return False
    parent, attr = path.rsplit(".", 1)
    setattr(model.get_submodule(parent), attr, FrozenQuantLinear(stored[0], stored[1], dequant, module.in_features,
                                                                 module.out_features))
    return True


class _ExpertDequant:
    """FP8 experts: dequantise expert by expert (their 128 x 128 blocks do not cross experts)."""

    def __init__(self, n_experts: int):
        self.n = n_experts

    def __call__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if codes.dtype == torch.int8:
            return dequant_fp4(codes, scale, dtype)
        c, s = codes.view(self.n, -1, codes.shape[-1]), scale.view(self.n, -1, scale.shape[-1])
        return torch.cat([dequant_fp8(c[e], s[e], dtype=dtype) for e in range(self.n)])


@dataclass(frozen=True)
class StageHeld:
    """What a pipeline rank holds: its stages' decoder layers, the embedding on the first stage, the head (final
    mHC collapse, norm, LM head) and MTP on the last (as ``parallelize.prune_to_stage`` keeps them)."""

    layers: frozenset[int]
    first: bool
    last: bool

    def wants(self, key: str) -> bool:
        top = key.split(".", 1)[0]
        if top == "layers":
            return int(key.split(".", 2)[1]) in self.layers
        if top == "embed":
            return self.first
        if top in ("hc_head", "norm", "lm_head", "mtp"):
            return self.last
        return True


def load_frozen_base(root: str | Path, args: ModelArgs | None = None, experts: range | None = None,
                     stage: StageHeld | None = None) -> Transformer:
    """The frozen, partly quantised native model of the published checkpoint ``root`` (eval mode). ``experts``: the
    routed experts to hold (an expert-parallel rank's, ``local_experts``; default all); only their codes are read.
    ``stage``: a pipeline rank's part (default: everything); the rest stays on the meta device, unread
    (``drop_foreign`` removes it once the adapters exist)."""
    with CheckpointReader(root) as reader:
        if reader.layout != "hub" or reader.scheme is None or reader.scheme.scale_dtype is None:
            raise CheckpointError(f"{reader.root}: a quantised base needs a published FP8 checkpoint (this one is "
                                  f"{reader.format}{'' if reader.scheme is None else ' ' + reader.scheme.name}); "
                                  f"set lora.base: fp32")
        cfg = check_args(reader, args) if args is not None else reader.args
        held = experts if experts is not None else range(cfg.n_routed_experts)
        if not held or held.start < 0 or held.stop > cfg.n_routed_experts:
            raise ValueError(f"experts {held} is not a range of the checkpoint's {cfg.n_routed_experts} experts")
        with torch.device("meta"):
            model = Transformer(cfg, reader.vocab_size)
        experts: dict[str, dict[str, tuple[list, list]]] = {}
        with torch.no_grad():
            for key in reader.native_keys():
                if stage is not None and not stage.wants(key):
                    continue  # another pipeline stage's
                src = reader.sources[key]
                prefix, leaf = key.rsplit(".", 1)
                if src.kind == "rename" and leaf == "weight" and _fp8_linear(model, key, reader, src.names[0]):
                    continue
                if src.kind == "experts" and leaf in _EXPERT_LEAF:
                    stored = [reader.stored_quantised(src.names[e]) for e in held]
                    if all(s is not None for s in stored):
                        experts.setdefault(prefix, {})[_EXPERT_LEAF[leaf]] = (
                            torch.stack([s[0] for s in stored]), torch.stack([s[1] for s in stored]))
                        continue
                value = reader.read(key)
                _set(model, key, value.to(torch.bfloat16) if src.kind == "wo_a" else value)
        for prefix, parts in experts.items():
            moe = model.get_submodule(prefix)
            if not isinstance(moe, MoE) or sorted(parts) != ["down", "gate", "up"]:
                raise CheckpointError(f"{reader.root}: {prefix}: routed experts only partly quantised ({sorted(parts)})")
            moe.frozen_experts = FrozenQuantExperts({p: c for p, (c, _) in parts.items()},
                                                    {p: s for p, (_, s) in parts.items()},
                                                    _ExpertDequant(len(held)))
    for module in model.modules():  # the non-persistent buffers (RoPE tables, load counters), then their values
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device="cpu")
    model.init_buffers()
    missing = [n for n, p in model.named_parameters() if p.is_meta and n.rsplit(".", 1)[-1] not in _EXPERT_LEAF
               and (stage is None or stage.wants(n))]
    if missing:
        raise CheckpointError(f"{root}: no tensor for {missing[:3]} ({len(missing)})")
    model.requires_grad_(False)
    return model.eval()


def drop_foreign(model: Transformer, held: StageHeld) -> None:
    """Remove what ``load_frozen_base(stage=...)`` left on the meta device -- the other stages' decoder layers (empty
    modules in their places), the embedding off the first stage, the head and MTP off the last: a pipeline rank's
    model then holds no meta tensor, and ``prune_to_stage`` keeps its own part."""
    for i in range(len(model.layers)):
        if i not in held.layers:
            model.layers[i] = nn.Module()
    if not held.first:
        model.embed = None
    if not held.last:
        model.hc_head = model.norm = model.lm_head = None
        model.mtp = nn.ModuleList()


def local_experts(n_experts: int, ep: int, ep_rank: int) -> range:
    """The routed experts expert-parallel rank ``ep_rank`` of ``ep`` holds (``Shard(0)``: contiguous blocks)."""
    if n_experts % ep:
        raise ValueError(f"{n_experts} routed experts cannot be split over ep={ep}")
    k = n_experts // ep
    return range(ep_rank * k, (ep_rank + 1) * k)


def drop_expert_placeholders(model: Transformer) -> None:
    """Remove the routed experts' dense parameters (left on the meta device) of every MoE whose ``frozen_experts``
    holds them quantised, once the adapters are made (their shapes came from them): a parallel engine then finds no
    meta tensor to allocate or shard, and ``MoE.expert_weights`` gives ``None`` for them."""
    for m in model.modules():
        if isinstance(m, MoE) and m.frozen_experts is not None:
            for name in ("w_gate", "w_up", "w_down"):
                if name in m._parameters:
                    if not m._parameters[name].is_meta:
                        raise ValueError(f"{name} holds real weights beside a quantised frozen base")
                    del m._parameters[name]
