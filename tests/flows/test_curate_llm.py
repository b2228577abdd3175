"""``trex curate`` with the LLM stages pointing at ``trex serve`` serving a tiny native T-Rex export, end to end
through the CLI and the Prefect flow: curate-instances -> rewrite -> distill -> curate. The tiny model's answers
are rejected (it writes no usable rewrite nor program) -- what matters is that every stage's accounting adds up,
that the requests the server received are the ones the usage reports, and that a second run (another state
directory, the same response cache) sends no request and gives the same data."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval.backends import NativeBackend
from eval.prompts import REFERENCE_REQUIREMENTS, REFERENCE_SYSTEM, REWRITE_INSTRUCTION, REWRITE_SYSTEM
from eval.serve import background_server, create_app
from tests.flows.test_lifecycle_e2e import children, runs_of
from tests.prefect_server import flow_env
from tests.trainer.helpers import tiny_model
from trainer.export import export
from trainer.tokenizer import ChatTokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SIZES = ["data.sft.samples=4", "data.sft.val_fraction=0", "data.eval.problems=2", "data.cpt.documents=2",
         "data.ood.problems=2", "data.ood.families=[diet]", "data.ood.representations=[DT]"]
STAGES = ["data.llm.rewrite.enabled=true", "data.llm.rewrite.max_tokens=24", "data.llm.rewrite.forward_max_tokens=24",
          "data.llm.distill.enabled=true", "data.llm.distill.k=2", "data.llm.distill.max_tokens=24"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``trex serve``'s app around a tiny native export, on a real uvicorn server; counts the requests it answers."""
    import torch

    root = tmp_path_factory.mktemp("served")
    texts = [REFERENCE_SYSTEM, REFERENCE_REQUIREMENTS, REWRITE_SYSTEM, REWRITE_INSTRUCTION,
             "A bakery makes croissants and cakes. The profit per unit is $3 for croissants and $5 for cakes."] * 20
    train_tokenizer(texts, root / "tok", vocab_size=400)
    export(tiny_model(seed=3, vocab=ChatTokenizer(root / "tok").vocab_size, max_seq_len=4096, index_topk=64),
           root / "tok", root / "trex")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models decode faster on one thread, above all on a busy machine
    app = create_app(NativeBackend(root / "trex"), "trex-tiny", max_batch=8, default_max_tokens=24)
    answered: list[str] = []

    @app.middleware("http")
    async def count(request, call_next):
        response = await call_next(request)
        if request.url.path == "/v1/chat/completions":
            answered.append(str(response.status_code))
        return response

    with background_server(app) as url:
        yield url, answered
    torch.set_num_threads(threads)


def curate(state: Path, url: str, cache: Path) -> subprocess.CompletedProcess:
    endpoint = f"data.llm.endpoints=[{{base_url: '{url}/v1', model: trex-tiny, max_concurrency: 4}}]"
    cmd = [sys.executable, "-m", "trex.cli", "curate", "--config", "configs/micro.yaml", "--set",
           f"run.state_dir={state}", *(x for s in [*SIZES, *STAGES, endpoint, f"data.llm.cache_dir={cache}"]
                                       for x in ("--set", s))]
    return subprocess.run(cmd, cwd=ROOT, env=flow_env(), capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_curate_with_llm_stages_against_trex_serve(served, tmp_path):
    url, answered = served
    first = curate(tmp_path / "s1", url, tmp_path / "cache")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    data = Path(first.stdout.strip().splitlines()[-1])
    manifest = json.loads((data / "manifest.json").read_text())
    acc = manifest["accounting"]
    assert {"generate", "verify", "rewrite", "distill", "distill_samples", "cpt_filter"} <= set(acc)
    for stage, a in acc.items():  # in = kept + rejected(reason) + quarantined, stage by stage
        assert a["balanced"] and a["in"] == a["kept"] + sum(a["rejected"].values()) + a["quarantined"], (stage, a)
    assert acc["rewrite"]["in"] == 4 + 2 + 2 and acc["distill"]["in"] == 4 and acc["distill_samples"]["in"] == 8
    usage = {stage: manifest["llm"][stage]["usage"] for stage in ("rewrite", "distill")}
    assert all(u["balanced"] and u["cache_hits"] == 0 and u["failed"] == 0 for u in usage.values())
    assert sum(u["answered"] for u in usage.values()) == len(answered) > 0 and set(answered) == {"200"}
    assert usage["distill"]["answered"] == 8 and usage["rewrite"]["answered"] >= 8
    sources = manifest["text_sources"]["sft"]
    assert sum(sources["answer_source"].values()) == 4 and sum(sources["question_source"].values()) == 4
    assert manifest["counts"]["eval_ood"] == 2
    c, runs = runs_of(tmp_path / "s1")
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    kids = children(runs, parent.info.run_id)
    assert set(kids) == {"curate-instances", "rewrite", "distill", "curate"}
    assert kids["distill"].data.metrics["llm_distill_answered"] == 8
    assert kids["curate"].data.metrics["llm_rewrite_answered"] == usage["rewrite"]["answered"]

    seen = len(answered)
    second = curate(tmp_path / "s2", url, tmp_path / "cache")  # a fresh state: every stage runs, from the cache
    assert second.returncode == 0, second.stderr[-6000:]
    assert len(answered) == seen  # not one request reached the server
    again = json.loads((Path(second.stdout.strip().splitlines()[-1]) / "manifest.json").read_text())
    assert again["content_hash"] == manifest["content_hash"]
    assert again["llm"]["distill"]["usage"]["cache_hits"] == usage["distill"]["calls"]
