"""The DeepSpeed baseline engine on CPU/gloo: 2 processes, ZeRO-1 and ZeRO-3, resume, the HF export
(loads in transformers), and loss agreement with the native engine from the same weights and data.

Tolerances (docs/baseline.md):
- a model without discrete choices in training (hash-routed MoE, sliding + HCA attention): both engines
  compute the same function with the same fp32 math in a different order, so every one of 20 steps agrees to
  rounding; measured <= 2e-7 relative, asserted 1e-5;
- the full tiny V4 (learned top-k routing with the expert-bias update, CSA with its top-k indexer): a token
  whose top-k scores tie within rounding picks a different expert or compressed entry in the two
  implementations, a jump of ~1e-5 that later steps carry along; measured <= 2e-4 relative after 20 steps,
  asserted 2e-3 (still 20x smaller than the loss decrease in those steps).
Rows are unpacked (one document per row, padded, labels -100 on padding and prompts): transformers' model
has no document mask, and its compressors pool across the row, so packed rows would differ by design.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import TINY, random_docs
from trainer.data import save_packed
from trainer.engines.deepspeed import ds_config, hf_from_native, unpacked
from trainer.engines.single import train
from trainer.export import build_model, load_export
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.optim import no_decay
from trainer.torchrun import EngineError, JobSpec, launch
from trex.core.config import StageTrainConfig

VOCAB = 97
SMOOTH = {**TINY, "indexer_loss_weight": 0.0, "mlp_layer_types": ["hash_moe"] * 3,
          "layer_types": ["sliding_attention", "heavily_compressed_attention", "sliding_attention"]}
ROUTED = {**TINY, "indexer_loss_weight": 0.0}  # the HF model has no indexer loss
TRAIN = dict(steps=20, batch_size=4, seq_len=24, lr=3e-3, warmup_steps=2, log_every=1, ckpt_every=5, keep_last=2)


def test_ds_config_splits_the_global_batch():
    c = ds_config(StageTrainConfig(batch_size=8, grad_accum=2, zero_stage=3, offload=True, dtype="bf16"), 2)
    assert c["train_batch_size"] == 8 and c["train_micro_batch_size_per_gpu"] == 2
    assert c["gradient_accumulation_steps"] == 2 and c["bf16"]["enabled"]
    assert c["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert c["zero_optimization"]["offload_param"]["device"] == "cpu"
    with pytest.raises(ValueError, match="divisible"):
        ds_config(StageTrainConfig(batch_size=6), 4)


def test_no_decay_groups_match_the_native_ones():
    cfg = ModelArgs(**TINY)
    native = build_model(cfg, VOCAB, 0)
    hf = hf_from_native(native, cfg)

    def split(model, rule):
        out = [0, 0]
        for n, p in model.named_parameters():
            out[rule(n, p)] += p.numel()
        return out

    assert split(native, no_decay) == split(hf, no_decay)


def test_unpacked_rows_hold_one_document_each():
    docs = random_docs(6, VOCAB)
    d = unpacked(docs, 24, pad_id=0)
    assert len(d) == 6 and int(d.doc_ids.max()) == 0
    assert all(int((d.doc_ids[i] >= 0).sum()) == min(24, len(docs[i][0])) for i in range(6))


def _native_losses(model_cfg: dict, data, tmp_path, **train_kw) -> tuple[list[float], torch.nn.Module]:
    model = build_model(ModelArgs(**model_cfg), VOCAB, 0)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank; tiny matmuls gain nothing from threads, and on a loaded machine
    try:                      # spinning OpenMP workers make a 2-thread run ~50x slower
        train(model, data, StageTrainConfig(**{**TRAIN, **train_kw}), tmp_path / "native", 0,
              on_log=lambda s, m: losses.append(m["loss"]))
    finally:
        torch.set_num_threads(threads)
    return losses, model


def _ds(model_cfg: dict, data_path, tmp_path, name: str, zero: int, export: bool = False, train_kw: dict | None = None,
        **extra) -> tuple[dict, list]:
    spec = {"model": model_cfg, "vocab_size": VOCAB, "seed": 0, "data": str(data_path), "threads": 1,
            "train": {**TRAIN, **(train_kw or {}), "engine": "deepspeed", "zero_stage": zero, "nproc": 2},
            "ckpt_dir": str(tmp_path / f"ckpt_{name}"), **extra}
    if export:
        spec["export_dir"] = str(tmp_path / f"export_{name}")
    losses = []
    result = launch(JobSpec(**spec), tmp_path / f"work_{name}", 2, on_metrics=lambda s, m: losses.append((s, m)),
                    on_line=None)
    return result, losses


def _assert_loads_in_transformers(export_dir: str) -> None:
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(export_dir).eval()
    native = load_export(export_dir)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = native(ids), hf(input_ids=ids).logits
    assert torch.isfinite(b).all() and ((a - b).abs().max() / b.abs().max()).item() <= 1e-4
    assert json.loads((Path(export_dir) / "config.json").read_text())["model_type"] == "deepseek_v4"


@pytest.mark.slow
def test_zero1_two_processes_routed_model_agrees_with_native_and_export_loads(tmp_path):
    """The full tiny V4 (top-k routing + expert-bias updates, CSA indexer): agreement up to routing flips."""
    data = unpacked(random_docs(48, VOCAB, seed=3), 24, pad_id=0)
    path = save_packed(data, tmp_path / "rows.pt")
    native, _ = _native_losses(ROUTED, data, tmp_path)
    result, logged = _ds(ROUTED, path, tmp_path, "z1", zero=1, export=True)
    ds = [m["loss"] for _, m in logged]
    assert [s for s, _ in logged] == list(range(1, 21)) and result["world"] == 2
    assert all(k in logged[0][1] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "moe1_max_over_mean"))
    assert abs(native[0] - ds[0]) <= 1e-5 * native[0]  # step 1: same weights, same rows
    for a, b in zip(native, ds, strict=True):
        assert abs(a - b) <= 2e-3 * a, (native, ds)
    assert ds[-1] < ds[0] - 0.1
    _assert_loads_in_transformers(result["export_dir"])


@pytest.mark.slow
def test_zero3_resumes_and_matches_native_to_rounding(tmp_path):
    """No discrete choices in training: ZeRO-3 with gradient accumulation (2 ranks x 2 micro-batches of 1 row),
    killed after step 10 and resumed, is the native trajectory -- with a WSD decay that a loss threshold every
    loss is under starts after step 8 (the window full), so that the run ends at step 14 and the resumed job
    must carry the trigger over."""
    data = unpacked(random_docs(48, VOCAB, seed=3), 24, pad_id=0)
    path = save_packed(data, tmp_path / "rows.pt")
    kw = {"grad_accum": 2, "schedule": "wsd", "decay_steps": 6, "decay_trigger_loss": 1e3, "decay_trigger_window": 8}
    native, native_model = _native_losses(SMOOTH, data, tmp_path, **kw)
    first, logged1 = _ds(SMOOTH, path, tmp_path, "z3", zero=3, train_kw=kw, stop_after=10)
    assert first["steps"] == 10 and first["resumed_from"] is None and first["export_dir"] is None
    second, logged2 = _ds(SMOOTH, path, tmp_path, "z3", zero=3, export=True, train_kw=kw)
    assert second["resumed_from"] == 10 and [s for s, _ in logged2] == list(range(11, 15))
    assert second["decay_triggered_at"] == 8 and second["finished"]
    ds = [m["loss"] for _, m in logged1 + logged2]
    for a, b in zip(native, ds, strict=True):
        assert abs(a - b) <= 1e-5 * a, (native, ds)
    lrs = [m["lr"] for _, m in logged1 + logged2]  # the lr of the next step: peak until 8, then the decay
    assert lrs[7] == pytest.approx(3e-3) and lrs[8] == pytest.approx(3e-3 * (1 - 0.9 / 6)) and lrs[-1] < 1e-3
    ckpts = sorted(p.name for p in (tmp_path / "ckpt_z3").glob("step_*"))
    assert ckpts == ["step_00000010", "step_00000014"]  # keep_last=2
    _assert_loads_in_transformers(second["export_dir"])
    # the same weights after 20 steps up to Adam's amplification of rounding: a parameter whose gradient is
    # ~0 (the mHC tables) moves by up to lr per step in a direction that rounding picks (measured 3e-4 with
    # lr 3e-3); the function agrees to rounding
    exported = load_export(second["export_dir"])
    for k, v in native_model.state_dict().items():
        assert (exported.state_dict()[k].float() - v.float()).abs().max() <= 1e-3, k
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        a, b = native_model.eval()(ids), exported(ids)
    assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-4


@pytest.mark.slow
def test_a_failing_rank_fails_the_launch(tmp_path):
    data = unpacked(random_docs(8, VOCAB), 24, pad_id=0)
    path = save_packed(data, tmp_path / "rows.pt")
    spec = {"model": SMOOTH, "vocab_size": VOCAB, "seed": 0, "data": str(path), "threads": 1,
            "train": {**TRAIN, "batch_size": 3, "engine": "deepspeed"}, "ckpt_dir": str(tmp_path / "ckpt")}
    with pytest.raises(EngineError, match="divisible"):
        launch(JobSpec(**spec), tmp_path / "work", 2, on_line=None)


@pytest.mark.slow
def test_prefect_train_task_dispatches_to_deepspeed_and_logs_rank0_metrics(tmp_path):
    """``train.engine: deepspeed`` in the train task: subprocess job, metrics in the stage's MLflow run, export."""
    import datasets
    from mlflow.tracking import MlflowClient

    from tasks.common import StageContext
    from tasks.train import train_task
    from trainer.tokenizer import train_tokenizer
    from trex.core.refs import write_manifest

    g = torch.Generator().manual_seed(0)
    words = ["min", "max", "x", "y", "subject", "to", "cost", "<=", ">=", "+", "3", "7", "12"]
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (30,), generator=g)) for _ in range(40)]
    data_dir, tok_dir = tmp_path / "data", tmp_path / "tok"
    datasets.Dataset.from_list([{"text": t} for t in texts]).save_to_disk(str(data_dir / "cpt"))
    data_ref = write_manifest(data_dir, "data", {})
    train_tokenizer(iter(texts), tok_dir, 300, 1)
    tok_ref = write_manifest(tok_dir, "tokenizer", {})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ctx = StageContext(output_dir=str(tmp_path / "out"), tracking={"enabled": True, "uri": uri, "experiment": "t"})
    train = StageTrainConfig(steps=3, batch_size=4, seq_len=32, warmup_steps=1, log_every=1, ckpt_every=2,
                             engine="deepspeed", zero_stage=2, nproc=2)
    res = train_task.fn("cpt", ModelArgs(**SMOOTH), train, 0, data_ref, tok_ref, None, ctx)
    assert res["summary"]["steps"] == 3 and res["summary"]["tokens_per_s"] > 0
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(res["mlflow_run_id"], "loss")
    assert sorted(m.step for m in history) == [1, 2, 3]
    run = client.get_run(res["mlflow_run_id"])
    assert run.data.metrics["world"] == 2 and run.data.metrics["mfu"] > 0
    export_dir = Path(res["ref"]["path"]) / "export"
    assert json.loads((export_dir / "config.json").read_text())["trex_engine"] == "deepspeed"
    assert (export_dir / "tokenizer.json").is_file()
    from transformers import DeepseekV4ForCausalLM

    DeepseekV4ForCausalLM.from_pretrained(export_dir)


