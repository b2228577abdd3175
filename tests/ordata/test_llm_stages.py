"""Rewrite and self-distillation against a real scripted OpenAI-compatible server on localhost, on curated,
solver-verified instances: every scripted answer -- good, wrong, non-executable, malicious programs; paraphrases
with dropped, altered or added numbers or a missing data key; repairs -- is kept or rejected for the right
reason, malicious programs are contained (nothing written on the host, nothing reached the server), the
accounting adds up, and a second run is served entirely from the response cache (no request on the server)."""

import json
from pathlib import Path

import datasets
import pytest

from eval.serve import background_server
from ordata.curate import assemble, build
from ordata.llm.client import LLMClient
from ordata.llm.distill import distill
from ordata.llm.rewrite import rewrite
from tests.ordata.scripted_llm import Script, ScriptedServer
from trex.core.config import DataConfig

BASE = dict(sft={"samples": 6, "val_fraction": 0.0}, eval={"problems": 2}, cpt={"documents": 3}, max_size=3,
            infeasible_rate=0.0, representations=["DP", "DPS"],
            ood={"problems": 2, "families": ["diet"], "representations": ["DT"]})


@pytest.fixture(scope="module")
def instances():
    return build(DataConfig(**BASE))


def config(url: str, data: dict | None = None, **llm) -> DataConfig:
    endpoint = {"base_url": f"{url}/a/v1", "model": "scripted", "name": "a", "backoff_s": 0.01, "max_concurrency": 4}
    return DataConfig(**{**BASE, **(data or {})}, llm={"endpoints": [endpoint], **llm})


@pytest.fixture
def server(instances):
    rows = [r for split in instances.splits() for r in instances.rows[split]]
    srv = ScriptedServer(Script(rows=rows, data_seed=DataConfig(**BASE).seed))
    with background_server(srv.app) as url:
        srv.url, srv.port = url, int(url.rsplit(":", 1)[1])
        yield srv


def rejected(inst, stage: str) -> dict[str, str]:
    return {r["id"]: r["reason"] for r in inst.rejections if r["stage"] == stage}


def balanced(info: dict) -> bool:
    return all(a["balanced"] for a in info["accounting"].values())


def test_rewrites_are_kept_or_rejected_for_the_right_reason(instances, server, tmp_path):
    sft, cpt, ood = instances.rows["sft"], instances.rows["cpt"], instances.rows["eval_ood"]
    dp = [r["id"] for r in sft if r["representation"] == "DP"]
    dps = [r["id"] for r in sft if r["representation"] == "DPS"]
    s = server.script
    s.rewrite.update({dp[0]: ["drop", "drop"], dp[1]: ["alter", "good"], dp[2]: ["add", "add"], dps[0]: ["nokey", "nokey"],
                      ood[1]["id"]: ["alter", "alter"]})
    s.forward.update({dps[1]: ["wrong", "wrong"], dps[2]: ["crash", "good"], cpt[0]["id"]: ["malicious", "malicious"],
                      cpt[1]["id"]: ["none", "none"]})
    s.host_file = str(tmp_path / "owned-by-a-model")
    cfg = config(server.url, rewrite={"enabled": True, "forward_temperature": 0.0})
    with LLMClient(cfg.llm.endpoints, tmp_path / "cache") as client:
        out = rewrite(instances, cfg, client)
    assert rejected(out, "rewrite") == {
        dp[0]: "rewrite_number_missing", dp[2]: "rewrite_number_added", dps[0]: "rewrite_key_missing",
        ood[1]["id"]: "rewrite_number_missing", dps[1]: "forward_program_mismatch", cpt[0]["id"]: "forward_side-effect: open.write",
        cpt[1]["id"]: "forward_no_program"}
    assert not Path(s.host_file).exists() and server.pwned == []  # the malicious program reached nothing
    acc = out.accounting["rewrite"]
    n = len(sft) + len(cpt) + len(ood)
    assert (acc["in"], acc["kept"], acc["quarantined"], sum(acc["rejected"].values())) == (n, n - 7, 0, 7)
    assert acc["balanced"]
    report = out.llm["rewrite"]["report"]
    assert report["repairs"] == {"rewrite": {"tried": 5, "fixed": 1}, "forward": {"tried": 4, "fixed": 1}}
    assert report["per_split"]["eval_ood"] == {"in": len(ood), "kept": len(ood) - 1}
    new = {r["id"]: r for split in ("sft", "cpt", "eval_ood") for r in out.rows[split]}
    for i in (dp[1], dps[2], ood[0]["id"]):  # kept (two after their repair): new wording, its source, the old one
        assert new[i]["question_source"] == "rewrite@scripted" and new[i]["question"] != new[i]["template_question"]
    for i in (dp[0], dps[1]):
        assert "question_source" not in new[i] and new[i]["question"] == next(r for r in sft if r["id"] == i)["question"]
    assert out.rows["eval"] == instances.rows["eval"]  # the in-distribution held-out split is never rewritten
    kinds = server.kinds()
    assert kinds["rewrite"] == 11 + 5 and kinds["forward"] == 11 - 4 + 4
    usage = out.llm["rewrite"]["usage"]
    assert usage["answered"] == server.count() and usage["balanced"] and usage["cache_hits"] == 0

    info = assemble(cfg, out, tmp_path / "data")  # every stage adds up, the rewritten wording reaches the datasets
    assert balanced(info) and info["accounting"]["rewrite"]["rejected"]["forward_program_mismatch"] == 1
    ood_rows = datasets.load_from_disk(str(tmp_path / "data" / "eval_ood")).to_list()
    assert sorted(r["question_source"] for r in ood_rows) == ["rewrite@scripted", "template"]
    chats = {r["id"]: r for r in datasets.load_from_disk(str(tmp_path / "data" / "sft")).to_list()}
    assert chats[dp[1]]["question_source"] == "rewrite@scripted" and chats[dp[0]]["question_source"] == "template"
    assert new[dp[1]]["question"] in chats[dp[1]]["messages"][1]["content"]

    seen = server.count()
    with LLMClient(cfg.llm.endpoints, tmp_path / "cache") as client:  # a repeated run: all from the cache
        again = rewrite(instances, cfg, client)
    assert server.count() == seen and again.rows == out.rows
    assert again.llm["rewrite"]["usage"]["cache_hits"] == usage["calls"] and again.llm["rewrite"]["usage"]["sent"] == 0


