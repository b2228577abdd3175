"""The RL stage's rollout samplers (trainer/sampler.py): the native one, and the vLLM one against a stand-in for the
part of vLLM's offline API it uses (``LLM(**engine args)``, ``generate`` with token-id prompts and
``SamplingParams(logprobs=0)``, ``collective_rpc`` running a function on each worker, ``load_weights`` of
(published name, tensor) pairs). vLLM itself needs an accelerator; the stand-in decodes with this project's own
decoder from the weights it was given, so what is tested is ours: the layout and names sent, when a sync happens,
and how vLLM's completions become rollout rows."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.trainer.helpers import tiny_model
from trainer.export import export, load_export
from trainer.generate import Row, decode_rows
from trainer.hub.reader import BF16
from trainer.rl import GRPOObjective, policy_parameters
from trainer.rollout import RLPrompt, RolloutSource
from trainer.sampler import NativeSampler, VLLMSampler, fill_row
from trex.core.config import RLConfig


class _FakeLLM:
    """Loads the published layout it is pointed at; ``load_weights`` replaces tensors by name (each must exist
    with the same shape and dtype, as vLLM's loaders require); ``generate`` decodes with the weights it holds."""

    def __init__(self, model, **opts):
        self.dir, self.opts, self.syncs, self.resets, self.dirty = Path(model), opts, 0, 0, False
        self.files = {f.name: load_file(f) for f in sorted(self.dir.glob("*.safetensors"))}
        self.native = load_export(self.dir)
        llm = self

        class Model(torch.nn.Module):
            def load_weights(self, weights):
                for name, t in weights:
                    where = [f for f, ts in llm.files.items() if name in ts]
                    assert where, f"vLLM has no tensor {name}"
                    old = llm.files[where[0]][name]
                    assert (old.shape, old.dtype) == (t.shape, t.dtype), name
                    llm.files[where[0]][name] = t.clone()
                llm.dirty = True

        self.worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=Model()))

    def collective_rpc(self, fn, args=()):
        self.syncs += 1
        return [fn(self.worker, *args)]

    def reset_prefix_cache(self):
        self.resets += 1

    def _reload(self, tmp: Path):
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self.dir, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
        for name, ts in self.files.items():
            save_file(ts, tmp / name, metadata={"format": "pt"})
        self.native, self.dirty = load_export(tmp), False

    def generate(self, prompts, sampling_params, use_tqdm=True):
        if self.dirty:
            self._reload(self.dir.parent / "vllm-reload")
        rows = [Row(p["prompt_token_ids"], sp.max_tokens, sp.temperature, sp.top_p, sp.seed, logprobs=[])
                for p, sp in zip(prompts, sampling_params)]
        decode_rows(self.native, rows, set(sampling_params[0].stop_token_ids), 0)
        outs = []
        for r in rows:
            ids = r.tokens + ([r.end_token] if r.end_token is not None else [])
            lps = [{t: types.SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(ids, r.logprobs)]
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, logprobs=lps,
                                                                             finish_reason=r.finish_reason)]))
        return outs


@dataclasses.dataclass
class _EngineArgs:
    model: str = ""
    logprobs_mode: str = "raw_logprobs"


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM = _FakeLLM
    mod.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = _EngineArgs
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.engine", types.ModuleType("vllm.engine"))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
    return mod


def _parity_reward(rows, texts):
    even = [sum(int(x) for x in t.split(",") if x) % 2 == 0 for t in texts]
    return [{"reward": float(e), "correct": e} for e in even]


def _prompts():
    return [RLPrompt([1 + i, 5, 7 + i], {"id": i}) for i in range(4)]


