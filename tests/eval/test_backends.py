"""Generation backends: native vs trainer.generate, hf (tiny Llama and the T-Rex export itself), the openai
backend over real HTTP against eval.serve, retries / errors, and the missing-vLLM message."""

import asyncio
import shutil
import sys

import httpx
import pytest
import typer
from typer.testing import CliRunner

from eval.backends import (
    BackendUnavailableError,
    Completion,
    HFBackend,
    NativeBackend,
    OpenAIBackend,
    SamplingParams,
    make_backend,
    truncate_at_stop,
)
from eval.serve import background_server, create_app
from tests.trainer.helpers import tiny_model
from trainer.export import export
from trainer.generate import generate
from trainer.tokenizer import TOKENIZER_FILES, ChatTokenizer, train_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["minimise the cost of shipping 12 pallets", "maximise profit 3x + 4y subject to x + y <= 10"] * 20
CHATS = [[{"role": "user", "content": "maximise profit"}],
         [{"role": "system", "content": "You write solver programs."},
          {"role": "user", "content": "minimise the cost of shipping 12 pallets subject to x + y <= 10"}],
         [{"role": "user", "content": "hi"}]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("backends")
    train_tokenizer(TEXTS, root / "tok", vocab_size=300)
    vocab = ChatTokenizer(root / "tok").vocab_size
    export(tiny_model(seed=2, vocab=vocab, max_seq_len=128), root / "tok", root / "trex")
    return root


@pytest.fixture(scope="module")
def native(dirs):
    return NativeBackend(dirs / "trex", batch_size=2)


@pytest.fixture(scope="module")
def greedy(native):
    return native.generate(CHATS, GREEDY)


@pytest.fixture(scope="module")
def llama_dir(dirs):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = ChatTokenizer(dirs / "tok")
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(dirs / "llama")
    for name in TOKENIZER_FILES:
        if (dirs / "tok" / name).is_file():
            shutil.copy2(dirs / "tok" / name, dirs / "llama" / name)
    return dirs / "llama"


def test_native_backend_equals_trainer_generate(native, greedy):
    tok, net = native.tok, native.net
    prompts = [tok.encode_chat(m, add_generation_prompt=True)[0] for m in CHATS]
    ends = {tok.end_id, tok.eos_id}
    direct = generate(net, prompts, 12, ends, tok.pad_id)  # one batch; the backend runs batches of 2
    outs = greedy
    assert [o.text for o in outs] == [tok.decode(d) for d in direct]
    assert [o.completion_tokens for o in outs] == [len(d) for d in direct]
    assert [o.prompt_tokens for o in outs] == [len(p) for p in prompts]
    assert [o.finish_reason for o in outs] == ["length" if len(d) == 12 else "stop" for d in direct]

    # sampling: request i draws from its own generator seeded seed + i, whatever the batches
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=8, seed=7)
    ref = generate(net, [prompts[0], prompts[2]], 8, ends, tok.pad_id, 0.9, 0.9, 7)
    assert [o.text for o in native.generate([CHATS[0], CHATS[2]], sampled)] == [tok.decode(r) for r in ref]
    alone = generate(net, [prompts[2]], 8, ends, tok.pad_id, 0.9, 0.9, 8)[0]
    assert alone == ref[1]  # decoded alone with its seed, prompt 2 samples the same tokens
    assert native.describe()["params"] == sampled.model_dump() and native.describe()["kind"] == "native"


