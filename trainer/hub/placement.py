"""The independent check of a checkpoint's quantised-tensor placement: transformers' FP8 loading path, the one
a GPU takes (no dequantisation), run on the CPU. Its lenient CPU path dequantises whatever it finds (a BF16
tensor where the published layout has FP8 + ``.scale`` loads without complaint), so the tests judge the
fixture and every ``hub-fp8`` export by this one."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer.hub.fixture import DTYPE_NAMES


def fp8_placement_problems(path: str | Path) -> list[str]:
    """Where transformers' FP8 loading path (a GPU's: no dequantisation) disagrees with ``path``'s tensors.

    Loads ``path`` with ``AutoModelForCausalLM`` on the CPU with the FineGrainedFP8 quantizer's environment
    check bypassed (it forces ``dequantize=True`` without a GPU, and wants accelerate), so the model gets the
    GPU path's ``FP8Linear`` / ``FP8Experts`` modules and the checkpoint's tensors as stored; lists: missing,
    unexpected and mismatched keys (a ``.scale`` too many or missing, a BF16 tensor where FP8 + scale belongs,
    a scale of the wrong grid) and every FP8 module whose weight or ``weight_scale_inv`` does not hold the
    checkpoint's dtype and values (transformers casts a checkpoint tensor to the parameter's dtype silently,
    e.g. a BF16 weight to FP8, an F32 scale to E8M0). Empty: the GPU path would load the directory as stored.
    """
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    path = Path(path)
    original = FineGrainedFP8HfQuantizer.validate_environment

    def keep_quantized(self, *args, **kwargs):  # no GPU check: keep the FP8 modules (dequantize=False)
        self.quantization_config.dequantize = False

    FineGrainedFP8HfQuantizer.validate_environment = keep_quantized
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                           ignore_mismatched_sizes=True)
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = original
    problems = [f"missing: {k}" for k in sorted(info["missing_keys"])]
    problems += [f"unexpected: {k}" for k in sorted(info["unexpected_keys"])]
    problems += [f"mismatched: {k[0]}: checkpoint {list(k[1])}, model {list(k[2])}" if isinstance(k, tuple)
                 else f"mismatched: {k}" for k in sorted(info["mismatched_keys"], key=str)]
    problems += [f"error: {k}" for k in info.get("error_msgs", [])]
    reported = set(info["missing_keys"]) | {k[0] if isinstance(k, tuple) else k for k in info["mismatched_keys"]}

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    handles: dict[str, object] = {}

    def stored(name: str) -> torch.Tensor | None:
        if name not in index:
            return None
        f = index[name]
        if f not in handles:
            handles[f] = safe_open(str(path / f), "pt")
        return handles[f].get_tensor(name)

    hub_of = {"q_a_proj": "wq_a", "q_b_proj": "wq_b", "kv_proj": "wkv", "o_a_proj": "wo_a", "o_b_proj": "wo_b",
              "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, FP8Linear):
            # model.layers.N.self_attn.q_a_proj / ...compressor.indexer.q_b_proj / ...mlp.shared_experts.gate_proj
            parts = mod_name.removeprefix("model.").split(".")
            leaf = hub_of.get(parts[-1], parts[-1])
            if parts[-3:-1] == ["compressor", "indexer"]:
                hub = ".".join(parts[:2] + ["attn", "indexer", leaf])
            elif parts[2] == "self_attn":
                hub = ".".join(parts[:2] + ["attn", leaf])
            else:
                hub = ".".join(parts[:2] + ["ffn", "shared_experts", leaf])
            pairs = [("weight", mod.weight, stored(f"{hub}.weight"), f"{hub}.weight"),
                     ("weight_scale_inv", mod.weight_scale_inv, stored(f"{hub}.scale"), f"{hub}.scale")]
        elif isinstance(mod, FP8Experts):
            hub = ".".join(mod_name.removeprefix("model.").split(".")[:2] + ["ffn", "experts"])
            pairs = []
            for j in range(mod.num_experts):
                for w, (a, b) in (("weight", ("gate_up_proj", "down_proj")),
                                  ("scale", ("gate_up_proj_scale_inv", "down_proj_scale_inv"))):
                    w1, w3, w2 = (stored(f"{hub}.{j}.{x}.{w}") for x in ("w1", "w3", "w2"))
                    gu = None if w1 is None or w3 is None else torch.cat([w1, w3], 0)
                    pairs += [(a, getattr(mod, a)[j], gu, f"{hub}.{j}.w1/w3.{w}"),
                              (b, getattr(mod, b)[j], w2, f"{hub}.{j}.w2.{w}")]
        else:
            continue
        for attr, param, ref, what in pairs:
            scale = what.endswith("scale")
            if f"{mod_name}.{attr}" in reported:
                continue  # missing or mismatched: listed above, the parameter holds no checkpoint data
            if ref is None:
                problems.append(f"not in the checkpoint: {what} (the GPU path wants it for {mod_name})")
            elif tuple(param.shape) != tuple(ref.shape):
                problems.append(f"shape: {what} is {list(ref.shape)}, {mod_name} holds {list(param.shape)}")
            elif not scale and param.dtype != ref.dtype:
                problems.append(f"dtype: {what} is {DTYPE_NAMES.get(ref.dtype, ref.dtype)} in the checkpoint, "
                                f"{mod_name} holds {DTYPE_NAMES.get(param.dtype, param.dtype)}")
            elif scale and param.dtype == ref.dtype and not torch.equal(param.detach().float(), ref.float()):
                problems.append(f"values: {what} differs in {mod_name}")
            elif scale and not torch.equal(param.detach().float(), ref.float()):
                # the parameter's scale dtype (E8M0 under scale_fmt ue8m0) rounds what the checkpoint stores
                problems.append(f"values: {what} ({DTYPE_NAMES.get(ref.dtype, ref.dtype)}) changes when "
                                f"{mod_name} casts it to {DTYPE_NAMES.get(param.dtype, param.dtype)}")
            elif not scale and not torch.equal(param.detach().view(torch.uint8), ref.view(torch.uint8)):
                problems.append(f"values: {what} differs in {mod_name}")
    return problems
