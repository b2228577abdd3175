import datasets
import pytest

from trainer.tokenizer import train_tokenizer
from trex.cli.bench import load_bench


def _state(tmp_path):
    """A lifecycle state in miniature: a tokenizer and curated SFT / CPT splits of different lengths."""
    out = tmp_path / "outputs"
    texts = [f"minimise cost {i} subject to capacity {i * 7} " * (1 + i % 5) for i in range(40)]
    train_tokenizer(texts, out / "tokenizer" / "abc", vocab_size=300)
    messages = [[{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}] for t in texts]
    datasets.Dataset.from_dict({"messages": messages}).save_to_disk(str(out / "data" / "d1" / "sft"))
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(out / "data" / "d1" / "cpt"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text((open("configs/tiny.yaml").read()
                    .replace("seq_len: 512", "seq_len: 128").replace("batch_size: 8", "batch_size: 4")))
    return cfg


@pytest.mark.parametrize("stage,sides", [("sft", ("random", "grouped")), ("cpt", ("in_order", "best_fit"))])
def test_batch_ab_measures_both_sides_on_a_lifecycle_state(tmp_path, capsys, stage, sides):
    cfg = _state(tmp_path)
    out = load_bench("batch_ab").main(["--config", str(cfg), "--state-dir", str(tmp_path), "--stage", stage,
                                       "--steps", "2", "--threads", "1"])
    assert set(out) == set(sides) and all(r["real_tokens_per_s"] > 0 for r in out.values())
    assert f"{sides[1]}/{sides[0]} real tokens/s" in capsys.readouterr().out


def test_batch_ab_says_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match="no tokenizer under .*run `make run` first"):
        load_bench("batch_ab").main(["--state-dir", str(tmp_path)])
