from trex.cli.bench import load_bench


def test_rl_bench_reports_rollout_and_update_throughput_with_the_host(capsys):
    out = load_bench("rl_bench").main(["--config", "configs/micro.yaml", "--steps", "2", "--prompt", "12",
                                       "--max-new", "6", "--threads", "1", "--set", "train.rl.group_size=2",
                                       "--set", "train.rl.prompts_per_rollout=2", "--set", "train.rl.batch_size=4"])
    assert out["rollout_tokens_per_s"] > 0 and out["update_tokens_per_s"] > 0 and out["rows_per_rollout"] == 4
    assert out["host"] and "rollout:" in capsys.readouterr().out