def test_the_rank_skips_the_inference_only_shm_op_build():
    """DeepSpeed's CPU process group would JIT-compile ``deepspeed_shm_comm`` (~90 s of C++ per machine) for an
    all-reduce only inference uses: the rank marks it incompatible first, so DeepSpeed does not build it."""
    import subprocess
    import sys

    code = ("import importlib, deepspeed.ops\n"
            "t = importlib.import_module('deepspeed.comm.torch')\n"
            "before = deepspeed.ops.__compatible_ops__['deepspeed_shm_comm']\n"
            "from trainer.engines.deepspeed_rank import skip_inference_shm_op\n"
            "skip_inference_shm_op()\n"
            "print(before, t.build_shm_op())\n")
    env = {**__import__("os").environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["True", "None"], out.stdout  # it would have been built here


@pytest.mark.slow
def test_compile_compiles_the_baseline_model_too(tmp_path):
    """``train.<stage>.compile`` is not dropped by the baseline: DeepSpeed compiles transformers' model (so that a
    comparison with the compiled native engine compiles both sides), and it trains as the eager one does.
    The full tiny V4 (with the CSA indexer, which transformers never trains and the compiled baseline freezes), the
    export included."""
    data = unpacked(random_docs(16, VOCAB, seed=3), 24, pad_id=0)
    path = save_packed(data, tmp_path / "rows.pt")
    kw = {"steps": 4, "ckpt_every": 100}
    plain, eager = _ds(ROUTED, path, tmp_path, "eager", zero=2, train_kw=kw)
    result, compiled = _ds(ROUTED, path, tmp_path, "compiled", zero=2, train_kw={**kw, "compile": True}, export=True)
    assert result["compiled"] is True and plain["compiled"] is False
    for (_, a), (_, b) in zip(eager, compiled, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"], (eager, compiled)
    _assert_loads_in_transformers(result["export_dir"])
