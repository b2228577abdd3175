"""``trex serve`` with continuous batching, seen through the official ``openai`` client on a real uvicorn
server (a port from the OS) in front of a tiny native T-Rex export: concurrent requests share forward
passes and answer exactly as they do alone (greedy and seeded sampling, per-request stop strings), streaming,
``n > 1``; the decode batch underneath (rows joining and leaving between steps); the generic batcher (hf)."""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from eval.backends import Completion, NativeBackend, OpenAIBackend, SamplingParams, truncate_at_stop
from eval.serve import _events, _Request, _sendable, background_server, create_app
from tests.trainer.helpers import tiny_model
from trainer.export import export
from trainer.generate import DecodeBatch, Row, generate
from trainer.tokenizer import ChatTokenizer, train_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["minimise the cost of shipping 12 pallets", "maximise profit 3x + 4y subject to x + y <= 10"] * 20
QUESTIONS = ["maximise profit", "minimise the cost of shipping 12 pallets subject to x + y <= 10", "hi",
             "schedule 3 machines", "x + y <= 10"]


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    train_tokenizer(TEXTS, root / "tok", vocab_size=300)
    vocab = ChatTokenizer(root / "tok").vocab_size
    # index_topk >= the CSA entries of a 128-token context: no exact top-k ties (see trainer/generate.py)
    export(tiny_model(seed=2, vocab=vocab, max_seq_len=128, index_topk=32), root / "tok", root / "trex")
    return NativeBackend(root / "trex")


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _ask(client: OpenAI, q: str, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], **kw)


def _answer(r) -> tuple[str, str, int]:
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens


def _stream(client: OpenAI, q: str, **kw) -> tuple[list, dict[int, str], dict[int, str]]:
    chunks = list(_ask(client, q, stream=True, **kw))
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return chunks, text, finish


def test_concurrent_requests_share_forward_passes_and_answer_as_alone(native):
    app = create_app(native, "tiny", max_batch=16)
    with background_server(app) as url:
        client, batcher = _client(url), app.state.batcher
        greedy = {"temperature": 0, "max_tokens": 10}
        full = _ask(client, QUESTIONS[1], **greedy).choices[0].message.content
        stop = full[len(full) // 2:len(full) // 2 + 2]
        sampled = _ask(client, QUESTIONS[2], temperature=1.0, seed=3, max_tokens=10).choices[0].message.content
        stop3 = sampled[4:6]
        assert stop.strip() and stop3.strip(), (full, sampled)
        specs = [(q, greedy) for q in QUESTIONS] + [
            (QUESTIONS[1], {**greedy, "stop": [stop]}),  # per-request stop strings in one batch
            (QUESTIONS[0], {"temperature": 0.7, "top_p": 0.9, "seed": 1, "max_tokens": 10}),
            (QUESTIONS[0], {"temperature": 1.3, "seed": 2, "max_tokens": 8}),
            (QUESTIONS[2], {"temperature": 1.0, "seed": 3, "max_tokens": 10, "stop": stop3}),
            (QUESTIONS[2], {"temperature": 1.0, "seed": 3, "max_tokens": 10}),  # twice in the batch
            (QUESTIONS[2], {"temperature": 1.0, "seed": 3, "max_tokens": 10}),
            (QUESTIONS[3], {"temperature": 0.9, "top_p": 0.5, "seed": 4, "max_tokens": 6})]
        before = batcher.forward_passes
        alone = [_answer(_ask(client, q, **kw)) for q, kw in specs]  # one at a time: batches of one
        sequential = batcher.forward_passes - before
        assert alone[5][:2] == (truncate_at_stop(full, [stop])[0], "stop") and alone[5][2] < alone[1][2]
        assert alone[8][:2] == (truncate_at_stop(sampled, [stop3])[0], "stop") and alone[9][0] == sampled
        assert alone[9] == alone[10] and len({alone[6][0], alone[7][0], sampled}) == 3  # seeds matter and repeat

        batcher.hold()  # queue every request, then admit them together
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(_ask, client, q, **kw) for q, kw in specs]
            assert batcher.wait_queued(len(specs), timeout=60)
            before = batcher.forward_passes
            batcher.release()
            batched = [_answer(f.result()) for f in futures]
        passes = batcher.forward_passes - before
    assert batched == alone
    assert passes <= 10 < len(specs) and sequential >= 4 * passes  # one prefill + at most 9 decode steps


def test_trex_own_client_is_batched_and_answers_as_the_native_backend(native):
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS] * 2
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=8, seed=11)  # request i: seed 11 + i
    app = create_app(native, "tiny", max_batch=16)
    with background_server(app) as url:
        batcher = app.state.batcher
        client = OpenAIBackend("tiny", base_url=f"{url}/v1", max_concurrency=len(chats), backoff_s=0.01)
        batcher.hold()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.generate, chats, params)
            assert batcher.wait_queued(len(chats), timeout=60)
            before = batcher.forward_passes
            batcher.release()
            got = future.result()
        passes = batcher.forward_passes - before
    want = native.generate(chats, params)
    assert [(g.text, g.completion_tokens, g.finish_reason) for g in got] == \
           [(w.text, w.completion_tokens, w.finish_reason) for w in want]
    assert passes <= 8 < len(chats) and len({w.text for w in want}) == len(chats)  # the repeats differ: own seeds


