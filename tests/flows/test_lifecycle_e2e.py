"""End to end: the lifecycle flow on the micro config, through the real CLI, three times.

1st run does every stage; 2nd run (same inputs) must reuse every cached stage; 3rd run changes a
data parameter and must re-run from curation.
"""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.prefect_server import flow_env

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["curate", "tokenizer", "cpt", "sft", "evaluate-base", "evaluate-base-ood", "evaluate-sft", "evaluate-sft-ood",
          "register"]


def trex(args, state: Path, timeout=600):
    env = flow_env()
    cmd = [sys.executable, "-m", "trex.cli", *args, "--set", f"run.state_dir={state}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def runs_of(state: Path):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    exp = c.get_experiment_by_name("trex")
    runs = c.search_runs([exp.experiment_id], max_results=1000)
    return c, runs


def children(runs, parent_id):
    return {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id}


def copy_state(src: Path, dst: Path) -> Path:
    """A copy of a state dir (MLflow store, Prefect database and cache, outputs) that a test may run more on
    without changing what the other tests of the module read; new runs' artifacts go to the copy too."""
    shutil.copytree(src, dst)
    with sqlite3.connect(dst / "mlflow.db") as db:
        db.execute("UPDATE experiments SET artifact_location = replace(artifact_location, ?, ?)",
                   (src.resolve().as_uri(), dst.resolve().as_uri()))
    return dst


@pytest.fixture(scope="module")
def lifecycle_state(tmp_path_factory):
    """Two runs on the micro config; tests only read this state (a test that runs more works on a copy)."""
    state = tmp_path_factory.mktemp("state")
    first = trex(["lifecycle", "--config", "configs/micro.yaml"], state)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    second = trex(["lifecycle", "--config", "configs/micro.yaml"], state)
    assert second.returncode == 0, second.stderr[-6000:]
    return state, first, second


@pytest.mark.slow
def test_first_run_records_every_stage(lifecycle_state):
    state, first, _ = lifecycle_state
    assert "pass_at_1" in first.stderr and "T-Rex lifecycle (micro)" in first.stderr
    c, runs = runs_of(state)
    parents = sorted((r for r in runs if "mlflow.parentRunId" not in r.data.tags), key=lambda r: r.info.start_time)
    assert len(parents) == 2
    parent = parents[0]
    assert parent.data.tags["prefect.flow_run_id"] and parent.info.status == "FINISHED"
    assert parent.data.tags["sandbox_bwrap"].startswith(("system: ", "bundled: "))  # which bwrap ran the programs
    assert 0.0 <= parent.data.metrics["pass_at_1"] <= 1.0 and "pass_at_1_base" in parent.data.metrics
    m = parent.data.metrics  # both Pass@1 figures with their 95 % intervals (Wilson: 6 problems, one sample each)
    assert m["pass_at_1_ci_low"] <= m["pass_at_1"] <= m["pass_at_1_ci_high"]
    assert m["pass_at_1_base_ci_low"] <= m["pass_at_1_base"] <= m["pass_at_1_base_ci_high"]
    assert m["pass_at_1_ood_ci_low"] <= m["pass_at_1_ood"] <= m["pass_at_1_ood_ci_high"]  # 4 OOD problems
    assert m["pass_at_1_sft_ood"] == m["pass_at_1_ood"] and 0.0 <= m["pass_at_1_base_ood"] <= 1.0  # base on OOD too
    kids = children(runs, parent.info.run_id)
    assert sorted(kids) == sorted(STAGES)
    assert kids["curate"].data.metrics["count_eval"] == 6
    loss = c.get_metric_history(kids["cpt"].info.run_id, "loss")
    assert [m.step for m in loss] == [2, 4]
    for key in ("lr", "grad_norm", "tokens_per_s"):
        assert key in kids["sft"].data.metrics
    assert "pass_at_1" in kids["evaluate-sft"].data.metrics
    ci = kids["evaluate-sft"].data.metrics
    assert ci["pass_at_1_ci_low"] <= ci["pass_at_1"] <= ci["pass_at_1_ci_high"]
    # lineage in MLflow's own terms: what each run read, as dataset inputs with digests and contexts
    data_hash = kids["cpt"].data.params["data_hash"]
    inputs = {name: {(d.dataset.name, next(t.value for t in d.tags if t.key == "mlflow.data.context"))
                     for d in kids[name].inputs.dataset_inputs} for name in ("cpt", "sft", "evaluate-sft")}
    assert inputs["cpt"] == {(f"cpt@{data_hash[:12]}", "training")}
    assert inputs["sft"] == {(f"sft@{data_hash[:12]}", "training"), (f"sft_val@{data_hash[:12]}", "validation")}
    assert inputs["evaluate-sft"] == {(f"eval@{data_hash[:12]}", "evaluation")}
    sft_input = next(d.dataset for d in kids["sft"].inputs.dataset_inputs if d.dataset.name.startswith("sft@"))
    assert json.loads(sft_input.profile)["num_rows"] > 0 and sft_input.source_type == "local"
    assert json.loads(sft_input.source)["uri"].endswith("/sft") and len(sft_input.digest) == 16
    versions = c.search_model_versions("name='trex-or'")
    assert len(versions) == 1 and versions[0].run_id == kids["register"].info.run_id


@pytest.mark.slow
def test_outputs_checkpoint_export_and_report(lifecycle_state):
    state, _, _ = lifecycle_state
    out = state / "outputs"
    (sft_dir,) = list((out / "sft").iterdir())
    ck = sft_dir / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_00000004"
    assert (ck / "step_00000004" / ".metadata").is_file() and (ck / "step_00000004" / "COMPLETE").is_file()
    from trainer.export import load_export

    model = load_export(sft_dir / "export")
    assert model.vocab_size == json.loads((sft_dir / "export" / "config.json").read_text())["vocab_size"]
    assert (sft_dir / "export" / "tokenizer.json").is_file()
    reports = [json.loads(p.read_text()) for p in out.glob("eval/*/report.json")]
    ood = [r for r in reports if r["fingerprint"]["components"]["benchmark"]["name"] == "synthetic_ood"]
    assert len(reports) == 4 and len(ood) == 2  # base and SFT, each in and out of distribution
    for o in ood:
        assert o["n"] == 4 and set(o["per_family"]) == {"diet"} and set(o["per_representation"]) == {"DT"}
        assert o["pass@1_ci"]["low"] <= o["pass@1"] <= o["pass@1_ci"]["high"]
        assert sum(v["n"] for v in o["per_tier"].values()) == 4 and set(o["per_tier"]) <= {"easy", "medium", "hard"}
    for rep in (r for r in reports if r not in ood):
        assert rep["n"] == 6 and 0.0 <= rep["pass@1"] <= 1.0
        assert set(rep["per_family"]) == {"production", "knapsack", "transportation"}
        assert rep["rules"]["rel"].startswith("|p-g|/(|g|+1)") and set(rep["pass@1_by_rule"]) == {"rel", "abs", "orlm"}
        assert rep["isolation"] in ("bwrap", None)  # None when the micro model wrote no program
    sample = json.loads(next(out.glob("eval/*/samples.jsonl")).read_text().splitlines()[0])
    for key in ("id", "messages", "completion", "program", "outcome", "ground_truth", "verdicts", "exec"):
        assert key in sample
    manifest = json.loads(next((out / "data").iterdir()).joinpath("manifest.json").read_text())
    assert manifest["counts"]["eval"] == 6 and manifest["content_hash"]
    # base and SFT side by side, with intervals and the paired gain, on the flow's MLflow run too
    (cmp_dir,) = list((out / "compare").iterdir())
    table = json.loads((cmp_dir / "compare.json").read_text())
    assert table["baseline"] == "base" and table["benchmarks"] == ["synthetic", "synthetic_ood"]
    assert table["models"]["sft"]["vs_baseline"]["synthetic"]["problems"] == 6
    assert table["models"]["sft"]["vs_baseline"]["synthetic_ood"]["problems"] == 4
    assert "Paired difference to base" in (cmp_dir / "compare.md").read_text() and (cmp_dir / "compare.png").is_file()
    c, runs = runs_of(state)
    parent = min((r for r in runs if "mlflow.parentRunId" not in r.data.tags), key=lambda r: r.info.start_time)
    assert {a.path for a in c.list_artifacts(parent.info.run_id, "compare")} == {
        "compare/compare.md", "compare/compare.json", "compare/compare.png"}


@pytest.mark.slow
def test_second_run_reuses_cached_stages(lifecycle_state):
    state, _, second = lifecycle_state
    _, runs = runs_of(state)
    parent = max((r for r in runs if "mlflow.parentRunId" not in r.data.tags), key=lambda r: r.info.start_time)
    kids = children(runs, parent.info.run_id)
    cached = {n for n, r in kids.items() if r.data.tags.get("cached") == "True"}
    assert cached == {f"{s} (cached)" for s in STAGES if s != "register"}
    assert kids["register"].data.tags.get("reused") == "True"
    assert all(r.data.tags.get("source_run_id") for n, r in kids.items() if n in cached)


@pytest.mark.slow
def test_changed_data_parameter_reruns_from_curation(lifecycle_state, tmp_path):
    state = copy_state(lifecycle_state[0], tmp_path / "state")  # the other tests see two runs, in any order
    third = trex(["lifecycle", "--config", "configs/micro.yaml", "--set", "data.seed=99",
                  "--set", "eval.evaluate_base=false"], state)
    assert third.returncode == 0, third.stderr[-4000:]
    _, runs = runs_of(state)
    parent = max((r for r in runs if "mlflow.parentRunId" not in r.data.tags), key=lambda r: r.info.start_time)
    names = set(children(runs, parent.info.run_id))
    assert {"curate", "tokenizer", "cpt", "sft", "evaluate-sft", "evaluate-sft-ood", "register"} == names


def test_stage_with_missing_input_exits_2(tmp_path):
    res = trex(["evaluate", "--model", str(tmp_path / "nope"), "--data", str(tmp_path)], tmp_path / "s")
    assert res.returncode == 2
    assert f"{tmp_path / 'nope'}: input directory does not exist" in " ".join(res.stderr.split())
    (tmp_path / "data").mkdir()
    res = trex(["cpt", "--data", str(tmp_path / "data")], tmp_path / "s")
    assert res.returncode == 2 and "no manifest.json" in res.stderr
    # checked on the command line, before any flow: no Prefect server started, the message said once
    assert not (tmp_path / "s" / "prefect").exists() and res.stderr.count("no manifest.json") == 1


def test_without_a_working_sandbox_one_error_before_any_stage(tmp_path):
    """No bwrap can create its namespaces (a stand-in that fails as a restricted kernel makes it fail): the lifecycle
    exits 2 with one message naming the cause and the fix, and no stage ran (no output, no MLflow run)."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    state = tmp_path / "state"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))},
           "TREX_BWRAP": str(fake)}
    res = subprocess.run([sys.executable, "-m", "trex", "lifecycle", "--config", "configs/micro.yaml",
                          "--set", f"run.state_dir={state}"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    err = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stderr[-3000:]
    assert "sandbox unavailable" in err and "setting up uid map: Permission denied" in err and "Likely cause" in err
    assert err.count("sandbox unavailable") == 1 and "Traceback" not in err  # checked before Prefect starts
    assert not (state / "outputs").exists() or not any((state / "outputs").iterdir())


def test_python_dash_m_trex_uses_the_configured_state_dir(tmp_path):
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "TREX_"))}
    res = subprocess.run([sys.executable, "-m", "trex", "curate", "--config", "configs/micro.yaml",
                          "--set", f"run.state_dir={state}", "--set", "data.sft.samples=6"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    data_dir = Path(res.stdout.strip().splitlines()[-1])
    assert data_dir.parent.parent == state / "outputs" and (data_dir / "manifest.json").is_file()
    assert (state / "prefect").is_dir() and (state / "mlflow.db").is_file()


ARTIFACT_QUERY = """
import asyncio
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
async def main():
    async with get_client() as c:
        arts = await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["trex-lifecycle-summary"])))
        print(len(arts))
        print(arts[0].data)
