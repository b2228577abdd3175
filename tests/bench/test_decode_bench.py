import pytest

from trex.cli.bench import load_bench


@pytest.mark.parametrize("extra", [[], ["--temperature", "0.7", "--logprobs"]])
def test_decode_bench_times_both_decoders_and_restores_the_current_one(capsys, extra):
    import trainer.generate as generate
    import trainer.models.deepseek_v4.cpu_attention as cpu_attention
    from trainer.models.deepseek_v4.packing import DecodeCache

    before = (DecodeCache.keep, cpu_attention._direct, generate.DecodeBatch._advance)
    out = load_bench("decode_bench").main(["--rows", "3", "--prompt", "12", "--min-new", "2", "--max-new", "6",
                                           "--rounds", "1", "--threads", "1", *extra])
    assert set(out["tokens_per_s"]) == {"new", "former"} and out["ratio"] > 0
    if not extra:
        assert out["identical"] == 3  # greedy: the two decoders agree on every completion
    assert "new / former" in capsys.readouterr().out
    assert (DecodeCache.keep, cpu_attention._direct, generate.DecodeBatch._advance) == before


def test_decode_bench_rejects_lengths_past_the_context():
    with pytest.raises(SystemExit, match="max_seq_len"):
        load_bench("decode_bench").main(["--prompt", "1000", "--max-new", "100"])