def test_native_stop_strings_and_too_long_prompts(native, greedy):
    full = greedy[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    assert stop.strip(), full.text
    cut = native.generate(CHATS[:1], GREEDY.model_copy(update={"stop": [stop]}))[0]
    assert cut.text == truncate_at_stop(full.text, [stop])[0] and cut.finish_reason == "stop"
    assert cut.completion_tokens < full.completion_tokens
    long = [{"role": "user", "content": "maximise profit " * 200}]
    outs = native.generate([long, CHATS[0]], GREEDY)
    assert outs[0].finish_reason == "error" and "max_seq_len" in outs[0].error and outs[0].text == ""
    assert outs[1].text == full.text


def test_hf_backend_is_deterministic_and_batches_with_left_padding(llama_dir):
    batched, solo = HFBackend(llama_dir, batch_size=3), HFBackend(llama_dir, batch_size=1)
    assert batched.options["padding"] == "left" and not batched.options["add_bos"]
    a, b = batched.generate(CHATS, GREEDY), solo.generate(CHATS, GREEDY)
    assert [x.text for x in a] == [x.text for x in b] and all(x.completion_tokens > 0 for x in a)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    s1, s2 = batched.generate(CHATS, sampled), batched.generate(CHATS, sampled)
    assert [x.text for x in s1] == [x.text for x in s2]
    assert [x.text for x in s1] != [x.text for x in batched.generate(CHATS, sampled.model_copy(update={"seed": 4}))]
    stop = a[1].text[4:6]
    cut = batched.generate(CHATS, GREEDY.model_copy(update={"stop": [stop]}))
    assert cut[1].text == truncate_at_stop(a[1].text, [stop])[0] and cut[1].finish_reason == "stop"
    assert batched.describe()["params"]["stop"] == [stop]


def test_hf_backend_on_the_trex_export_matches_native(dirs, greedy):
    hf = make_backend("hf", str(dirs / "trex"), batch_size=4)
    assert hf.options["padding"] == "none" and hf.options["add_bos"]  # DeepSeek-V4: equal-length batches only
    assert [o.text for o in hf.generate(CHATS, GREEDY)] == [o.text for o in greedy]


def test_openai_backend_against_the_server_equals_native(native, greedy):
    app = create_app(native, "tiny-trex", max_batch=4)
    with background_server(app) as url:
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-trex"
        client = OpenAIBackend("tiny-trex", base_url=f"{url}/v1", max_concurrency=3, backoff_s=0.01)
        expected = greedy
        got = client.generate(CHATS, GREEDY)
        assert [(g.text, g.prompt_tokens, g.completion_tokens, g.finish_reason) for g in got] == \
               [(e.text, e.prompt_tokens, e.completion_tokens, e.finish_reason) for e in expected]
        stop = expected[0].text[3:5]
        assert client.generate(CHATS[:1], GREEDY.model_copy(update={"stop": [stop]}))[0].text == \
               truncate_at_stop(expected[0].text, [stop])[0]
        # per-request errors: a prompt too long for the model (400, not retried), a wrong model name (404)
        long = [{"role": "user", "content": "maximise profit " * 200}]
        outs = client.generate([long, CHATS[2]], GREEDY)
        assert outs[0].finish_reason == "error" and "HTTP 400" in outs[0].error and outs[1].text == expected[2].text
        wrong = OpenAIBackend("other", base_url=f"{url}/v1", backoff_s=0.01).generate(CHATS[:1], GREEDY)[0]
        assert wrong.finish_reason == "error" and "HTTP 404" in wrong.error
        assert client.describe()["stats"] == {"requests": 6, "errors": 1, "retries": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHATS[0], "temperature": 0, "max_tokens": 12,
                                                            "n": 1, "stop": "zzz"}).json()
        assert r["object"] == "chat.completion" and r["choices"][0]["message"]["content"] == expected[0].text
        assert r["usage"]["total_tokens"] == expected[0].prompt_tokens + expected[0].completion_tokens
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": CHATS[0], "n": 0}).status_code == 400
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": []}).status_code == 400


