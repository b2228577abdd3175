"""The data engine's endpoint pool against a real scripted OpenAI-compatible server on localhost: the persistent
response cache (a second run sends nothing, counted on the server), what its key covers, retries and failover,
weights, per-endpoint concurrency, timeouts, budgets, and the accounting that adds up."""

import pytest

from eval.serve import background_server
from ordata.llm.client import Ask, LLMClient, Usage, cache_key
from tests.ordata.scripted_llm import Script, ScriptedServer
from trex.core.config import LLMBudget, LLMConfig, LLMEndpoint


@pytest.fixture
def server():
    srv = ScriptedServer(Script(rows=[], data_seed=0))
    with background_server(srv.app) as url:
        srv.url, srv.port = url, int(url.rsplit(":", 1)[1])
        yield srv


def endpoint(server, name, **kw) -> LLMEndpoint:
    kw = {"model": name, "backoff_s": 0.01, "max_backoff_s": 0.05, **kw}
    return LLMEndpoint(base_url=f"{server.url}/{name}/v1", name=name, **kw)


def asks(n: int, tag: str = "question", temperature: float = 0.7) -> list[Ask]:
    return [Ask([{"role": "user", "content": f"{tag} {i}"}], temperature, 1.0, 16, i) for i in range(n)]


def test_second_run_is_served_from_the_cache_with_no_request(server, tmp_path):
    with LLMClient([endpoint(server, "a")], tmp_path / "cache") as client:
        usage = Usage()
        first = client.ask(asks(6), usage)
    assert server.count(endpoint="a") == 6 and all(r.ok and not r.cached and r.text == "Hello." for r in first)
    u = usage.to_dict()
    assert (u["calls"], u["answered"], u["cache_hits"], u["http_requests"]) == (6, 6, 0, 6) and u["balanced"]
    assert u["completion_tokens"] == 6 and u["endpoints"]["a"]["requests"] == 6
    with LLMClient([endpoint(server, "a")], tmp_path / "cache") as client:  # a new run: a new process, same cache
        usage = Usage()
        second = client.ask(asks(6), usage)
    assert server.count(endpoint="a") == 6  # nothing more reached the server
    assert [r.text for r in second] == [r.text for r in first] and all(r.cached for r in second)
    u = usage.to_dict()
    assert (u["cache_hits"], u["sent"], u["http_requests"], u["cached_completion_tokens"]) == (6, 0, 0, 6)


def test_the_cache_key_is_model_prompt_and_sampling(server, tmp_path):
    a = Ask([{"role": "user", "content": "q"}], 0.7, 1.0, 16, 1)
    base = cache_key("m", a.messages, a.sampling(), {})
    assert base == cache_key("m", [{"content": "q", "role": "user"}], dict(reversed(a.sampling().items())), {})
    others = [cache_key("m2", a.messages, a.sampling(), {}), cache_key("m", [{"role": "user", "content": "q2"}],
                                                                        a.sampling(), {}),
              *(cache_key("m", a.messages, {**a.sampling(), k: v}, {}) for k, v in
                (("seed", 2), ("temperature", 0.0), ("top_p", 0.9), ("max_tokens", 17))),
              cache_key("m", a.messages, a.sampling(), {"top_k": 5})]
    assert base not in others and len(set(others)) == len(others)
    with LLMClient([endpoint(server, "a")], tmp_path / "c") as client:
        client.ask(asks(3), Usage())
        client.ask(asks(3, temperature=0.0) + asks(3, tag="other"), Usage())  # other sampling, other prompts
    assert server.count(endpoint="a") == 9
    # the same requests to the same model behind another endpoint: served from the cache
    with LLMClient([endpoint(server, "b", model="a")], tmp_path / "c") as client:
        usage = Usage()
        client.ask(asks(3), usage)
    assert server.count(endpoint="b") == 0 and usage.counts["cache_hits"] == 3


def test_retries_then_failover_then_the_cache_of_the_endpoint_that_answered(server, tmp_path):
    server.script.fail["a"] = 10 ** 6  # endpoint a always answers 500
    server.script.throttle["b"] = 2  # b asks the first two requests to come back (429, Retry-After: 0)
    eps = [endpoint(server, "a", max_retries=1, weight=5.0), endpoint(server, "b", max_retries=2)]
    with LLMClient(eps, tmp_path / "cache") as client:
        usage = Usage()
        replies = client.ask(asks(8), usage)
    assert all(r.ok and r.endpoint == "b" for r in replies)
    u = usage.to_dict()
    tried_a = u["endpoints"]["a"]["requests"]
    assert tried_a >= 1 and u["endpoints"]["a"]["errors"] == tried_a and server.count(endpoint="a") == 2 * tried_a
    assert u["endpoints"]["b"]["retries"] == 2 and u["endpoints"]["a"]["retries"] == tried_a
    assert u["answered"] == 8 and u["failed"] == 0 and u["balanced"]
    assert u["http_requests"] == server.count() == 2 * tried_a + 8 + 2
    seen = server.count()
    with LLMClient(eps, tmp_path / "cache") as client:  # a looks up its own key (a miss), then b's (a hit)
        usage = Usage()
        again = client.ask(asks(8), usage)
    assert server.count() == seen and [r.text for r in again] == [r.text for r in replies]
    assert usage.counts["cache_hits"] == 8


