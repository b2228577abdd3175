"""Low-rank adapters (LoRA) on a frozen DeepSeek-V4 base: every targeted projection of every block, the routed
experts included (docs/lora.md).

- :func:`apply_lora` freezes the model and attaches the adapters ``train.<stage>.lora`` names: a
  :class:`DenseLoRA` under each targeted ``nn.Linear`` (``attn.wq_a.lora.a`` ``[r, in]`` / ``.b`` ``[out, r]``,
  PEFT's orientation; added to the module's output by a forward hook), and one :class:`ExpertLoRA` per MoE layer
  (``ffn.lora.a_gate`` ``[E, D, r]`` / ``b_gate`` ``[E, r, I]``, the same for up and down: every expert its
  own factors, stacked, computed inside the grouped expert GEMMs by ``kernels.moe_experts_lora``; sharded over
  ``ep`` with the experts, ``parallelize.py``). B starts at zero, so the adapted model starts as the base.
- :func:`merged_state` is the model's state with every adapter folded in (float32 products, then the weight's
  dtype), the adapters' own keys left out: what an export writes.
- :func:`adapter_tensors` / :func:`adapter_config` are the adapter in PEFT's layout, per-expert tensors under the
  checkpoint's own names (what vLLM's MoE LoRA loader reads; PEFT fuses them into ``mlp.experts.gate_up_proj`` /
  ``down_proj``): ``../shared/reference/moe-lora-adapter-format.md``, option A; :func:`load_adapter` reads it back.

The MTP heads are not adapted (vLLM skips ``mtp.`` adapters); the aux-loss-free expert bias stays as loaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kernels import moe_experts_lora
from trainer.models.deepseek_v4.layers import shard_of
from trainer.models.deepseek_v4.model import MoE, Transformer
from trainer.qbase import FrozenQuantLinear
from trex.core.config import LoRAConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TREX_LORA = "trex_lora.json"  # the whole LoRAConfig, beside PEFT's files
PEFT_PREFIX = "base_model.model.model."

# target -> (native module path inside a block, transformers' module name for PEFT's target_modules)
DENSE = {
    "attn.wq_a": ("attn.wq_a", "self_attn.q_a_proj"), "attn.wq_b": ("attn.wq_b", "self_attn.q_b_proj"),
    "attn.wkv": ("attn.wkv", "self_attn.kv_proj"), "attn.wo_b": ("attn.wo_b", "self_attn.o_b_proj"),
    "attn.compressor.wkv": ("attn.compressor.wkv", "self_attn.compressor.kv_proj"),
    "attn.compressor.wgate": ("attn.compressor.wgate", "self_attn.compressor.gate_proj"),
    "attn.indexer.wq_b": ("attn.indexer.wq_b", "compressor.indexer.q_b_proj"),
    "attn.indexer.weights_proj": ("attn.indexer.weights_proj", "compressor.indexer.scorer.weights_proj"),
    "attn.indexer.compressor.wkv": ("attn.indexer.comp.wkv", "compressor.indexer.kv_proj"),
    "attn.indexer.compressor.wgate": ("attn.indexer.comp.wgate", "compressor.indexer.gate_proj"),
    "ffn.shared.w1": ("ffn.shared.w1", "shared_experts.gate_proj"),
    "ffn.shared.w2": ("ffn.shared.w2", "shared_experts.down_proj"),
    "ffn.shared.w3": ("ffn.shared.w3", "shared_experts.up_proj"),
}
EXPERTS = {"ffn.experts.w1": "gate", "ffn.experts.w3": "up", "ffn.experts.w2": "down"}
_EXPERT_WEIGHT = {"gate": "w_gate", "up": "w_up", "down": "w_down"}
_HUB_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}
_HUB_NAME = {"ffn.shared.w1": "ffn.shared_experts.w1", "ffn.shared.w2": "ffn.shared_experts.w2",
             "ffn.shared.w3": "ffn.shared_experts.w3", "attn.indexer.comp.wkv": "attn.indexer.compressor.wkv",
             "attn.indexer.comp.wgate": "attn.indexer.compressor.wgate"}


class LoRAError(ValueError):
    """A LoRA configuration or adapter file that cannot be applied (names the target, key or file)."""


class DenseLoRA(nn.Module):
    """``y += scale * dropout(x) @ a.T @ b.T`` on an ``nn.Linear``'s output (``a [r, in]``, ``b [out, r]``)."""

    def __init__(self, linear: nn.Linear | FrozenQuantLinear, rank: int, scale: float, dropout: float,
                 device: torch.device | str | None = None):
        super().__init__()
        out_f, in_f = linear.out_features, linear.in_features
        dev = device or (next(iter(linear.buffers())).device if isinstance(linear, FrozenQuantLinear)
                         else linear.weight.device)
        self.a = nn.Parameter(torch.empty(rank, in_f, device=dev))
        self.b = nn.Parameter(torch.zeros(out_f, rank, device=dev))
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))  # PEFT's default A; B zero: the base at step 0
        self.scale, self.drop = scale, nn.Dropout(dropout) if dropout else nn.Identity()

    # the seam for tensor parallelism (``parallelize.apply_tp`` replaces it per instance): the rank-r product
    # ``x a.T`` of a column-parallel linear (``b`` split by rows) sums its gradient over tp; of a row-parallel one
    # (``a`` split by columns, ``x`` a slice) it is a partial sum, reduced before ``b``
    @staticmethod
    def tp_z(z: torch.Tensor) -> torch.Tensor:
        return z

    @staticmethod
    def hook(linear: nn.Linear, args, out: torch.Tensor) -> torch.Tensor:
        lora = linear.lora
        x = lora.drop(args[0])
        z = lora.tp_z(F.linear(x, shard_of(lora.a).to(x.dtype)))
        return out + lora.scale * F.linear(z, shard_of(lora.b).to(x.dtype))