def _stub_app():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, seen = FastAPI(), {}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        what = body["messages"][-1]["content"]
        seen[what] = seen.get(what, 0) + 1
        if what == "broken" or (what == "flaky" and seen[what] == 1):
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if what == "busy" and seen[what] <= 2:
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429, headers={"Retry-After": "0"})
        if what == "slow":
            await asyncio.sleep(1.0)
        return {"choices": [{"message": {"role": "assistant", "content": f"re: {what} STOP tail"},
                             "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}

    return app, seen


def test_openai_backend_retries_and_reports_errors_per_request():
    app, seen = _stub_app()
    with background_server(app) as url:
        client = OpenAIBackend("stub", base_url=f"{url}/v1", max_retries=2, backoff_s=0.01, timeout_s=0.3,
                               max_concurrency=4)
        msgs = [[{"role": "user", "content": w}] for w in ("flaky", "broken", "ok", "busy", "slow")]
        outs = client.generate(msgs, SamplingParams(stop=[" STOP"]))
    assert outs[0] == Completion("re: flaky", 3, 4, "stop") and outs[2].text == "re: ok" and outs[3].text == "re: busy"
    assert outs[1].finish_reason == "error" and "HTTP 500" in outs[1].error and "3 attempts" in outs[1].error
    assert outs[4].finish_reason == "error" and "Timeout" in outs[4].error
    assert seen == {"flaky": 2, "broken": 3, "ok": 1, "busy": 3, "slow": 3}
    assert client.describe()["stats"] == {"requests": 5, "errors": 2, "retries": 1 + 2 + 2 + 2}
    # nothing listening: connection errors are retried, then reported
    dead = OpenAIBackend("stub", base_url=f"{url}/v1", max_retries=1, backoff_s=0.01)
    dead = dead.generate(msgs[:1], SamplingParams())
    assert dead[0].finish_reason == "error" and "Connect" in dead[0].error


def test_vllm_missing_names_the_extra_and_unknown_kinds_are_listed(monkeypatch, dirs):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed, even where it is
    with pytest.raises(BackendUnavailableError, match=r"trex-or\[gpu\].*trex-or\[npu\]"):
        make_backend("vllm", str(dirs / "trex"))
    with pytest.raises(ValueError, match="native, hf, vllm, openai"):
        make_backend("tgi", "x")


def test_serve_command(monkeypatch, dirs):
    import eval.serve
    from trex.cli.serve import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    calls = []
    monkeypatch.setattr(eval.serve, "serve", lambda model, **kw: calls.append((model, kw)))
    res = CliRunner().invoke(app, ["serve", "--model", str(dirs / "trex"), "--port", "8123", "--batch-size", "4"])
    assert res.exit_code == 0, res.output
    assert calls[0][0] == str(dirs / "trex") and calls[0][1]["port"] == 8123 and calls[0][1]["batch_size"] == 4
    assert CliRunner().invoke(app, ["serve", "--model", "x", "--backend", "vllm"]).exit_code == 2
    monkeypatch.undo()
    res = CliRunner().invoke(app, ["serve", "--model", str(dirs / "missing")])
    assert res.exit_code == 2 and "not a model directory" in res.output


def test_a_repair_turn_reaches_every_backend_alike(native, dirs):
    """The repair rounds continue a conversation (answer, then the error): native, HF and an OpenAI endpoint all take
    it and answer alike (greedy)."""
    from eval.prompts import repair_turn

    # the shape of a repair turn, with a user turn short enough for this 128-token model
    chat = [*repair_turn(CHATS[0], "x = 1", "it stopped")[:2], {"role": "user", "content": "it failed: fix it"}]
    want = native.generate([chat], GREEDY)[0]
    assert want.finish_reason != "error" and want.prompt_tokens > len(native.encode(CHATS[0]))
    assert make_backend("hf", str(dirs / "trex"), batch_size=1).generate([chat], GREEDY)[0].text == want.text
    with background_server(create_app(native, "tiny-trex", max_batch=2)) as url:
        got = OpenAIBackend("tiny-trex", base_url=f"{url}/v1", backoff_s=0.01).generate([chat], GREEDY)[0]
    assert (got.text, got.prompt_tokens) == (want.text, want.prompt_tokens)