def test_the_vllm_sampler_gets_the_policys_weights_before_every_rollout(tmp_path, fake_vllm):
    """Trained for two rollouts: the engine starts from the policy in the published bf16 layout, receives the
    updated weights (every tensor of that layout, by its published name) before the second rollout and not before
    the first, and then decodes exactly as the updated policy rounded to bf16 does."""
    from trainer.engines import single
    from trainer.entry import vllm_sampler

    model = tiny_model(seed=6)
    policy_parameters(model)
    cfg = RLConfig(steps=2, group_size=4, prompts_per_rollout=2, max_new_tokens=6, batch_size=8, lr=3e-3,
                   ckpt_every=10, rollout_backend="vllm", vllm={"sync_chunk_mb": 0.05})
    sampler = vllm_sampler(model, cfg, tmp_path / "policy", str(tmp_path / "no-tokenizer"), {0})
    llm = sampler.llm
    assert llm.opts["logprobs_mode"] == "processed_logprobs" and llm.opts["skip_tokenizer_init"]
    published = {n for ts in llm.files.values() for n in ts}
    sent: list[str] = []
    real_rpc = llm.collective_rpc
    llm.collective_rpc = lambda fn, args=(): (sent.extend(n for n, _ in args[0]), real_rpc(fn, args))[1]
    source = RolloutSource(model, _prompts(), _parity_reward, cfg, {0}, 96, lambda ids: ",".join(map(str, ids)), 0,
                           sampler=sampler)
    logs = []
    single.train(model, None, cfg, tmp_path / "ckpt", 0, on_log=lambda s, m: logs.append(m),
                 objective=GRPOObjective(cfg), source=source)
    assert [m["sync_mb"] > 0 for m in logs] == [False, True]  # step 0: the engine loaded the policy itself
    assert sorted(sent) == sorted(published) and llm.syncs > 1  # everything, in chunks of at most 50 kB
    assert llm.resets == 1 and sampler.step == 1  # it holds the weights after step 1, which the last rollout used
    assert sampler.sync(model, 1) == 0 and llm.resets == 1  # nothing newer: nothing sent
    assert sampler.sync(model, 2) > 0 and sampler.step == 2
    # the engine now decodes as the trained policy in bf16 does (the rows' tokens and log-probabilities)
    rows = [Row([3, 5, 9], 6, 1.0, 1.0, seed=s, logprobs=[]) for s in range(4)]
    sampler.sample(rows)
    export(model, str(tmp_path / "no-tokenizer"), tmp_path / "trained", to="hub-bf16", scheme=BF16)
    ref = load_export(tmp_path / "trained")  # the trained policy as a fresh engine would load it
    expect = [Row([3, 5, 9], 6, 1.0, 1.0, seed=s, logprobs=[]) for s in range(4)]
    decode_rows(ref, expect, {0}, 0)
    assert [r.tokens for r in rows] == [r.tokens for r in expect]
    assert sum((r.logprobs for r in rows), []) == pytest.approx(sum((r.logprobs for r in expect), []), abs=1e-5)


def test_a_vllm_completion_becomes_a_rollout_row():
    lp = lambda v: types.SimpleNamespace(logprob=v)  # noqa: E731
    stopped = types.SimpleNamespace(token_ids=[4, 8, 0], logprobs=[{4: lp(-0.1)}, {8: lp(-0.2)}, {0: lp(-0.3)}],
                                    finish_reason="stop")
    row = Row([1, 2], 5, logprobs=[])
    fill_row(row, stopped, {0})
    assert (row.tokens, row.end_token, row.logprobs, row.finish_reason) == ([4, 8], 0, [-0.1, -0.2, -0.3], "stop")
    cut = types.SimpleNamespace(token_ids=[4, 8], logprobs=[{4: lp(-0.1)}, {8: lp(-0.2)}], finish_reason="length")
    row = Row([1, 2], 2, logprobs=[])
    fill_row(row, cut, {0})
    assert (row.tokens, row.end_token, row.logprobs, row.finish_reason) == ([4, 8], None, [-0.1, -0.2], "length")
    with pytest.raises(ValueError, match="1 log-probabilities for 2 tokens"):
        fill_row(Row([1], 2, logprobs=[]), types.SimpleNamespace(token_ids=[4, 8], logprobs=[{4: lp(-0.1)}],
                                                                 finish_reason="length"), {0})


def test_without_vllm_the_backend_names_the_extra_and_router_replay_needs_native(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"rollout_backend=vllm needs vLLM.*trex-or\[gpu\]"):
        VLLMSampler(tmp_path, {0}, lambda m: [], 64)
    with pytest.raises(ValueError, match="router_replay needs rollout_backend=native"):
        RLConfig(rollout_backend="vllm", router_replay=True)
    model = tiny_model(seed=1)
    with pytest.raises(ValueError, match="decodes with the policy module it was built with"):
        NativeSampler(model, {0}, 96, 8).sync(tiny_model(seed=1), 3)


def test_the_native_sampler_is_the_default_and_decodes_the_policy_itself():
    model = tiny_model(seed=2)
    cfg = RLConfig(group_size=2, prompts_per_rollout=2, max_new_tokens=5, batch_size=4)
    src = RolloutSource(model, _prompts(), _parity_reward, cfg, {0}, 96, lambda ids: ",".join(map(str, ids)), 0)
    assert isinstance(src.sampler, NativeSampler) and src.sampler.model is model
    src.batch(0)
    assert src.stats["sync_mb"] == 0 and src.stats["logp_mismatch_max"] < 1e-4 and model.training
    json.dumps(src.stats)
