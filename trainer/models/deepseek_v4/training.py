"""What training needs of the DeepSeek-V4 model besides its forward: the objective (:func:`loss_fn`: main
cross-entropy + the CSA indexers' KL + the MTP head's loss), the evaluation loss, block / MoE recomputation
and the reset of the expert load a skipped step counted. Single device; ``stage.py`` is the same objective
for one pipeline stage under tensor / sequence parallelism."""

from __future__ import annotations

import logging

import torch
from torch.utils.checkpoint import checkpoint

from kernels import fused_linear_cross_entropy, moe_chunk_math, resolve_all
from trainer.data import IGNORE, Packed, trim_padding
from trainer.models.deepseek_v4 import cpu_attention
from trainer.models.deepseek_v4.model import Transformer

log = logging.getLogger(__name__)


def mtp_labels(labels_bt: torch.Tensor, doc_bt: torch.Tensor) -> torch.Tensor:
    """Targets of the MTP head at positions 0..T-2: the label one step further, inside the same document."""
    nxt = labels_bt[:, 1:].clone()
    nxt[doc_bt[:, 1:] != doc_bt[:, :-1]] = IGNORE
    return nxt


def loss_fn(model: Transformer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int, torch.Tensor | None, int]:
    """Summed main cross-entropy and its token count, and the same for the MTP head (if any).

    The CSA indexers' KL losses (summed over tokens, scaled by ``indexer_loss_weight``) are added to the
    main sum: they train only the indexers, whose inputs are detached.
    """
    h, mtp_h = model.hidden_train(batch["input_ids"], batch["doc_ids"])
    labels = batch["labels"]
    w = model.lm_head.weight
    n = int((labels != IGNORE).sum())
    # the LM head and the loss together, chunk by chunk: the [tokens, vocab] logits never exist at once
    loss = fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1), ignore_index=IGNORE,
                                      reduction="sum")
    aux = model.indexer_loss() if model.training else None
    if aux is not None:
        loss = loss + model.cfg.indexer_loss_weight * aux
    if not mtp_h:
        return loss, n, None, 0
    target = mtp_labels(labels, batch["doc_ids"])
    mtp = sum(fused_linear_cross_entropy(m.reshape(-1, m.shape[-1]), w, target.reshape(-1), ignore_index=IGNORE,
                                         reduction="sum") for m in mtp_h)
    return loss, n, mtp, int((target != IGNORE).sum())


class CrossEntropy:
    """The CPT / SFT objective for an engine: :func:`loss_fn` on a micro-batch, normalised by the label tokens
    (and MTP targets) of the whole step batch. An objective is ``normaliser(batches) -> (count, mtp_count)`` and
    ``__call__(model, batch) -> (loss_sum, count, mtp_sum | None, mtp_count, stats)``
    (``trainer.rl.GRPOObjective`` is the RL stage's)."""

    def normaliser(self, batches: list[dict[str, torch.Tensor]]) -> tuple[int, int]:
        n = sum(int((b["labels"] != IGNORE).sum()) for b in batches)
        n_mtp = sum(int((mtp_labels(b["labels"], b["doc_ids"]) != IGNORE).sum()) for b in batches)
        return n, n_mtp

    def __call__(self, model: Transformer, batch: dict[str, torch.Tensor]):
        return (*loss_fn(model, batch), {})


@torch.no_grad()
def evaluate_loss(model: Transformer, data: Packed, batch_size: int = 8) -> float | None:
    """Mean token loss over all rows of ``data`` (no gradient); None when ``data`` has no label token to score
    (no rows, or every row's labels masked or truncated away): there is no loss then, and a 0.0 would read as a
    perfect model."""
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(data), batch_size):
        batch = trim_padding(data.batch(torch.arange(s, min(s + batch_size, len(data)))))
        loss_sum, k, _, _ = loss_fn(model, {key: v.to(device) for key, v in batch.items()})
        total += float(loss_sum)
        n += int(k)
    model.train(was_training)
    return total / n if n else None


