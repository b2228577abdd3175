"""CPT, SFT and RL flows: one training stage on given data/tokenizer/init directories.

The configuration: ``cfg`` (parsed by the CLI) or ``config`` + ``overrides`` (a deployment run), see
``flows/common.py: resolve_config``.
"""

from __future__ import annotations

from prefect import flow

from flows.common import FlowRecorder, resolve_config
from tasks.checkpoint import import_task
from tasks.rl import rl_task
from tasks.tokenizer import tokenizer_task
from tasks.train import train_task
from trex.core.config import TrexConfig
from trex.core.refs import read_manifest, ref_of


def _train(stage: str, cfg: TrexConfig, data_dir: str, tokenizer_dir: str | None, init_dir: str | None) -> dict:
    """``init_dir``: a T-Rex model stage directory; else ``model.init_from`` (any checkpoint, imported)."""
    data = ref_of(data_dir, "data")
    init = ref_of(init_dir, "model") if init_dir else None
    with FlowRecorder(cfg, stage) as rec:
        if init is None and cfg.model.init_from:
            init = rec.stage("import", import_task, path=cfg.model.init_from, model=cfg.model.architecture())["ref"]
        tok = ref_of(tokenizer_dir, "tokenizer") if tokenizer_dir else \
            rec.stage("tokenizer", tokenizer_task, tok=cfg.tokenizer, data_ref=data)["ref"]
        res = rec.stage(stage, train_task, stage=stage, model=cfg.model.architecture(),
                        train=getattr(cfg.train, stage),
                        seed=cfg.run.seed, data_ref=data, tok_ref=tok, init_ref=init, parallel=cfg.parallel)
        rec.metrics["final_loss"] = res["summary"]["final_loss"]
    return res["ref"]


@flow(name="cpt", log_prints=True)
def cpt_flow(data_dir: str, config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None,
             tokenizer_dir: str | None = None, init_dir: str | None = None, cfg: TrexConfig | None = None) -> dict:
    return _train("cpt", resolve_config(cfg, config, overrides), data_dir, tokenizer_dir, init_dir)


@flow(name="sft", log_prints=True)
def sft_flow(data_dir: str, init_dir: str | None = None, config: str | None = "configs/tiny.yaml",
             overrides: list[str] | None = None, tokenizer_dir: str | None = None,
             cfg: TrexConfig | None = None) -> dict:
    return _train("sft", resolve_config(cfg, config, overrides), data_dir, tokenizer_dir, init_dir)


@flow(name="rl", log_prints=True)
def rl_flow(data_dir: str, init_dir: str, config: str | None = "configs/tiny.yaml", overrides: list[str] | None = None,
            tokenizer_dir: str | None = None, cfg: TrexConfig | None = None) -> dict:
    """The RL stage (``train.rl``) on an SFT model directory (``init_dir``) and the curated data it was trained on;
    the tokenizer defaults to the one the SFT model's manifest names."""
    cfg = resolve_config(cfg, config, overrides)
    init, data = ref_of(init_dir, "model"), ref_of(data_dir, "data")
    tok = ref_of(tokenizer_dir, "tokenizer") if tokenizer_dir else read_manifest(init_dir, "model")["inputs"]["tokenizer"]
    with FlowRecorder(cfg, "rl", sandbox=("eval",)) as rec:
        res = rec.stage("rl", rl_task, rl=cfg.train.rl, eval_cfg=cfg.eval, seed=cfg.run.seed, init_ref=init,
                        data_ref=data, tok_ref=tok)
        rec.metrics["final_reward"] = res["summary"]["final_reward"] or 0.0
    return res["ref"]