class ExpertLoRA(nn.Module):
    """Per-expert factors for the routed experts' projections in ``projections`` (``a_<p> [E, D_in, r]``,
    ``b_<p> [E, r, D_out]``), run by ``kernels.moe_experts_lora`` on the expert weights ``MoE.routed`` passes
    (local shards under expert parallelism)."""

    def __init__(self, moe: MoE, projections: list[str], rank: int, scale: float,
                 device: torch.device | str | None = None):
        super().__init__()
        self.projections, self.scale = list(projections), scale
        for p in self.projections:
            w = moe.get_parameter(_EXPERT_WEIGHT[p])  # (on the meta device under a quantised base)
            e, d_in, d_out = w.shape
            dev = device or moe.gate.weight.device
            a = torch.empty(e, d_in, rank, device=dev)
            for i in range(e):  # each expert's A as PEFT draws one ([r, in], kaiming), kept transposed
                nn.init.kaiming_uniform_(a[i].T, a=math.sqrt(5))
            self.register_parameter(f"a_{p}", nn.Parameter(a))
            self.register_parameter(f"b_{p}", nn.Parameter(torch.zeros(e, rank, d_out, device=dev)))

    def factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {p: (shard_of(getattr(self, f"a_{p}")), shard_of(getattr(self, f"b_{p}"))) for p in self.projections}

    def forward(self, x_nd, idx_nk, w_nk, base, limit: float) -> torch.Tensor:
        return moe_experts_lora(x_nd, idx_nk, w_nk, base, self.factors(), self.scale, limit)


def _blocks(model: Transformer) -> list[tuple[str, nn.Module]]:
    return [(f"layers.{i}", block) for i, block in enumerate(model.layers)]


def submodule_or_none(block: nn.Module, path: str) -> nn.Module | None:
    """``block``'s submodule at the dotted ``path``, or None where a part is missing (an indexer on a non-CSA layer)."""
    m = block
    for part in path.split("."):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m