def test_distillation_keeps_correct_answers_and_accounts_for_every_sample(instances, server, tmp_path):
    sft = [r["id"] for r in instances.rows["sft"]]
    s = server.script
    s.host_file = str(tmp_path / "owned-by-a-model")
    s.distill.update({sft[0]: ["long", "good", "wrong"], sft[1]: ["wrong", "crash", "malicious"],
                      sft[2]: ["no_think", "truncated", "none"]})
    cfg = config(server.url, distill={"enabled": True, "k": 3, "temperature": 0.7})
    with LLMClient(cfg.llm.endpoints, tmp_path / "cache") as client:
        out = distill(instances, cfg, client)
    samples = {(r["id"], r["sample"]): r["reason"] for r in out.rejections if r["stage"] == "distill_samples"}
    assert samples == {(sft[0], 2): "program_mismatch", (sft[1], 0): "program_mismatch", (sft[1], 1): "program_error",
                       (sft[1], 2): "side-effect: open.write", (sft[2], 0): "missing_think",
                       (sft[2], 1): "answer_truncated", (sft[2], 2): "no_program"}
    assert not Path(s.host_file).exists() and server.pwned == []
    assert rejected(out, "distill") == {sft[1]: "distill_no_accepted_sample", sft[2]: "distill_no_accepted_sample"}
    rows = {r["id"]: r for r in out.rows["sft"]}
    assert rows[sft[0]]["distilled"]["sample"] == 1  # the shortest of the two correct answers
    assert rows[sft[1]].get("answer_source") is None and "distilled" not in rows[sft[1]]  # template fallback
    assert all(rows[i]["answer_source"] == "distilled@scripted" for i in sft[3:])
    assert out.accounting["distill"] == {"in": 6, "kept": 4, "quarantined": 0, "fallback_template": 2, "dropped": 0,
                                         "rejected": {"distill_no_accepted_sample": 2}, "balanced": True}
    acc = out.accounting["distill_samples"]
    assert (acc["in"], acc["kept"], sum(acc["rejected"].values()), acc["balanced"]) == (18, 18 - 7, 7, True)
    rates = out.llm["distill"]["report"]
    assert rates["overall"]["samples"] == 18 and rates["overall"]["correct"] == 18 - 7 + 2  # truncated, no think
    assert sum(c["problems"] for c in rates["per_cell"].values()) == 6
    assert all(len(c.split("/")) == 3 for c in rates["per_cell"])
    assert server.kinds()["distill"] == 18

    cfg3 = config(server.url, {"answer_styles": ["code_only", "math_model_with_code", "math_model"]},
                  distill={"enabled": True, "k": 3, "temperature": 0.7})
    info = assemble(cfg3, out, tmp_path / "data")
    assert balanced(info) and info["text_sources"]["sft"]["answer_source"] == {"distilled@scripted": 4, "template": 2}
    chats = {r["id"]: r for r in datasets.load_from_disk(str(tmp_path / "data" / "sft")).to_list()}
    for i in sft[3:]:
        answer, style = chats[i]["messages"][2]["content"], chats[i]["style"]
        assert answer.startswith("<think>\nThe decisions") and chats[i]["answer_source"] == "distilled@scripted"
        assert ("```python" in answer) == (style != "math_model")
        assert ("optimal objective value is" in answer) == (style == "math_model")
    assert chats[sft[1]]["messages"][2]["content"].startswith(("```python", "**")) and \
        chats[sft[1]]["answer_source"] == "template"

    seen = server.count()
    drop = config(server.url, distill={"enabled": True, "k": 3, "temperature": 0.7, "on_failure": "drop",
                                       "select": "first"})
    with LLMClient(drop.llm.endpoints, tmp_path / "cache") as client:  # same requests: all from the cache
        dropped = distill(instances, drop, client)
    assert server.count() == seen and dropped.llm["distill"]["usage"]["cache_hits"] == 18
    assert [r["id"] for r in dropped.rows["sft"]] == [sft[0], *sft[3:]]
    assert {r["id"]: r["distilled"]["sample"] for r in dropped.rows["sft"]}[sft[0]] == 0  # the first correct one
    assert dropped.accounting["distill"]["dropped"] == 2
    info = assemble(drop, dropped, tmp_path / "dropped")
    assert balanced(info) and info["counts"]["sft"] == 4


def test_an_exhausted_budget_is_a_reason_not_a_loss(instances, server, tmp_path):
    cfg = config(server.url, distill={"enabled": True, "k": 2, "temperature": 0.7, "max_requests": 5})
    with LLMClient(cfg.llm.endpoints, tmp_path / "cache") as client:
        out = distill(instances, cfg, client)
    reasons = [r["reason"] for r in out.rejections if r["stage"] == "distill_samples"]
    assert reasons.count("llm_budget_exhausted") == 12 - 5 and server.count() == 5
    usage = out.llm["distill"]["usage"]
    assert usage["refused_budget"] == 7 and usage["balanced"] and len(out.rows["sft"]) == 6
    assert json.dumps(out.accounting)  # the accounting is plain data
