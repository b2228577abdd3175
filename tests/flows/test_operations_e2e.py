"""Operations end to end with real servers: Prefect server + MLflow server on localhost, ``prefect deploy
--all``, a process worker, the ``lifecycle`` deployment on the micro config, then a curate deployment run on
new data whose ``trex.dataset.updated`` event triggers ``retrain``, which promotes or rejects with a reason.
A headless Chromium (Debian's package, driven by Playwright) then checks the UIs and saves screenshots.

The flows find the servers the way users' runs do: through ``<state>/ui.json`` (``trex ui``), here written
by the fixture for its own ports.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.flows.test_lifecycle_e2e import ROOT
from tests.trex.tracking.mlflow_server import MlflowServer, reserve_port, wait_healthy
from trex.tracking.store import seed_prefect_db

PREFECT = str(Path(sys.executable).with_name("prefect"))
SHOTS = ROOT / "tests" / "artifacts" / "screenshots"


def _flow_runs(env: dict, deployment: str) -> list[dict]:
    """The deployment's flow runs, from the server's REST API (``POST /flow_runs/filter``): an HTTP call, where a
    Prefect client in a subprocess spent ~2 s of CPU importing Prefect on every poll."""
    r = httpx.post(env["PREFECT_API_URL"] + "/flow_runs/filter", timeout=60,
                   json={"deployments": {"name": {"any_": [deployment]}}})
    r.raise_for_status()
    return [{"id": f["id"], "state": (f.get("state") or {}).get("type"), "name": (f.get("state") or {}).get("name"),
             "params": f["parameters"]} for f in r.json()]


def _wait_final(env: dict, deployment: str, count: int, seconds: float, keep=lambda r: True) -> list[dict]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        runs = [r for r in _flow_runs(env, deployment) if keep(r)]
        if len(runs) >= count and all(r["state"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for r in runs):
            return runs
        time.sleep(1)  # the poll interval (Prefect has no push to wait on here), not a synchronisation
    raise AssertionError(f"{deployment}: no {count} finished runs in {seconds:.0f} s: {_flow_runs(env, deployment)}")


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    root = tmp_path_factory.mktemp("ops")
    state = root / "state"
    state.mkdir()
    mlflow = MlflowServer(state).start()  # serves the state dir's database, as `trex ui` does
    port_hold = reserve_port()  # Prefect's port: the OS picks it, held until the server is gone
    port = port_hold.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "TREX_"))}
    env |= {"PREFECT_HOME": str(root / "prefect"), "PREFECT_API_URL": api, "TREX_HOME": str(ROOT),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_CLI_PROMPT": "false", "OMP_NUM_THREADS": "2"}
    procs = []
    seed_prefect_db(root / "prefect")  # as `trex ui` does: a copy of a migrated database where there is one
    log = open(root / "prefect-server.log", "ab")
    procs.append(subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        if not wait_healthy(api + "/health", procs[0], 180):
            raise RuntimeError(f"prefect server did not come up: {(root / 'prefect-server.log').read_text()[-3000:]}")
        (state / "ui.json").write_text(json.dumps({"prefect_api": api, "prefect_ui": api[:-4], "mlflow": mlflow.url}))

        def cli(*args, timeout=300):
            r = subprocess.run([PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            assert r.returncode == 0, " ".join(args) + "\n" + r.stdout[-3000:] + r.stderr[-3000:]
            return r.stdout

        cli("work-pool", "create", "trex-process", "--type", "process")
        deployed = cli("--no-prompt", "deploy", "--all")
        wlog = open(root / "worker.log", "ab")
        procs.append(subprocess.Popen([PREFECT, "worker", "start", "--pool", "trex-process"], cwd=ROOT, env=env,
                                      stdout=wlog, stderr=subprocess.STDOUT, start_new_session=True))
        overrides = json.dumps({"overrides": [f"run.state_dir={state}"], "config": "configs/micro.yaml"})
        cli("deployment", "run", "lifecycle/lifecycle", "--params", overrides)
        lifecycle = _wait_final(env, "lifecycle", 1, 600)
        # new data: the curate deployment on another seed emits trex.dataset.updated -> retrain runs
        curate = json.dumps({"config": "configs/micro.yaml",
                             "overrides": [f"run.state_dir={state}", "data.seed=4242"]})
        cli("deployment", "run", "curate/curate", "--params", curate)
        curated = _wait_final(env, "curate", 1, 300)
        # (the weekly cron also schedules future runs: the event's run is the one with a data_dir)
        retrain = _wait_final(env, "retrain", 1, 900, keep=lambda r: bool(r["params"].get("data_dir")))
        yield {"state": state, "env": env, "mlflow": mlflow, "api": api, "deployed": deployed, "root": root,
               "lifecycle": lifecycle, "curate": curated, "retrain": retrain}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=5)  # a graceful stop takes < 1 s; one that hangs (seen: ~20 s) is killed
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        mlflow.close()
        port_hold.close()


@pytest.mark.slow
def test_deployments_lifecycle_and_event_triggered_retrain(ops):
    from mlflow.tracking import MlflowClient

    assert ops["lifecycle"][0]["state"] == "COMPLETED", (ops["root"] / "worker.log").read_text()[-4000:]
    assert ops["curate"][0]["state"] == "COMPLETED"
    retrain = ops["retrain"]
    assert len(retrain) == 1 and retrain[0]["state"] == "COMPLETED", (ops["root"] / "worker.log").read_text()[-4000:]
    assert retrain[0]["params"]["data_dir"]  # the event's payload became the run's parameters
    c = MlflowClient(tracking_uri=ops["mlflow"].url)  # everything went to the server
    versions = {str(v.version): v for v in c.search_model_versions("name='trex-or'")}
    assert set(versions) == {"1", "2"}
    v2 = versions["2"]
    assert v2.tags["trex.challenger"] in ("promoted", "rejected")
    champion = str(c.get_model_version_by_alias("trex-or", "champion").version)
    if v2.tags["trex.challenger"] == "promoted":
        assert champion == "2"
    else:
        assert champion == "1" and v2.tags["trex.reject_reason"]
    exp = c.get_experiment_by_name("trex")
    cmp_runs = c.search_runs([exp.experiment_id], "tags.`mlflow.runName` = 'champion-vs-challenger'")
    assert len(cmp_runs) == 1
    # a second event while nothing changed: the curate flow announces only a changed hash
    events = ops["state"] / "events" / "dataset-micro.json"
    assert json.loads(events.read_text())["data_dir"] == retrain[0]["params"]["data_dir"]


@pytest.mark.slow
def test_browser_sees_runs_charts_champion_and_flow_runs(ops):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    playwright = pytest.importorskip("playwright.sync_api")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=ops["mlflow"].url)
    exp = c.get_experiment_by_name("trex")
    parent = c.search_runs([exp.experiment_id], "tags.flow = 'lifecycle'")[0]
    cpt = c.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' "
                                             "and tags.stage = 'cpt'")[0]
    SHOTS.mkdir(parents=True, exist_ok=True)
    url = ops["mlflow"].url
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{url}/#/experiments/{exp.experiment_id}/runs")  # the training runs table
        page.get_by_text("lifecycle-micro").first.wait_for(timeout=60000)
        page.screenshot(path=str(SHOTS / "mlflow_experiment.png"))
        page.goto(f"{url}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}")
        page.get_by_text("lifecycle-micro").first.wait_for(timeout=60000)
        page.screenshot(path=str(SHOTS / "mlflow_lifecycle_run.png"))
        page.goto(f"{url}/#/experiments/{exp.experiment_id}/runs/{cpt.info.run_id}/model-metrics")
        page.get_by_placeholder("Search metric charts").fill("loss")
        page.get_by_text("loss", exact=True).first.wait_for(timeout=60000)
        page.locator(".js-plotly-plot .scatterlayer .trace").first.wait_for(timeout=60000)  # the loss line is drawn
        page.wait_for_timeout(1500)
        page.screenshot(path=str(SHOTS / "mlflow_cpt_loss_chart.png"))
        page.goto(f"{url}/#/models/trex-or")
        page.get_by_text("champion").first.wait_for(timeout=60000)
        assert page.locator('[title="champion"]').count() + page.get_by_text("@\u00a0champion").count() > 0
        page.screenshot(path=str(SHOTS / "mlflow_registered_model.png"))
        flow_run = ops["lifecycle"][0]["id"]
        page.goto(f"{ops['api'][:-4]}/runs/flow-run/{flow_run}")
        page.get_by_text("Completed").first.wait_for(timeout=60000)
        page.get_by_text("lifecycle").first.wait_for(timeout=60000)  # the flow's name once the run has loaded
        page.wait_for_timeout(2000)
        page.screenshot(path=str(SHOTS / "prefect_flow_run.png"))
        browser.close()
    assert all((SHOTS / f).stat().st_size > 10_000 for f in ("mlflow_cpt_loss_chart.png", "prefect_flow_run.png"))