def apply_lora(model: Transformer, cfg: LoRAConfig, seed: int = 0,
               device: torch.device | str | None = None) -> list[nn.Parameter]:
    """Freeze ``model`` and attach ``cfg``'s adapters (seeded: the same A for the same seed; on ``device``, by
    default the base's: a model on the meta device gets real adapters with ``device="cpu"``); the trainable
    parameters. A target that matches no module of any block is an error (nothing is left out silently)."""
    if not cfg.rank:
        raise LoRAError("apply_lora needs lora.rank > 0")
    if has_lora(model):
        raise LoRAError("the model already has adapters")
    model.requires_grad_(False)
    model.balance_experts = False
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        found = {t: 0 for t in cfg.targets}
        projections = [EXPERTS[t] for t in cfg.targets if t in EXPERTS]
        for _, block in _blocks(model):
            for t in cfg.targets:
                if t in DENSE:
                    lin = submodule_or_none(block, DENSE[t][0])
                    if isinstance(lin, (nn.Linear, FrozenQuantLinear)):
                        lin.lora = DenseLoRA(lin, cfg.rank, cfg.scale, cfg.dropout, device)
                        lin.register_forward_hook(DenseLoRA.hook)
                        found[t] += 1
            if projections:
                block.ffn.lora = ExpertLoRA(block.ffn, sorted(projections, key=list(_EXPERT_WEIGHT).index),
                                            cfg.rank, cfg.scale, device)
                for t in cfg.targets:
                    found[t] += t in EXPERTS
    finally:
        torch.random.set_rng_state(gen_state)
    missing = [t for t, n in found.items() if n == 0]
    if missing:
        raise LoRAError(f"lora.targets {missing} match no module of this model (attention kinds "
                        f"{sorted(set(model.cfg.attention_types))}: a compressor / indexer exists on compressed layers only)")
    return [p for n, p in model.named_parameters() if p.requires_grad]


def bf16_base(model: Transformer) -> None:
    """``lora.base: bf16``: the frozen projections (every Linear but the head, the grouped ``wo_a``, the routed
    experts) kept as bfloat16 copies; norms, embeddings and the head stay float32. Needs bf16 autocast training."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and not name.endswith("lm_head") and not m.weight.requires_grad:
                m.weight.data = m.weight.data.to(torch.bfloat16)
            if isinstance(m, MoE):
                for w in _EXPERT_WEIGHT.values():
                    getattr(m, w).data = getattr(m, w).data.to(torch.bfloat16)
        for block in model.layers:
            block.attn.wo_a.data = block.attn.wo_a.data.to(torch.bfloat16)


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, (DenseLoRA, ExpertLoRA)) for m in model.modules())


def lora_modules(model: Transformer) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """``(native weight prefix, adapted module, adapter)`` for every adapter: a Linear's prefix (``layers.0.attn.wq_a``)
    or an MoE layer's (``layers.0.ffn``)."""
    for name, m in model.named_modules():
        lora = getattr(m, "lora", None)
        if isinstance(lora, (DenseLoRA, ExpertLoRA)):
            yield name, m, lora


def _base_state(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """The frozen base's state dict in the key order of the plain model, float32: a quantised weight dequantised,
    the stacked experts of a quantised base included (their own parameters are on the meta device)."""
    quant = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, FrozenQuantLinear)}
    experts = {f"{n}.{w}": (m.frozen_experts, p) for n, m in model.named_modules()
               if isinstance(m, MoE) and m.frozen_experts is not None for p, w in _EXPERT_WEIGHT.items()}
    state = model.state_dict()
    with torch.device("meta"):
        order = Transformer(model.cfg, model.vocab_size).state_dict().keys()
    for k in order:
        if k in quant:
            v = quant[k].weight_as(torch.float32)
        elif k in experts:
            frozen, p = experts[k]
            v = frozen.weight(p, torch.float32).contiguous()
        else:
            v = state[k].detach()
        yield k, v.float() if v.is_floating_point() else v  # (a frozen base may hold bf16 copies)