asyncio.run(main())
"""


@pytest.mark.slow
def test_flow_publishes_markdown_summary_artifact(lifecycle_state):
    state, _, _ = lifecycle_state
    env = flow_env()
    if "PREFECT_API_URL" not in env:  # no shared server: the lifecycle's own ephemeral one, on its database
        env.update(PREFECT_HOME=str(state / "prefect"), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
                   PREFECT_SERVER_EPHEMERAL_ENABLED="true")
    res = subprocess.run([sys.executable, "-c", ARTIFACT_QUERY], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    count, _, body = res.stdout.partition("\n")
    assert int(count) >= 2
    assert "| stage | time (s) | key metric | cached | output |" in body and "| curate |" in body


def _registry(state):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    return c, {int(v.version): v for v in c.search_model_versions("name='trex-or'")}


def _last_json(out: str) -> dict:
    return json.loads([x for x in out.splitlines() if x.startswith("{")][-1])


@pytest.mark.slow
def test_first_lifecycle_is_champion_then_retrain_promotes_or_rejects_with_reason(lifecycle_state, tmp_path):
    """Champion / challenger retraining (``trex retrain``) after the module's lifecycle runs, on a copy of them."""
    state = copy_state(lifecycle_state[0], tmp_path / "state")
    c, versions = _registry(state)
    champ = c.get_model_version_by_alias("trex-or", "champion")
    assert str(champ.version) == "1" and champ.tags["trex.champion_reason"] == "first registered model"
    assert champ.tags["trex.data_hash"] and json.loads(champ.tags["trex.scores"])["synthetic"] >= 0

    # new data (another seed), no margin: promoted iff no benchmark regressed by more than the tolerance
    r = trex(["retrain", "--config", "configs/micro.yaml", "--data-seed", "77", "--set", "retrain.margin=0"], state)
    assert r.returncode == 0, r.stderr[-4000:]
    res = _last_json(r.stdout)
    assert res["decision"] in ("promoted", "rejected") and res["challenger_version"] == "2"
    c, versions = _registry(state)
    alias_now = str(c.get_model_version_by_alias("trex-or", "champion").version)
    if res["decision"] == "promoted":
        assert alias_now == "2" and versions[2].tags["trex.challenger"] == "promoted"
        assert versions[1].tags["trex.replaced_by"] == "2"
    else:
        assert alias_now == "1" and versions[2].tags["trex.reject_reason"] == res["reason"]
    exp = c.get_experiment_by_name("trex")
    cmp_runs = c.search_runs([exp.experiment_id], "tags.`mlflow.runName` = 'champion-vs-challenger'")
    assert len(cmp_runs) == 1 and "champion_pass_at_1_synthetic" in cmp_runs[0].data.metrics
    # both sides on the out-of-distribution split too: the decision's guard (retrain.ood), shown beside the mean
    assert {"champion_pass_at_1_synthetic_ood", "challenger_pass_at_1_synthetic_ood"} <= set(cmp_runs[0].data.metrics)
    assert "synthetic" in json.loads(versions[2].tags["trex.scores"]) and "synthetic_ood" in json.loads(
        versions[2].tags["trex.scores"])

    # an impossible margin: rejected, with the reason on the version; the alias does not move
    before = str(c.get_model_version_by_alias("trex-or", "champion").version)
    r = trex(["retrain", "--config", "configs/micro.yaml", "--data-seed", "78", "--set", "retrain.margin=1.0"], state)
    assert r.returncode == 0, r.stderr[-4000:]
    res = _last_json(r.stdout)
    assert res["decision"] == "rejected" and "< margin 1.0000" in res["reason"]
    c, versions = _registry(state)
    assert str(c.get_model_version_by_alias("trex-or", "champion").version) == before
    assert versions[3].tags["trex.challenger"] == "rejected" and "margin" in versions[3].tags["trex.reject_reason"]

    # the champion's own data again: nothing to retrain
    data_dir = c.get_model_version_by_alias("trex-or", "champion").tags["trex.data_dir"]
    r = trex(["retrain", "--config", "configs/micro.yaml", "--data-dir", data_dir], state)
    assert r.returncode == 0, r.stderr[-4000:]
    assert _last_json(r.stdout)["decision"] == "unchanged-data"


