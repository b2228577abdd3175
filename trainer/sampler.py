"""The RL stage's rollout samplers: what decodes a rollout's rows (``trainer.rollout.RolloutSource``).

A sampler fills each :class:`trainer.generate.Row` it is given -- ``tokens``, ``logprobs`` (of every sampled
token and of the end token, under the tempered distribution it sampled from), ``finish_reason``, ``end_token``
and, where it can, ``routes`` -- and keeps its copy of the policy's weights current (:meth:`sync`, called before
every rollout with the training step the weights are at). Policy (the training core's model), rollout (a sampler)
and reward (the task's callable) are three replaceable parts.

- :class:`NativeSampler` (``train.rl.rollout_backend: native``, the default): the continuous-batching decoder of
  ``trex serve`` (:func:`trainer.generate.decode_rows`) running the policy module itself, so there is nothing to
  sync; it records the expert choices for router replay.
- :class:`VLLMSampler` (``vllm``): an offline ``vllm.LLM`` engine (CUDA, or Ascend NPUs through vllm-ascend),
  imported only when built. It starts from the policy written in the published layout (bf16, the form vLLM's
  DeepSeek-V4 loader reads) and, before a rollout whose weights are newer than its own, receives them in that
  layout in chunks of ``sync_chunk_mb`` through each worker's ``model.load_weights`` (``LLM.collective_rpc``;
  nothing goes through disk). Its log-probabilities are the processed ones (after temperature) where the
  installed vLLM offers ``logprobs_mode``; the ratios' denominator is the training forward's own either way
  (``old_logp``), and the difference is logged as ``logp_mismatch_*``. It records no routes: router replay
  needs the native sampler.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

import torch

from trainer.generate import Row, decode_rows

ACCELERATOR_HINT = "pip install 'trex-or[gpu]' (CUDA) or 'trex-or[npu]' (Ascend NPU, vllm-ascend)"


class Sampler(Protocol):
    name: str

    def sync(self, model, step: int) -> int:
        """Make the sampler decode with ``model``'s weights as of training step ``step``; the bytes sent."""

    def sample(self, rows: list[Row]) -> None:
        """Decode every row to its end (tokens, log-probabilities, finish reason, end token)."""


class NativeSampler:
    """The policy module itself decodes (module docstring): ``max_batch`` rows at once."""

    name = "native"

    def __init__(self, model, end_ids: set[int], pad_id: int, max_batch: int):
        self.model, self.end_ids, self.pad_id, self.max_batch = model, set(end_ids), pad_id, max_batch

    def sync(self, model, step: int) -> int:
        if model is not self.model:
            raise ValueError("the native sampler decodes with the policy module it was built with")
        return 0

    def sample(self, rows: list[Row]) -> None:
        decode_rows(self.model, rows, self.end_ids, self.pad_id, self.max_batch)
        self.model.train()


def chunks(tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``tensors`` in lists of at most ``max_bytes`` (a larger tensor alone in its own)."""
    out, size = [], 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if out and size + n > max_bytes:
            yield out
            out, size = [], 0
        out.append((name, t))
        size += n
    if out:
        yield out


def _load_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs in each vLLM worker (``collective_rpc``): the tensors into its model, by their published names (vLLM's
    weight loaders copy each into its parameter, on its device, with its tensor-parallel slice)."""
    worker.model_runner.model.load_weights(weights=weights)
    return len(weights)


class VLLMSampler:
    """Rollouts from an offline ``vllm.LLM`` engine with weight sync (module docstring).

    ``policy_dir``: the policy in the published bf16 layout (what the engine loads first); ``stream``: the
    model's tensors in that layout (``trainer.hub.writer.hub_stream(..., "hub-bf16")``), read at every sync."""

    name = "vllm"

    def __init__(self, policy_dir: str | Path, end_ids: set[int], stream: Callable[[object], Iterable],
                 max_model_len: int, gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1,
                 dtype: str = "bfloat16", sync_chunk_mb: float = 1024, engine_opts: dict | None = None):
        try:
            import vllm
        except ImportError as e:
            raise ImportError(f"train.rl.rollout_backend=vllm needs vLLM, which is not installed ({e}); "
                              f"{ACCELERATOR_HINT}") from e
        self.vllm, self.end_ids, self.stream = vllm, set(end_ids), stream
        self.sync_bytes = int(sync_chunk_mb * 2**20)
        opts = {"model": str(policy_dir), "skip_tokenizer_init": True, "max_model_len": max_model_len,
                "gpu_memory_utilization": gpu_memory_utilization, "tensor_parallel_size": tensor_parallel_size,
                "dtype": dtype, "enable_prefix_caching": True, **(engine_opts or {})}
        if "logprobs_mode" in _engine_fields(vllm) and "logprobs_mode" not in opts:
            opts["logprobs_mode"] = "processed_logprobs"  # after temperature, as the ratios use them
        self.llm = vllm.LLM(**opts)
        self.step = 0  # the weights the engine holds: the policy's at step 0 (what it loaded)

    def sync(self, model, step: int) -> int:
        if self.step == step:
            return 0
        total = 0
        # contiguous: a view (an expert of the stacked tensor, transposed) would pickle its whole storage
        for part in chunks(((n, t.contiguous()) for n, t in self.stream(model)), self.sync_bytes):
            self.llm.collective_rpc(_load_weights, args=(part,))
            total += sum(t.numel() * t.element_size() for _, t in part)
        if hasattr(self.llm, "reset_prefix_cache"):  # cached prompt blocks hold the old weights' keys
            self.llm.reset_prefix_cache()
        self.step = step
        return total

    def sample(self, rows: list[Row]) -> None:
        sps = [self.vllm.SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens,
                                        seed=r.seed, logprobs=0, stop_token_ids=sorted(self.end_ids),
                                        detokenize=False)
               for r in rows]
        prompts = [{"prompt_token_ids": list(r.prompt)} for r in rows]
        outs = self.llm.generate(prompts, sampling_params=sps, use_tqdm=False)
        for r, out in zip(rows, outs):
            fill_row(r, out.outputs[0], self.end_ids)


def fill_row(row: Row, completion, end_ids: set[int]) -> None:
    """A vLLM completion (``token_ids``, ``logprobs``: per token a dict id -> Logprob, ``finish_reason``) into
    ``row``: an end token that stopped it leaves ``tokens`` for ``end_token``, as the native decoder does."""
    ids = list(completion.token_ids)
    lps = completion.logprobs or []
    if len(lps) < len(ids):
        raise ValueError(f"vLLM returned {len(lps)} log-probabilities for {len(ids)} tokens (logprobs=0 asked)")
    row.end_token = None
    if ids and ids[-1] in end_ids:
        row.end_token = ids.pop()
    row.tokens = ids
    if row.logprobs is not None:
        row.logprobs[:] = [float(_logprob(lps[i][tok])) for i, tok in enumerate(ids + ([row.end_token]
                                                                                    if row.end_token is not None else []))]
    row.finish_reason = "stop" if row.end_token is not None or completion.finish_reason == "stop" else "length"


def _logprob(entry) -> float:
    return entry.logprob if hasattr(entry, "logprob") else entry


def _engine_fields(vllm) -> set[str]:
    """The engine arguments the installed vLLM knows (``LLM(**kwargs)`` hands them to ``EngineArgs``)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
        return {f.name for f in dataclasses.fields(EngineArgs)}
    except (ImportError, TypeError):
        return set(inspect.signature(vllm.LLM.__init__).parameters)