def discard_expert_load(model: torch.nn.Module) -> None:
    """Forget the expert load counted by a skipped step's forward (the bias update never sees it)."""
    for m in model.modules():
        load = getattr(m, "load_e", None)
        if isinstance(load, torch.Tensor):
            load.zero_()


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Recompute the MoE (``moe``) or whole blocks (``block``) in the backward pass instead of storing them."""
    if mode == "none":
        return

    def wrap(module: torch.nn.Module) -> None:
        if getattr(module, "_trex_ac", False):
            return
        inner = module.forward
        module.forward = lambda *a, **k: checkpoint(inner, *a, use_reentrant=False, **k)
        module._trex_ac = True

    layers = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers  # a stage
    for layer in list(layers) + [m.block for m in model.mtp]:
        wrap(layer.ffn if mode == "moe" else layer)


def inductor_or_eager(gm: torch.fx.GraphModule, example_inputs):
    """The inductor backend; a graph it cannot compile (no C++ compiler, an unsupported op) runs eagerly instead,
    with one warning: compilation is an optimisation, never a reason for a run to fail."""
    from torch._dynamo.exc import RestartAnalysis
    from torch._inductor.compile_fx import compile_fx

    try:
        return compile_fx(gm, example_inputs)
    except RestartAnalysis:  # dynamo's own control flow (e.g. re-tracing with float inputs as tensors), no failure
        raise
    except Exception as e:  # noqa: BLE001 - any compiler failure: fall back to the graph as traced
        log.warning("torch.compile failed for a graph (%s: %s); it runs eagerly", type(e).__name__, e)
        return gm.forward


def apply_compile(model: Transformer) -> None:
    """``torch.compile`` every decoder block (trunk and MTP), the final stream collapse, the norms outside the
    blocks (the final one, MTP's last) and MTP's input (its two norms and projection), one region each, static
    shapes (the trunk and the MTP block see two lengths; automatic dynamic shapes would recompile symbolically)
    (the loss, the embedding and the data-dependent packing layouts stay eager). Blocks of the same kind share
    their compiled code. The data-dependent pieces inside a block -- the CPU attention core's column selection
    and the CPU expert loop -- are excluded from the graph (``torch.compiler.disable``) and run eagerly
    between the compiled pieces; the kernel registry's choices are made first, so tracing does not touch them.
    A graph the compiler fails on runs eagerly (:func:`inductor_or_eager`). On the CPU the expert loop's
    per-chunk element-wise work is compiled too (``kernels.moe_chunk_math.fuse``: ~3.8x faster backward there), and
    the attention core's sink-gradient row products (``cpu_attention.fuse``)."""
    device = next(model.parameters()).device.type
    resolve_all(device)  # (also the eager wrappers of the CPU attention core and expert loop)
    if device == "cpu":
        moe_chunk_math.fuse(inductor_or_eager)
        cpu_attention.fuse(inductor_or_eager)
    layers = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers  # a stage
    for block in list(layers) + [m.block for m in model.mtp]:
        block.compile(backend=inductor_or_eager, dynamic=False)
    if model.hc_head is not None:  # (a pipeline stage without the last layer has none)
        model.hc_head.compile(backend=inductor_or_eager, dynamic=False)
    # the norms between the compiled regions (eagerly the RMSNorm formula makes ~6 passes and 3 casts over [B, T, D]
    # forward and as many backward; compiled, one pass forward and two backward)
    norms = [model.norm] + [m.norm for m in model.mtp]
    for norm in norms:
        if norm is not None:
            norm.compile(backend=inductor_or_eager, dynamic=False)
    # MTP's input: two norms and the projection of their concatenation in one region (eagerly, under bf16 autocast,
    # the fp32 embedding norm beside the bf16 trunk norm made the concatenation a mixed-dtype copy: 23 ms of a
    # bench_20m step)
    for m in model.mtp:
        if getattr(m.mix, "_torchdynamo_orig_callable", None) is None:  # (not twice)
            m.mix = torch.compile(m.mix, backend=inductor_or_eager, dynamic=False)
