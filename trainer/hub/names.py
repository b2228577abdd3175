"""Where each native tensor lives in the published (hub) layout and in transformers' layout.

A :class:`Source` says which file tensors make one native tensor and how:

- ``rename``: one file tensor, same shape;
- ``wo_a``: the grouped output projection, native ``[G, in, r]`` <- file ``[G*r, in]``;
- ``experts``: native ``[E, D, I]`` (``w_gate``/``w_up``) or ``[E, I, D]`` (``w_down``) <- one file
  tensor per expert, ``[I, D]`` / ``[D, I]`` (hub: ``ffn.experts.M.w{1,3,2}.weight``);
- ``fused_gate`` / ``fused_up`` / ``fused_down``: the same from transformers' ``gate_up_proj [E, 2I, D]``
  (first / second half) and ``down_proj [E, D, I]``;
- ``eh_proj``: the MTP input projection, native ``[D, 2D]`` <- hub ``e_proj [D, D]`` and ``h_proj [D, D]``
  side by side;
- ``zero``: no file tensor (a hash-routed layer's expert bias, always zero natively).

The hub kind of each file tensor (:func:`hub_kind`) says how it is stored: ``fp8`` (e4m3 + ``.scale``),
``expert`` (MXFP4 or FP8, by the checkpoint's ``expert_dtype``), ``bf16``, ``f32`` or ``i64``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.state_dict_adapter import _LAYER, _TOP

_HUB_LAYER = {  # native suffix inside a block -> hub suffix (renames only)
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "attn.sinks": "attn.attn_sink", "ffn.expert_bias": "ffn.gate.bias", "ffn.tid2eid": "ffn.gate.tid2eid",
    "ffn.shared.w1.weight": "ffn.shared_experts.w1.weight", "ffn.shared.w2.weight": "ffn.shared_experts.w2.weight",
    "ffn.shared.w3.weight": "ffn.shared_experts.w3.weight",
}
_SAME = ("attn_norm.weight", "ffn_norm.weight", "attn.wq_a.weight", "attn.q_norm.weight", "attn.wq_b.weight",
         "attn.wkv.weight", "attn.kv_norm.weight", "attn.wo_b.weight", "attn.compressor.wkv.weight",
         "attn.compressor.wgate.weight", "attn.compressor.ape", "attn.compressor.norm.weight",
         "attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight", "ffn.gate.weight")
_HUB_TOP = {"embed.weight": "embed.weight", "lm_head.weight": "head.weight", "norm.weight": "norm.weight",
            "hc_head.fn": "hc_head_fn", "hc_head.base": "hc_head_base", "hc_head.scale": "hc_head_scale"}
_EXPERT_W = {"ffn.w_gate": "w1", "ffn.w_up": "w3", "ffn.w_down": "w2"}
_FP8 = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|"
                  r"e_proj|h_proj)\.weight$")
_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_F32 = re.compile(r"(^|\.)(hc_\w+|attn\.attn_sink|ape|ffn\.gate\.bias)$")
_BLOCK = re.compile(r"^(layers\.\d+\.|mtp\.\d+\.block\.)(.+)$")


@dataclass(frozen=True)
class Source:
    kind: str
    names: tuple[str, ...]


def hub_kind(name: str) -> str:
    """How the hub stores file tensor ``name``: fp8, expert, f32, i64 or bf16."""
    if _EXPERT.search(name):
        return "expert"
    if _FP8.search(name):
        return "fp8"
    if name.endswith("tid2eid"):
        return "i64"
    if _F32.search(name):
        return "f32"
    return "bf16"


def _is_hash(native: str, cfg: ModelArgs) -> bool:
    m = re.match(r"^layers\.(\d+)\.", native)
    return bool(m) and cfg.moe_types[int(m.group(1))] == "hash_moe"


def hub_source(native: str, cfg: ModelArgs) -> Source:
    """The hub tensors that make native tensor ``native``."""
    if native in _HUB_TOP:
        return Source("rename", (_HUB_TOP[native],))
    if native.startswith("mtp."):
        head, _, rest = native.partition(".")[2].partition(".")
        prefix = f"mtp.{head}."
        if rest == "eh_proj.weight":
            return Source("eh_proj", (prefix + "e_proj.weight", prefix + "h_proj.weight"))
        if rest in ("enorm.weight", "hnorm.weight", "norm.weight"):
            return Source("rename", (prefix + rest,))
        if rest.startswith("hc_head."):
            return Source("rename", (prefix + "hc_head_" + rest.split(".", 1)[1],))
    m = _BLOCK.match(native)
    if not m:
        raise KeyError(f"native tensor {native!r} has no place in the published layout")
    block, rest = m.groups()
    prefix = block.replace(".block.", ".") if block.startswith("mtp.") else block
    if rest == "ffn.expert_bias" and _is_hash(native, cfg):
        return Source("zero", ())
    if rest in _EXPERT_W:
        w = _EXPERT_W[rest]
        return Source("experts", tuple(f"{prefix}ffn.experts.{e}.{w}.weight" for e in range(cfg.n_routed_experts)))
    if rest == "attn.wo_a":
        return Source("wo_a", (prefix + "attn.wo_a.weight",))
    if rest in _HUB_LAYER:
        return Source("rename", (prefix + _HUB_LAYER[rest],))
    if rest in _SAME or rest.startswith("attn.indexer.comp."):
        return Source("rename", (prefix + rest.replace("attn.indexer.comp.", "attn.indexer.compressor."),))
    raise KeyError(f"native tensor {native!r} has no place in the published layout")


def hf_source(native: str, cfg: ModelArgs) -> Source:
    """The transformers (``DeepseekV4ForCausalLM``) tensors that make native tensor ``native``; MTP
    tensors keep their native names there (transformers ignores them)."""
    if native.startswith("mtp."):
        return Source("rename", (native,))
    if native in _TOP:
        return Source("rename", (_TOP[native],))
    m = re.match(r"^layers\.(\d+)\.(.+)$", native)
    if not m:
        raise KeyError(f"native tensor {native!r} has no transformers name")
    i, rest = m.groups()
    p = f"model.layers.{i}."
    if rest == "ffn.expert_bias" and _is_hash(native, cfg):
        return Source("zero", ())
    if rest in ("ffn.w_gate", "ffn.w_up"):
        return Source("fused_gate" if rest == "ffn.w_gate" else "fused_up", (p + "mlp.experts.gate_up_proj",))
    if rest == "ffn.w_down":
        return Source("fused_down", (p + "mlp.experts.down_proj",))
    if rest == "attn.wo_a":
        return Source("wo_a", (p + "self_attn.o_a_proj.weight",))
    if rest in _LAYER:
        return Source("rename", (p + _LAYER[rest],))
    raise KeyError(f"native tensor {native!r} has no transformers name")