def merged_state(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict with every adapter merged (:func:`merge_state`: ``W + scale * B A`` in float32),
    without the adapters' keys, in the plain model's key order: what the export of an adapted model writes, one
    tensor at a time."""
    scales = {lora.scale for _, _, lora in lora_modules(model)}
    if len(scales) != 1:
        raise LoRAError(f"the model's adapters have {len(scales)} scales ({sorted(scales)}); one expected")
    with torch.no_grad():
        yield from merge_state(_base_state(model), lora_state(model), scales.pop())


def _hub(prefix: str) -> str:
    layer, _, rest = prefix.partition(".")[2].partition(".")
    return f"layers.{layer}.{_HUB_NAME.get(rest, rest)}"


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' own tensors by their model names (``layers.0.attn.wq_a.lora.a``, ``layers.0.ffn.lora.b_up``)."""
    return {k: v.detach() for k, v in model.state_dict().items() if ".lora." in k}


def _factor_pairs(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, str | None, torch.Tensor, torch.Tensor]]:
    """``(module prefix, expert projection or None, A, B)`` of every adapter in a :func:`lora_state` dict."""
    for k, a in state.items():
        prefix, _, leaf = k.rpartition(".lora.")
        if leaf == "a":
            yield prefix, None, a, state[f"{prefix}.lora.b"]
        elif leaf.startswith("a_"):
            yield prefix, leaf[2:], a, state[f"{prefix}.lora.b_{leaf[2:]}"]


def adapter_tensors(model_or_state) -> dict[str, torch.Tensor]:
    """The adapter in PEFT's file layout with the checkpoint's names (option A of the reference note):
    ``base_model.model.model.layers.L.attn.wq_a.lora_A.weight [r, in]`` / ``lora_B.weight [out, r]``, and per expert
    ``...ffn.experts.e.w1|w3|w2.lora_A.weight [r, in]`` / ``lora_B.weight [out, r]`` (scales not folded in). From a
    model or a :func:`lora_state` dict (a distributed run's checkpoint)."""
    state = model_or_state if isinstance(model_or_state, dict) else lora_state(model_or_state)
    out = {}
    for prefix, p, a, b in _factor_pairs(state):
        hub = PEFT_PREFIX + _hub(prefix)
        a, b = a.float(), b.float()
        if p is None:
            out[f"{hub}.lora_A.weight"], out[f"{hub}.lora_B.weight"] = a.contiguous(), b.contiguous()
            continue
        for e in range(a.shape[0]):
            out[f"{hub}.experts.{e}.{_HUB_EXPERT[p]}.lora_A.weight"] = a[e].T.contiguous()
            out[f"{hub}.experts.{e}.{_HUB_EXPERT[p]}.lora_B.weight"] = b[e].T.contiguous()
    return out


def add_deltas(tensors, deltas: dict[str, Callable[[torch.Size], torch.Tensor]],
               where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A stream of native ``(key, tensor)`` with ``deltas[key](shape)`` (float32, the native orientation) added
    in float32, then the tensor's dtype; adapters' own keys dropped. Every key of ``deltas`` must pass by: an
    adapter for another base is an error naming ``where``, not a no-op."""
    seen = set()
    for k, v in tensors:
        if ".lora." in k:
            continue
        if k in deltas:
            v = (v.float() + deltas[k](v.shape)).to(v.dtype)
            seen.add(k)
        yield k, v
    missing = sorted(set(deltas) - seen)
    if missing:
        raise LoRAError(f"{where}: the adapter adapts {missing[:3]} ({len(missing)}), which the base does not have")


def merge_state(tensors, state: dict[str, torch.Tensor], scale: float,
                where: str = "adapters") -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with the adapters of ``state`` (a :func:`lora_state`) merged (:func:`add_deltas`): the export of
    an adapted model, or of a distributed LoRA run's checkpoint, tensor by tensor."""
    deltas = {}
    for prefix, p, a, b in _factor_pairs(state):
        key = f"{prefix}.weight" if p is None else f"{prefix}.{_EXPERT_WEIGHT[p]}"
        deltas[key] = (lambda _s, a=a, b=b, p=p: scale * (b.float() @ a.float() if p is None
                                                          else torch.bmm(a.float(), b.float())))
    yield from add_deltas(tensors, deltas, where)


def adapter_config(cfg: LoRAConfig, base_model: str | None) -> dict:
    """``adapter_config.json``: transformers' module names in ``target_modules``, the stacked experts in
    ``target_parameters`` (without it PEFT drops the expert tensors silently), gate and up fused at rank 2r."""
    modules = sorted(DENSE[t][1] for t in cfg.targets if t in DENSE)
    params, rank_pattern, alpha_pattern = [], {}, {}
    if "ffn.experts.w1" in cfg.targets:
        params.append("mlp.experts.gate_up_proj")
        rank_pattern["gate_up_proj"] = 2 * cfg.rank
        alpha_pattern["gate_up_proj"] = (math.sqrt(2) if cfg.rslora else 2) * cfg.alpha
    if "ffn.experts.w2" in cfg.targets:
        params.append("mlp.experts.down_proj")
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "use_rslora": cfg.rslora,
            "target_modules": modules, "target_parameters": params, "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern, "bias": "none", "fan_in_fan_out": False, "inference_mode": True}


def save_adapter(model, cfg: LoRAConfig, out_dir: str | Path, base_model: str | None) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir`` (from a model or a
    :func:`lora_state` dict)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base_model), indent=2) + "\n")
    (out / TREX_LORA).write_text(cfg.model_dump_json(indent=2) + "\n")  # (PEFT warns on keys it does not know)
    return out


