import pytest
from typer.testing import CliRunner

from trex.cli import app
from trex.core.config import ConfigError, load_config

ROOT_CONFIGS = ["configs/tiny.yaml", "configs/micro.yaml"]


@pytest.mark.parametrize("path", ROOT_CONFIGS)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.train.cpt.steps >= 1 and cfg.source == path


def test_override_sets_nested_value_with_yaml_typing():
    cfg = load_config("configs/tiny.yaml", ["train.cpt.steps=7", "data.families=[knapsack]", "eval.temperature=0.6"])
    assert cfg.train.cpt.steps == 7 and cfg.data.families == ["knapsack"] and cfg.eval.temperature == 0.6


def test_unknown_key_names_key_file_and_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  cpt:\n    stpes: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "train.cpt.stpes" in msg and f"{f}:3" in msg and "unknown key" in msg


def test_wrong_type_names_key_and_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  hidden_size: lots\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "model.hidden_size" in str(e.value) and str(f) in str(e.value) and "lots" in str(e.value)


def test_unknown_override_key_is_named():
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", ["data.nonsense=1"])
    assert "--set data.nonsense" in str(e.value) and "configs/tiny.yaml" in str(e.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config("nope.yaml")


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_config(None, ["model.num_experts_per_tok=9"])


@pytest.mark.parametrize("args, needle", [
    (["config", "--set", "train.sft.bogus=1"], "train.sft.bogus"),
    (["config", "--set", "eval.batch_size=many"], "eval.batch_size"),
    (["config", "--config", "missing.yaml"], "missing.yaml"),
    (["lifecycle", "--set", "tokenizer.vocab=5"], "tokenizer.vocab"),
])
def test_cli_config_errors_exit_2(args, needle):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert needle in res.output


def test_cli_config_prints_resolved_yaml():
    res = CliRunner().invoke(app, ["config", "--set", "train.cpt.steps=11"])
    assert res.exit_code == 0 and "steps: 11" in res.output


def test_curate_rejects_unknown_subset():
    res = CliRunner().invoke(app, ["curate", "everything"])
    assert res.exit_code == 2 and "all, sft or cpt" in res.output


def test_llm_section_errors_name_the_key_and_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  llm:\n    distil: {enabled: true}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "data.llm.distil" in str(e.value) and f"{f}:3" in str(e.value) and "unknown key" in str(e.value)
    f.write_text("data:\n  llm:\n    distill: {enabled: true}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: key 'data.llm'.*llm.distill.enabled needs llm.endpoints"):
        load_config(f)
    cfg = load_config(None, ["data.llm.endpoints=[{base_url: 'http://h:1/v1', model: m}]", "data.llm.rewrite.enabled=true"])
    assert cfg.data.llm.active and cfg.data.llm.endpoints[0].label == "m@h:1"
    assert not load_config(None).data.llm.active  # the default stays LLM-free


def test_stage_views_leave_out_what_a_stage_does_not_use():
    cfg = load_config(None, ["data.llm.endpoints=[{base_url: 'http://h:1/v1', model: m}]",
                             "data.llm.rewrite.enabled=true", "data.llm.distill.enabled=true", "data.llm.distill.k=7"])
    data = cfg.data
    assert data.stage_view("build").llm == type(data.llm)() and data.stage_view("build").seed == data.seed
    assert data.stage_view("rewrite").llm.distill.k == 4 and data.stage_view("rewrite").llm.rewrite.enabled
    assert data.stage_view("distill").llm.distill.k == 7 and not data.stage_view("distill").llm.rewrite.enabled


@pytest.mark.parametrize("sets, needle", [
    (["data.ood.problems=4"], "needs ood.families"),
    (["data.ood.problems=4", "data.ood.families=[knapsack]"], "also training families"),
    (["data.ood.problems=4", "data.ood.families=[diet]", "data.ood.representations=[DP]"], "withhold at least one"),
    (["data.ood.withhold=[DP/everything]"], "data.ood.withhold.0.*should match pattern"),
    (["data.ood.withhold=[DP/code_only]"], "leaves representation DP no answer style"),
])
def test_ood_split_is_validated(sets, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, sets)


def test_ood_withheld_combination_may_be_a_trained_representation():
    cfg = load_config(None, ["data.representations=[DP, DT]", "data.answer_styles=[code_only, math_model]",
                             "data.ood.withhold=[DT/code_only]", "data.ood.problems=4", "data.ood.families=[diet]",
                             "data.ood.representations=[DT]"])
    assert cfg.data.styles_for("DT") == ["math_model"] and cfg.data.styles_for("DP") == ["code_only", "math_model"]


@pytest.mark.parametrize("path", ["configs/or_data_llm.yaml", "configs/llm_smoke.yaml"])
def test_llm_example_configs_load(path):
    data = load_config(path).data
    assert data.llm.active and data.llm.endpoints
