"""LoRA on a frozen base from a published-layout checkpoint (FP8 + E8M0, MXFP4 experts): only the adapters train
and the loss falls; the base checkpoint's files stay bit-identical; every routed expert of every layer gets its
own adapter, which changes its weights; the PEFT-layout adapter applied to the base (``trex score --adapter``)
scores as the merged export does, and as transformers does on the merged export."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from tests.trainer.helpers import HUB_SMALL, random_docs, tiny_model, tiny_train_cfg
from trainer.data import pack
from trainer.entry import ADAPTER_DIR, train_stage
from trainer.export import load_export
from trainer.hub.fixture import write_hub_checkpoint
from trainer.lora import LoRAError, adapter_config, apply_lora, load_adapter, merged_state
from trainer.models.deepseek_v4.args import ModelArgs
from trex.cli.main import app
from trex.core.config import DEFAULT_LORA_TARGETS, LORA_TARGETS, LoRAConfig

SMALL = HUB_SMALL
TEXT = "maximise 3 x + 4 y subject to x + y <= 12 and x, y >= 0"


def _digest(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir()) if f.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from trainer.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("lora")
    tok = root / "tok"
    train_tokenizer(iter([TEXT] * 10), tok, 300, 1)
    hub = write_hub_checkpoint(root / "hub", "flash", config=SMALL, seed=5, tokenizer_dir=tok)
    before = _digest(hub)
    vocab = json.loads((hub / "config.json").read_text())["vocab_size"]
    data = pack(random_docs(n=48, vocab=vocab, seed=1), 32, 0)
    lora = LoRAConfig(rank=4, alpha=8, targets=list(LORA_TARGETS), lr=2e-2)
    cfg = tiny_train_cfg(steps=12, batch_size=8, log_every=1, ckpt_every=6, warmup_steps=1, lora=lora)
    losses: dict[int, float] = {}
    res = train_stage("sft", ModelArgs(), cfg, None, 3, data, root / "run", str(tok), vocab, init_dir=str(hub),
                      on_log=lambda s, m: losses.__setitem__(s, m["loss"]))
    return root, hub, before, losses, res


def test_only_the_adapters_train_and_the_loss_falls(run):
    _, _, _, losses, res = run
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < losses[1] - 0.05, losses
    trainable = {n for n, p in res.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora." in n for n in trainable)


def test_the_base_checkpoint_is_untouched_and_the_expert_bias_stays(run):
    _, hub, before, _, res = run
    assert _digest(hub) == before
    base = load_export(hub)
    for name, t in base.state_dict().items():
        if name.endswith("expert_bias"):
            assert torch.equal(res.model.state_dict()[name], t), name


def test_every_routed_expert_has_a_nonzero_adapter_that_changes_its_weights(run):
    root, hub, _, _, res = run
    tensors = load_file(str(root / "run" / ADAPTER_DIR / "adapter_model.safetensors"))
    conf = json.loads((root / "run" / ADAPTER_DIR / "adapter_config.json").read_text())
    assert conf["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert conf["rank_pattern"] == {"gate_up_proj": 8} and conf["r"] == 4
    assert not any("o_a_proj" in k or "wo_a" in k or "mtp." in k for k in tensors)
    layers = res.model.cfg.num_layers
    base, merged = load_export(hub).state_dict(), load_export(root / "run" / "export").state_dict()
    for layer in range(layers):
        for e in range(4):
            for w in ("w1", "w2", "w3"):
                p = f"base_model.model.model.layers.{layer}.ffn.experts.{e}.{w}"
                a, b = tensors[f"{p}.lora_A.weight"], tensors[f"{p}.lora_B.weight"]
                assert a.shape[0] == b.shape[1] == 4
                assert (b @ a).abs().sum() > 0, (layer, e, w)
        for native in ("w_gate", "w_up", "w_down"):
            k = f"layers.{layer}.ffn.{native}"
            changed = (merged[k] - base[k]).flatten(1).abs().amax(1)
            assert (changed > 0).all(), (k, changed)
    for k in ("layers.1.attn.wq_a.weight", "layers.1.attn.indexer.wq_b.weight", "layers.1.attn.compressor.wgate.weight",
              "layers.1.attn.indexer.comp.wkv.weight"):
        assert not torch.equal(merged[k], base[k]), k
    assert torch.equal(merged["embed.weight"], base["embed.weight"])


def test_adapter_on_the_base_scores_as_the_merged_export_and_transformers(run, tmp_path):
    from transformers import AutoModelForCausalLM

    root, hub, _, _, _ = run
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    runner = CliRunner()
    rows = {}
    for name, args in {"adapter": ["--model", str(hub), "--adapter", str(root / "run" / ADAPTER_DIR)],
                       "merged": ["--model", str(root / "run" / "export")], "base": ["--model", str(hub)]}.items():
        res = runner.invoke(app, ["score", *args, "--input", str(tmp_path / "in.jsonl"),
                                  "--output", str(tmp_path / f"{name}.jsonl")])
        assert res.exit_code == 0, res.output
        rows[name] = json.loads((tmp_path / f"{name}.jsonl").read_text())
    lp = {k: torch.tensor(v["logprobs"]) for k, v in rows.items()}
    torch.testing.assert_close(lp["adapter"], lp["merged"], rtol=0, atol=2e-5)
    assert (lp["adapter"] - lp["base"]).abs().max() > 1e-3  # the adapter does something
    hf = AutoModelForCausalLM.from_pretrained(str(root / "run" / "export"), dtype=torch.float32).eval()
    ids = torch.tensor([[hf.config.bos_token_id, *rows["merged"]["token_ids"]]])
    with torch.no_grad():
        hf_lp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(hf_lp, lp["merged"], rtol=0, atol=1e-4)


def test_a_fresh_adapter_is_the_base_and_the_merge_is_exact():
    model = tiny_model(seed=1)
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        want = model(ids)
    apply_lora(model, LoRAConfig(rank=3, targets=list(LORA_TARGETS)), seed=0)
    with torch.no_grad():
        assert torch.equal(model(ids), want)
        for name, p in model.named_parameters():
            if name.endswith("lora.b") or name.rsplit(".", 1)[-1].startswith("b_"):  # B: zero at the start
                p.normal_(0, 0.05)
        adapted = model(ids)
    assert (adapted - want).abs().max() > 1e-3
    plain = tiny_model(seed=1)
    plain.load_state_dict(dict(merged_state(model)))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), adapted, rtol=1e-4, atol=1e-5)


def test_bad_lora_configs_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        LoRAConfig(rank=4, targets=["attn.wo_a"])
    with pytest.raises(ValueError, match="go together"):
        LoRAConfig(rank=4, targets=["ffn.experts.w1"])
    model = tiny_model(seed=0, layer_types=["sliding_attention"] * 3)
    with pytest.raises(LoRAError, match="match no module"):
        apply_lora(model, LoRAConfig(rank=2, targets=["attn.indexer.wq_b"]))
    conf = adapter_config(LoRAConfig(rank=4, alpha=8, targets=list(DEFAULT_LORA_TARGETS)), None)
    assert "shared_experts.gate_proj" in conf["target_modules"] and "self_attn.q_a_proj" in conf["target_modules"]
    assert conf["alpha_pattern"] == {"gate_up_proj": 16}


def test_an_adapter_that_does_not_fit_the_model_names_the_key(run, tmp_path):
    root, _, _, _, _ = run
    other = tiny_model(seed=0)
    with pytest.raises(LoRAError, match="lora_B.weight has shape"):
        load_adapter(other, root / "run" / ADAPTER_DIR)
    other = tiny_model(seed=0, n_routed_experts=6, moe_intermediate_size=32, hidden_size=32)
    with pytest.raises(LoRAError, match="adapter keys do not match"):
        load_adapter(other, root / "run" / ADAPTER_DIR)


@pytest.mark.parametrize("to", ["hf", "hub-bf16", "hub-fp8"])
def test_trex_convert_merges_the_adapter_into_the_base(run, tmp_path, to):
    root, hub, _, _, _ = run
    res = CliRunner().invoke(app, ["convert", str(hub), str(tmp_path / to), "--to", to,
                                   "--adapter", str(root / "run" / ADAPTER_DIR), "--no-fsync"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["adapted_tensors"] > 0
    got = load_export(tmp_path / to).state_dict()
    # the stage's own merged export (float32) in the same target: the same weights up to the last bit of the sums
    want_dir = root / "run" / "export"
    if to != "hf":
        res = CliRunner().invoke(app, ["convert", str(want_dir), str(tmp_path / "want"), "--to", to, "--like",
                                       str(hub), "--no-fsync"])
        assert res.exit_code == 0, res.output
        want_dir = tmp_path / "want"
    want = load_export(want_dir).state_dict()
    for k, v in want.items():
        same = torch.isclose(got[k].float(), v.float(), rtol=1e-5, atol=1e-7).float().mean()
        assert same >= 0.999, (k, float(same))
    if to == "hub-fp8":  # untouched quantised tensors keep the published bytes; the adapted ones were re-quantised
        assert summary["requantised_tensors"] > summary["unchanged_tensors"] > 0, summary
        assert 0 < summary["changed_tensors_codes_unchanged"] < 1, summary


def test_an_adapter_for_another_base_is_refused_by_convert(run, tmp_path):
    root, _, _, _, _ = run
    other = write_hub_checkpoint(tmp_path / "other", "flash", config={**SMALL, "num_hidden_layers": 2,
                                                                      "compress_ratios": [0, 4, 0]}, seed=1)
    res = CliRunner().invoke(app, ["convert", str(other), str(tmp_path / "out"), "--to", "hf",
                                   "--adapter", str(root / "run" / ADAPTER_DIR), "--no-fsync"])
    assert res.exit_code == 2 and "which the base does not have" in res.output, res.output
    assert not (tmp_path / "out").exists()


def _quantised_file_bytes(hub) -> tuple[int, int]:
    """(bytes of the FP8 / MXFP4 codes and their scales, of those kept dense: wo_a, MTP's e_proj / h_proj) in the
    checkpoint's files."""
    from trainer.hub.reader import read_header

    total = wo_a = 0
    for f in hub.glob("*.safetensors"):
        for name, h in read_header(f).items():
            if name == "__metadata__":
                continue
            base = name.rsplit(".", 1)[0]
            if h["dtype"] in ("F8_E4M3", "I8") or name.endswith(".scale"):  # (the MTP head's too)
                n = h["data_offsets"][1] - h["data_offsets"][0]
                total += n
                wo_a += n if base.endswith(("attn.wo_a", "e_proj", "h_proj")) else 0
    return total, wo_a


def test_the_quantised_base_stays_quantised_and_trains_as_the_dense_one(tmp_path):
    from trainer.hub.frozen_base import load_frozen_base
    from trainer.qbase import FrozenQuantExperts, FrozenQuantLinear, frozen_bytes

    hub = write_hub_checkpoint(tmp_path / "hub", "flash", config=SMALL, seed=2)
    vocab = json.loads((hub / "config.json").read_text())["vocab_size"]
    model = load_frozen_base(hub)
    kinds = {type(m) for m in model.modules()}
    assert FrozenQuantLinear in kinds and FrozenQuantExperts in kinds
    assert all(m.w_gate.is_meta for m in model.moe_layers())
    assert not hasattr(model.layers[0].attn.wq_a, "weight")
    size = frozen_bytes(model)
    quant, wo_a = _quantised_file_bytes(hub)
    assert size["quantised"] == quant - wo_a  # the file's own codes and scales, no more (wo_a: dense bf16)
    data = pack(random_docs(n=32, vocab=vocab, seed=2), 32, 0)
    losses = {}
    for base in ("auto", "fp32"):
        lora = LoRAConfig(rank=4, alpha=8, lr=1e-2, base=base)
        got: dict[int, float] = {}
        train_stage("sft", ModelArgs(), tiny_train_cfg(steps=4, batch_size=8, log_every=1, ckpt_every=4, lora=lora), None,
                    0, data, tmp_path / base, str(hub), vocab, init_dir=str(hub),
                    on_log=lambda s, m, got=got: got.__setitem__(s, m["loss"]))
        losses[base] = got
    for s in losses["fp32"]:
        assert abs(losses["auto"][s] - losses["fp32"][s]) < 1e-4, losses
    cfg = json.loads((tmp_path / "auto" / "export" / "config.json").read_text())
    assert cfg["trex_lora"]["base"] == "quantised"


def test_a_killed_lora_stage_resumes_to_the_same_adapter(tmp_path):
    from trainer.engines import single

    data = pack(random_docs(n=32, seed=4), 32, 0)
    cfg = tiny_train_cfg(steps=6, batch_size=8, log_every=1, ckpt_every=2, lora=LoRAConfig(rank=2))

    def fresh():
        m = tiny_model(seed=3)
        apply_lora(m, cfg.lora, seed=0)
        return m

    whole = fresh()
    single.train(whole, data, cfg, tmp_path / "a", 0)
    part = fresh()
    single.train(part, data, cfg, tmp_path / "b", 0, stop_after=3)
    again = fresh()
    res = single.train(again, data, cfg, tmp_path / "b", 0)
    assert res.resumed_from is not None
    for (n, p), (_, q) in zip(whole.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    step = sorted((tmp_path / "b").glob("step_*"))[-1]
    assert not any("w_gate" in f.name for f in step.iterdir())  # (DCP files hold the adapters, not the base)


def test_peft_loads_the_adapter_onto_transformers_base_as_trex_applies_it(run, tmp_path):
    """The reference note's round trip: PEFT on transformers' model of the base gives the adapted logits, with no
    missing adapter key (its spurious rank_pattern warning for gate_up_proj allowed)."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.hub.convert import convert

    root, hub, _, _, _ = run
    convert(hub, tmp_path / "base_hf", "hf", fsync=False)
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base_hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(base, str(root / "run" / ADAPTER_DIR)).eval()
    assert not [w for w in caught if "missing adapter keys" in str(w.message) or "Unexpected keyword" in str(w.message)]
    ours = load_adapter(load_export(hub), root / "run" / ADAPTER_DIR).eval()
    with torch.no_grad():
        got, want = peft_model(ids).logits, ours(ids)
    assert (got - plain).abs().max() > 1e-2  # the adapter is applied
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_qlora_runs_checkpoint_converts_onto_its_named_base_or_says_what_to_convert(run, tmp_path):
    """A QLoRA run's DCP steps hold the adapters; ``frozen_base.json`` beside them names the base checkpoint, so
    ``trex convert RUN/checkpoints`` merges them onto it (= the run's export). Without the card, or with the base
    gone, a clear error."""
    import shutil

    root, hub, _, _, _ = run
    res = CliRunner().invoke(app, ["convert", str(root / "run" / "checkpoints"), str(tmp_path / "o"), "--to", "hf"])
    assert res.exit_code == 0, res.output
    assert json.loads((root / "run" / "checkpoints" / "frozen_base.json").read_text())["checkpoint"] == str(hub)
    got, want = load_export(tmp_path / "o").state_dict(), load_export(root / "run" / "export").state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
    moved = shutil.copytree(root / "run" / "checkpoints", tmp_path / "ck")
    (moved / "frozen_base.json").write_text(json.dumps({"checkpoint": str(tmp_path / "gone")}))
    res = CliRunner().invoke(app, ["convert", str(moved), str(tmp_path / "o2"), "--to", "hf"])
    assert res.exit_code == 2 and "is gone" in " ".join(res.output.split()), res.output
    (moved / "frozen_base.json").unlink()
    res = CliRunner().invoke(app, ["convert", str(moved), str(tmp_path / "o3"), "--to", "hf"])
    assert res.exit_code == 2 and "holds the adapters, not the frozen base" in " ".join(res.output.split()), res.output