def config_of_adapter(adapter_dir: str | Path) -> LoRAConfig:
    """The ``LoRAConfig`` an adapter directory was written with: its ``trex_lora.json``, else (a PEFT adapter in
    these names written elsewhere) rank, alpha, rslora and the targets read back from ``adapter_config.json``."""
    d = Path(adapter_dir)
    if (d / TREX_LORA).is_file():
        try:
            return LoRAConfig.model_validate_json((d / TREX_LORA).read_text())
        except ValueError as e:
            raise LoRAError(f"{d / TREX_LORA}: {e}") from e
    path = d / ADAPTER_CONFIG
    try:
        c = json.loads(path.read_text())
        by_hf = {hf: t for t, (_, hf) in DENSE.items()}
        targets = [by_hf[m] for m in c["target_modules"]]
        params = c.get("target_parameters") or []
        targets += ["ffn.experts.w1", "ffn.experts.w3"] * ("mlp.experts.gate_up_proj" in params)
        targets += ["ffn.experts.w2"] * ("mlp.experts.down_proj" in params)
        return LoRAConfig(rank=c["r"], alpha=c["lora_alpha"], rslora=c.get("use_rslora", False), targets=targets)
    except (OSError, KeyError, ValueError) as e:
        raise LoRAError(f"{path}: not a LoRA adapter config T-Rex can apply ({e})") from e


def load_adapter(model: Transformer, adapter_dir: str | Path) -> Transformer:
    """Attach the adapter of ``adapter_dir`` to ``model`` (the base it was trained on): every tensor of the file
    must land, and every adapter of the model must get its tensors."""
    from safetensors.torch import load_file

    cfg = config_of_adapter(adapter_dir)
    apply_lora(model, cfg)
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    tensors = load_file(str(path))
    want = adapter_tensors(model)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise LoRAError(f"{path}: adapter keys do not match the model: missing {missing[:3]}, unexpected {extra[:3]}"
                        f" ({len(missing)} / {len(extra)})")
    for k, v in tensors.items():
        if v.shape != want[k].shape:
            raise LoRAError(f"{path}: {k} has shape {tuple(v.shape)}, the model's adapter {tuple(want[k].shape)}")
    with torch.no_grad():
        for prefix, _, lora in lora_modules(model):
            hub = PEFT_PREFIX + _hub(prefix)
            if isinstance(lora, DenseLoRA):
                lora.a.copy_(tensors[f"{hub}.lora_A.weight"])
                lora.b.copy_(tensors[f"{hub}.lora_B.weight"])
                continue
            for p in lora.projections:
                a, b = getattr(lora, f"a_{p}"), getattr(lora, f"b_{p}")
                for e in range(a.shape[0]):
                    a[e].copy_(tensors[f"{hub}.experts.{e}.{_HUB_EXPERT[p]}.lora_A.weight"].T)
                    b[e].copy_(tensors[f"{hub}.experts.{e}.{_HUB_EXPERT[p]}.lora_B.weight"].T)
    return model


