"""Layout validation and the planner (no hardware): the reference V4 layouts fit 64 GB 910C devices."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.trainer.helpers import TINY
from trainer.models.deepseek_v4.args import ModelArgs
from trainer.models.deepseek_v4.parallelize import stage_ids, stage_layers
from trainer.parallel.dims import LayoutError, ParallelDims, bubble_fraction
from trainer.engines.plan import param_classes, plan_layout
from trex.cli import app
from trex.core.config import ParallelConfig, load_config


def test_world_and_divisibility_errors_name_the_keys():
    with pytest.raises(LayoutError, match=r"world size 6"):
        ParallelDims.from_config(ParallelConfig(pp=2, tp=2, dp_shard=2), 6)
    with pytest.raises(LayoutError, match=r"parallel.ep=4 must divide parallel.dp_shard=2"):
        ParallelDims.from_config(ParallelConfig(ep=4), 2)
    with pytest.raises(LayoutError, match=r"not divisible by pp\*dp_replicate\*tp"):
        ParallelDims.from_config(ParallelConfig(tp=4), 6)
    dims = ParallelDims(tp=8)
    with pytest.raises(LayoutError, match=r"model.num_heads=4 not divisible by parallel.tp=8"):
        dims.check_model(ModelArgs(**TINY), 8, 1)
    with pytest.raises(LayoutError, match=r"model.n_routed_experts=4 not divisible by parallel.ep=8"):
        ParallelDims(dp_shard=8, ep=8).check_model(ModelArgs(**TINY), 8, 1)
    with pytest.raises(LayoutError, match=r"train.batch_size=6 not divisible"):
        ParallelDims(dp_shard=4).check_model(ModelArgs(**TINY), 6, 1)
    with pytest.raises(LayoutError, match=r"model.num_layers=3 < pipeline stages"):
        ParallelDims(pp=2, vpp=2).check_model(ModelArgs(**TINY), 8, 4)


def test_stage_split_and_v_placement():
    assert [list(r) for r in stage_layers(5, 2, None)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in stage_layers(5, 2, [1, 4])] == [[0], [1, 2, 3, 4]]
    with pytest.raises(LayoutError, match="pp_layers"):
        stage_layers(5, 2, [2, 2])
    dims = ParallelDims(pp=2, vpp=2, dp_shard=1)
    assert stage_ids(dims, 0, "interleaved_1f1b") == [0, 2] and stage_ids(dims, 1, "zbv") == [1, 2]
    with pytest.raises(LayoutError, match="vpp=2"):
        stage_ids(ParallelDims(pp=2), 0, "dualpipev")


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(4, 12, vpp=2) == pytest.approx(3 / 27)
    assert bubble_fraction(4, 12, schedule="zbv") < bubble_fraction(4, 12)


def test_param_classes_cover_every_parameter():
    from trainer.export import build_model

    cfg = ModelArgs(**{**TINY, "mtp_layers": 1})
    c = param_classes(cfg, 97)
    n = sum(b[k] for b in c["layers"] + [c["mtp"]] for k in ("expert", "tp", "rep"))
    n += c["embed"] + c["lm_head"] + c["head"]
    model = build_model(cfg, 97, 0)
    assert n == sum(p.numel() for p in model.parameters())
    assert sum(b["expert"] for b in c["layers"]) == cfg.num_layers * 3 * cfg.n_routed_experts * \
        cfg.hidden_size * cfg.moe_intermediate_size


@pytest.mark.parametrize("name,nodes", [("flash", 8), ("pro", 32)])
def test_reference_layouts_fit_910c(name, nodes):
    cfg = load_config(f"configs/deepseek_v4_{name}.yaml", [])
    dims = ParallelDims.from_config(cfg.parallel, nodes * 16)
    tc = cfg.train.cpt
    p = plan_layout(cfg.model, 129280, dims, tc.seq_len, tc.batch_size, "910c", cfg.parallel.pp_schedule,
                    cfg.parallel.pp_microbatches, None, tc.optimizer, tc.activation_checkpointing,
                    sequence_parallel=cfg.parallel.sequence_parallel)
    assert p.feasible, p.reasons
    assert p.worst.total_gib <= 64 and p.worst.params > 1e9
    adamw = plan_layout(cfg.model, 129280, dims, tc.seq_len, tc.batch_size, "910c", cfg.parallel.pp_schedule,
                        0, None, "adamw", "none")
    assert not adamw.feasible and "activations" in adamw.reasons[0]


def test_cli_plan_explains_an_infeasible_layout():
    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "--config", "configs/deepseek_v4_flash.yaml", "--nodes", "8",
                             "--devices-per-node", "16", "--device", "910c"])
    assert ok.exit_code == 0 and "feasible" in ok.output
    # V4-Pro squeezed onto V4-Flash's 128 devices and layout: the expert weights alone overflow
    bad = runner.invoke(app, ["plan", "--config", "configs/deepseek_v4_pro.yaml", "--nodes", "8",
                              "--devices-per-node", "16", "--set", "parallel.vpp=1", "--set", "parallel.tp=1",
                              "--set", "parallel.pp=4", "--set", "parallel.pp_schedule=1f1b"])
    assert bad.exit_code == 1
    assert "infeasible" in bad.output and "weights+grads" in bad.output and "raise ep" in bad.output
    wrong = runner.invoke(app, ["plan", "--config", "configs/deepseek_v4_flash.yaml", "--nodes", "3"])
    assert wrong.exit_code == 1 and "layout error" in wrong.output


@pytest.mark.parametrize("device,devices", [("h100", 8), ("910c", 16)])
def test_lora_on_one_node_fits_v4_flash(device, devices):
    """QLoRA over every expert of V4-Flash on one node: 8 x H100-80GB and 16 x 910C-64GB both fit."""
    res = CliRunner().invoke(app, ["plan", "--config", "configs/deepseek_v4_flash.yaml", "--lora", "--device", device,
                                   "--devices-per-node", str(devices)])
    assert res.exit_code == 0, res.output
    assert "feasible" in res.output and "routed experts / ep" in res.output


def test_lora_plan_counts_the_quantised_base_and_every_expert_adapter():
    from trainer.engines.plan import plan_lora
    from trex.core.config import DEFAULT_LORA_TARGETS, load_config

    cfg = load_config("configs/deepseek_v4_flash.yaml")
    q = plan_lora(cfg.model, 129280, 8, 4096, 8, list(DEFAULT_LORA_TARGETS), "h100")
    dense = plan_lora(cfg.model, 129280, 8, 4096, 8, list(DEFAULT_LORA_TARGETS), "h100", quantised=False)
    assert 140 < q.quantised_file_gib < 170  # the published checkpoint is ~160 GB
    assert dense.base_experts_gib / q.base_experts_gib > 7  # 4 bytes against 0.53 a weight
    assert not dense.feasible  # a float32 base does not fit one node
    m = cfg.model
    experts = m.n_routed_experts * 8 * (m.hidden_size + m.moe_intermediate_size) * 3 * (m.num_layers) / 8
    assert q.adapter_params > experts  # every layer's every expert, split over ep, plus the attention adapters
    no_experts = plan_lora(cfg.model, 129280, 8, 4096, 8, ["attn.wq_a"], "h100")
    assert no_experts.adapter_params < q.adapter_params - experts * 0.99
