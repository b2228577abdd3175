from trex.cli.bench import load_bench


def test_decode_bench_times_both_paths_and_restores_the_default(capsys):
    import trainer.models.deepseek_v4.cpu_attention as cpu_attention

    before = cpu_attention.CPU_DIRECT_QUERIES
    out = load_bench("decode_bench").main(["--rows", "3", "--prompt", "12", "--min-new", "2", "--max-new", "6",
                                           "--rounds", "1", "--threads", "1"])
    assert set(out["tokens_per_s"]) == {"new", "old"} and out["ratio"] > 0
    assert out["identical"] == 3  # greedy: the two attention paths agree on every completion
    assert "new / old" in capsys.readouterr().out
    assert cpu_attention.CPU_DIRECT_QUERIES == before > 0


def test_decode_bench_rejects_lengths_past_the_context():
    import pytest

    with pytest.raises(SystemExit, match="max_seq_len"):
        load_bench("decode_bench").main(["--prompt", "1000", "--max-new", "100"])