_NATIVE_NAME = {v: k for k, v in _HUB_NAME.items()}
_NATIVE_EXPERT = {v: _EXPERT_WEIGHT[k] for k, v in _HUB_EXPERT.items()}  # w1 -> w_gate, ...


def _native_target(peft_key: str) -> tuple[str, int | None]:
    """``(native weight key, expert or None)`` of a PEFT adapter key (``...lora_A.weight`` / ``lora_B.weight``)."""
    if not peft_key.startswith(PEFT_PREFIX + "layers."):
        raise LoRAError(f"adapter key {peft_key!r} is not under {PEFT_PREFIX}layers.")
    module = peft_key[len(PEFT_PREFIX):].rsplit(".lora_", 1)[0]  # layers.L.attn.wq_a / layers.L.ffn.experts.e.w1
    layer, _, rest = module.partition(".")[2].partition(".")
    parts = rest.split(".")
    if parts[:2] == ["ffn", "experts"] and len(parts) == 4 and parts[3] in _NATIVE_EXPERT:
        return f"layers.{layer}.ffn.{_NATIVE_EXPERT[parts[3]]}", int(parts[2])
    return f"layers.{layer}.{_NATIVE_NAME.get(rest, rest)}.weight", None


class AdapterFile:
    """A PEFT-layout adapter directory read lazily: :meth:`delta` of a native weight key (float32, the native
    orientation: ``[out, in]`` for a Linear, ``[E, D_in, D_out]`` for stacked experts), :meth:`merge` a stream."""

    def __init__(self, adapter_dir: str | Path):
        from safetensors import safe_open

        self.dir, self.cfg = Path(adapter_dir), config_of_adapter(adapter_dir)
        path = self.dir / ADAPTER_WEIGHTS
        if not path.is_file():
            raise LoRAError(f"{path}: no adapter weights")
        self._file = safe_open(str(path), "pt")
        self.targets: dict[str, dict[int | None, str]] = {}  # native key -> expert -> the PEFT module prefix
        for k in self._file.keys():
            if not k.endswith((".lora_A.weight", ".lora_B.weight")):
                raise LoRAError(f"{path}: {k!r} is not a LoRA factor")
            native, expert = _native_target(k)
            self.targets.setdefault(native, {})[expert] = k.rsplit(".lora_", 1)[0]

    def _pair(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return (self._file.get_tensor(f"{prefix}.lora_A.weight").float(),
                    self._file.get_tensor(f"{prefix}.lora_B.weight").float())
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
            raise LoRAError(f"{self.dir / ADAPTER_WEIGHTS}: {prefix} needs both lora_A and lora_B ({e})") from e

    def delta(self, key: str, shape: torch.Size) -> torch.Tensor:
        s, entries = self.cfg.scale, self.targets[key]
        if None in entries:
            a, b = self._pair(entries[None])
            d = s * (b @ a)
        else:
            if sorted(entries) != list(range(shape[0])):
                raise LoRAError(f"{self.dir / ADAPTER_WEIGHTS}: {key} has adapters for experts {sorted(entries)[:8]}, "
                                f"the base {shape[0]} experts")
            d = torch.stack([s * (b @ a).T for a, b in (self._pair(entries[e]) for e in range(shape[0]))])
        if d.shape != shape:
            raise LoRAError(f"{self.dir / ADAPTER_WEIGHTS}: the adapter of {key} makes {tuple(d.shape)}, the base "
                            f"weight is {tuple(shape)}")
        return d

    def merge(self, tensors) -> Iterator[tuple[str, torch.Tensor]]:
        """``tensors`` (native key, tensor) with the adapter added (:func:`add_deltas`)."""
        yield from add_deltas(tensors, {k: (lambda shape, k=k: self.delta(k, shape)) for k in self.targets},
                              str(self.dir))