RL = ["--set", "train.rl.enabled=true", "--set", "train.rl.steps=2", "--set", "train.rl.group_size=2",
      "--set", "train.rl.prompts_per_rollout=2", "--set", "train.rl.max_new_tokens=24", "--set", "train.rl.batch_size=4",
      "--set", "train.rl.ckpt_every=1"]


@pytest.mark.slow
def test_rl_stage_after_sft_is_evaluated_compared_and_registered_by_the_paired_rule(lifecycle_state, tmp_path):
    """On the first runs' state (curation to SFT cached): RL trains on rollouts, is evaluated on both held-out splits
    beside SFT, compared paired with it, and registered only by train.rl.promote; pass_at_1 is the registered
    model's."""
    state = copy_state(lifecycle_state[0], tmp_path / "state")
    res = trex(["lifecycle", "--config", "configs/micro.yaml", *RL], state)
    assert res.returncode == 0, res.stderr[-4000:]
    c, runs = runs_of(state)
    parent = max((r for r in runs if "mlflow.parentRunId" not in r.data.tags), key=lambda r: r.info.start_time)
    kids = children(runs, parent.info.run_id)
    assert {"rl", "evaluate-rl", "evaluate-rl-ood"} <= set(kids) and "sft (cached)" in kids
    m = parent.data.metrics
    assert {"pass_at_1_sft", "pass_at_1_rl", "pass_at_1_rl_ood", "pass_at_1_sft_ood", "rl_promoted"} <= set(m)
    promoted = bool(m["rl_promoted"])
    assert m["pass_at_1"] == (m["pass_at_1_rl"] if promoted else m["pass_at_1_sft"])
    why = parent.data.tags["compare_rl_promotion"]
    assert "rl - sft on synthetic" in why and ("not significantly worse" in why) == promoted
    rl = kids["rl"]
    history = c.get_metric_history(rl.info.run_id, "reward_mean")
    assert [h.step for h in history] == [1, 2]
    for key in ("pass_rate", "dropped_groups", "entropy", "rollout_tokens_per_s", "update_tokens_per_s",
                "response_length_mean", "moe1_entropy"):
        assert key in rl.data.metrics, key
    assert {a.path for a in c.list_artifacts(rl.info.run_id, "plots")} == {"plots/reward_rl.png"}
    assert {a.path for a in c.list_artifacts(parent.info.run_id, "compare_rl")} == {
        "compare_rl/compare.md", "compare_rl/compare.json", "compare_rl/compare.png"}
    (rl_dir,) = list((state / "outputs" / "rl").iterdir())
    assert (rl_dir / "export" / "config.json").is_file() and (rl_dir / "checkpoints" / "step_00000002" / "source.pt").is_file()
    versions = c.search_model_versions("name='trex-or'")
    latest = max(versions, key=lambda v: int(v.version))
    assert latest.run_id == kids["register"].info.run_id