def test_rows_join_and_leave_between_steps_and_decode_as_alone(native):
    net, tok = native.net, native.tok
    ends = native.end_ids
    prompts = [native.encode([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = [(0.0, 1.0, 0), (0.9, 0.9, 5), (1.3, 1.0, 7), (0.0, 1.0, 0), (0.7, 0.5, 11)]
    alone = [generate(net, [p], 12, ends, tok.pad_id, t, tp, s)[0] for p, (t, tp, s) in zip(prompts, params)]
    rows = [Row(p, 12, t, tp, s) for p, (t, tp, s) in zip(prompts, params)]
    batch = DecodeBatch(net, ends, tok.pad_id)
    batch.add(rows[:2])
    batch.step()
    batch.step()
    batch.add(rows[2:4])  # two rows join a batch that is 3 tokens in
    cancelled = Row(prompts[0], 12)
    batch.add([cancelled])
    assert len(batch.rows) == 5 and batch.cache.batch == 5
    batch.step()
    cancelled.cancelled = True  # from another thread, say: it leaves at the next step boundary
    batch.add(rows[4:])
    while batch.rows:
        batch.step()
    assert [r.tokens for r in rows] == alone and all(r.finish_reason in ("stop", "length") for r in rows)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) == 2
    assert batch.forward_passes < sum(len(a) for a in alone)
    with pytest.raises(ValueError, match="max_seq_len"):
        batch.add([Row([1] * 128, 4)])


def test_streamed_answer_equals_the_unstreamed_one(native):
    app = create_app(native, "tiny")
    with background_server(app) as url:
        client = _client(url)
        for kw in ({"temperature": 0, "max_tokens": 16}, {"temperature": 1.1, "seed": 9, "max_tokens": 16}):
            plain = _ask(client, QUESTIONS[1], **kw)
            text = plain.choices[0].message.content
            stop = text[len(text) // 2:len(text) // 2 + 3]
            for extra in ({}, {"stop": [stop, "zzz"]}):
                chunks, streamed, finish = _stream(client, QUESTIONS[1], stream_options={"include_usage": True},
                                                   **kw, **extra)
                want = _ask(client, QUESTIONS[1], **kw, **extra)
                assert streamed == {0: want.choices[0].message.content} and finish == {0: want.choices[0].finish_reason}
                assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
                if not extra:  # token by token
                    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
                assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == want.usage.model_dump()
                assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
        # the wire format: server-sent events ending with [DONE]; no usage chunk unless asked for
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                                "temperature": 0}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
        bodies = [json.loads(e[6:]) for e in events[:-1]]
        assert bodies[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" not in bodies[-1]


def test_n_choices(native):
    app = create_app(native, "tiny")
    with background_server(app) as url:
        client = _client(url)
        sampled = {"temperature": 1.0, "seed": 5, "max_tokens": 8}
        r = _ask(client, QUESTIONS[0], n=3, **sampled)
        singles = [_ask(client, QUESTIONS[0], **{**sampled, "seed": 5 + i}) for i in range(3)]
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
        assert len({c.message.content for c in r.choices}) > 1  # choice i samples with seed + i
        assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
        assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
        g = _ask(client, QUESTIONS[0], n=2, temperature=0, max_tokens=8)
        one = _ask(client, QUESTIONS[0], temperature=0, max_tokens=8).choices[0].message.content
        assert [c.message.content for c in g.choices] == [one, one]
        _, streamed, finish = _stream(client, QUESTIONS[0], n=3, **sampled)
        assert streamed == {i: c.message.content for i, c in enumerate(r.choices)} and set(finish) == {0, 1, 2}
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "n": 0}).status_code == 400


def test_text_is_held_back_while_it_may_start_a_stop_string():
    assert _sendable("the answer is 4", []) == 15
    assert _sendable("the answer is 4", ["4 ", "</"]) == 14  # "4" may start "4 "
    assert _sendable("x <", ["</python>"]) == 2 and _sendable("x </pyt", ["</python>"]) == 2
    assert _sendable("caf\ufffd", ["zz"]) == 3  # an incomplete UTF-8 character waits for its next byte


def test_a_stream_that_stops_being_read_cancels_its_rows():
    async def run():
        request = _Request(1, True, asyncio.get_running_loop())
        request.rows = [Row([1, 2], 8)]
        events = _events(request, "chatcmpl-x", "tiny", False)
        first = json.loads((await events.__anext__())[6:])
        await events.aclose()  # the client went away
        return first, request.rows[0]

    first, row = asyncio.run(run())
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and row.cancelled


class _Echo:
    """A backend without an engine (served by the generic batcher, as hf is)."""

    kind, model = "echo", "echo"

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def generate(self, messages_list, params):
        self.calls.append((len(messages_list), params.seed))
        return [Completion(f"{m[-1]['content']} seed={params.seed if params.temperature else '-'}", 3, 2, "stop")
                for m in messages_list]

    def describe(self) -> dict:
        return {"kind": self.kind}


def test_other_backends_stream_one_delta_and_answer_n_choices():
    backend = _Echo()
    with background_server(create_app(backend, "tiny")) as url:
        client = _client(url)
        r = _ask(client, "hi", n=2, temperature=0.5, seed=10)
        assert [c.message.content for c in r.choices] == ["hi seed=10", "hi seed=11"] and r.usage.completion_tokens == 4
        _, streamed, finish = _stream(client, "yo", n=2, temperature=0)
        assert streamed == {0: "yo seed=-", 1: "yo seed=-"} and finish == {0: "stop", 1: "stop"}
    assert backend.calls[-1][0] == 1  # greedy choices: generated once