def test_every_endpoint_failing_is_an_error_reply_that_is_not_cached(server, tmp_path):
    server.script.fail["a"] = 2
    with LLMClient([endpoint(server, "a", max_retries=0)], tmp_path / "cache") as client:
        usage = Usage()
        replies = client.ask(asks(2), usage)
        assert all(not r.ok and "HTTP 500" in r.error for r in replies)
        assert usage.to_dict()["failed"] == 2 and usage.to_dict()["balanced"]
        again = client.ask(asks(2), Usage())  # the failures were not cached: asked again, answered now
    assert all(r.ok and not r.cached for r in again) and server.count() == 4


def test_weights_share_the_requests_and_concurrency_is_capped_per_endpoint(server, tmp_path):
    server.script.hold_s = 0.2
    eps = [endpoint(server, "a", weight=3.0, max_concurrency=3), endpoint(server, "b", weight=1.0, max_concurrency=1)]
    with LLMClient(eps, tmp_path / "cache") as client:
        client.ask(asks(160), Usage())
    share = server.count(endpoint="a") / 160
    assert 0.65 <= share <= 0.85, share
    assert server.max_inflight["a"] <= 3 and server.max_inflight["b"] == 1 and server.max_inflight["all"] >= 2


def test_a_request_past_its_timeout_fails_over_and_is_counted(server, tmp_path):
    server.script.hang = "slow"
    # the hanging request is answered 2 s after it arrives, always past the 1.5 s timeout; the other one has
    # 1.5 s to be answered (0.3 s was too short when a third test process loaded the 2 cores)
    eps = [endpoint(server, "a", timeout_s=1.5, max_retries=0)]
    with LLMClient(eps, tmp_path / "cache") as client:
        usage = Usage()
        slow, fast = client.ask(asks(1, tag="slow") + asks(1, tag="fast"), usage)
    assert not slow.ok and "Timeout" in slow.error and fast.ok
    assert usage.to_dict()["failed"] == 1 and usage.to_dict()["answered"] == 1


def test_budgets_refuse_in_request_order_and_cache_hits_are_free(server, tmp_path):
    with LLMClient([endpoint(server, "a")], tmp_path / "cache") as client:
        usage = Usage(LLMBudget(max_requests=3))
        replies = client.ask(asks(5), usage)
        assert [r.ok for r in replies] == [True, True, True, False, False] and replies[3].refused
        assert usage.to_dict()["refused_budget"] == 2 and usage.to_dict()["balanced"]
        usage = Usage(LLMBudget(max_requests=0))  # a new stage with no budget: only what the cache holds
        assert [r.ok for r in client.ask(asks(5), usage)] == [True, True, True, False, False]
        tokens = Usage(LLMBudget(max_completion_tokens=1))
        assert all(r.ok for r in client.ask(asks(2, tag="t"), tokens))  # under budget before the batch
        assert all(r.refused for r in client.ask(asks(2, tag="u"), tokens))  # spent: the next batch is refused
    assert server.count() == 5


def test_stages_need_endpoints_and_labels_are_unique():
    with pytest.raises(ValueError, match="llm.distill.enabled needs llm.endpoints"):
        LLMConfig(distill={"enabled": True})
    e = {"base_url": "http://127.0.0.1:1/v1", "model": "m"}
    with pytest.raises(ValueError, match="share a label"):
        LLMConfig(endpoints=[e, e])
    assert LLMConfig(endpoints=[e, {**e, "name": "second"}]).endpoints[0].label == "m@127.0.0.1:1"


def test_a_reasoning_servers_separate_reasoning_comes_back_as_think(server, tmp_path):
    with LLMClient([endpoint(server, "a")], tmp_path / "cache") as client:
        (reply,) = client.ask([Ask([{"role": "user", "content": "[reasoning] why?"}], 0.0, 1.0, 16, 0)], Usage())
    assert reply.text == "<think>\nBecause.\n</think>\nAnswer."
