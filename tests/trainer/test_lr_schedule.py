"""The learning-rate schedule: warmup + cosine / WSD, and the loss threshold that ends WSD's stable phase."""

import pytest

from tests.trainer.helpers import random_docs, tiny_model, tiny_train_cfg
from trainer import checkpoint
from trainer.data import pack
from trainer.engines.single import train
from trainer.export import same_weights
from trainer.optim import LrSchedule
from trex.core.config import ConfigError, load_config


def _wsd(**kw):
    base = dict(steps=100, warmup_steps=4, schedule="wsd", decay_steps=10, min_lr_ratio=0.1,
                decay_trigger_loss=0.5, decay_trigger_window=3)
    return tiny_train_cfg(**{**base, **kw})


def test_without_a_trigger_the_decay_takes_the_last_decay_steps():
    s = LrSchedule(_wsd(decay_trigger_loss=None))
    for done in range(1, 60):
        assert not s.observe(done, 0.0)  # no threshold: losses change nothing
    assert s.last_step == 100 and s(89) == 1.0 and s(90) == 1.0 and 0.1 < s(95) < 1.0
    assert s(100) == pytest.approx(0.1)
    fraction = LrSchedule(tiny_train_cfg(steps=100, schedule="wsd", decay_fraction=0.25, warmup_steps=0))
    assert fraction(74) == 1.0 and fraction(75) == 1.0 and fraction(76) < 1.0  # decay_fraction without decay_steps


def test_the_mean_of_the_window_below_the_threshold_starts_the_decay_and_sets_the_last_step():
    s = LrSchedule(_wsd())
    # window means (3 steps): 0.1 at step 3, still warmup; then 0.73, 1.37, 1.63, 1.17, 0.63, 0.43 (step 9)
    losses = [0.1, 0.1, 0.1, 2.0, 2.0, 0.9, 0.6, 0.4, 0.3, 0.2]
    fired = [done for done, loss in enumerate(losses, 1) if s.observe(done, loss)]
    assert fired == [9]
    t = s.triggered_at
    assert s.last_step == t + 10 and s(t - 1) == 1.0 and s(t) == 1.0
    assert s(t + 5) == pytest.approx(1 - 0.9 * 0.5) and s(t + 10) == pytest.approx(0.1)
    assert not s.observe(t + 1, 0.0) and s.triggered_at == t  # once only
    again = LrSchedule(_wsd())
    again.load_state_dict(s.state_dict())
    assert again.last_step == s.last_step and [again(i) for i in range(40)] == [s(i) for i in range(40)]


def test_a_trigger_within_the_last_decay_steps_changes_nothing():
    s = LrSchedule(_wsd(steps=20))  # the fixed decay starts at 10
    assert not any(s.observe(done, 0.0) for done in range(10, 20))
    assert s.last_step == 20


def test_the_trigger_needs_the_wsd_schedule(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  sft:\n    schedule: cosine\n    decay_trigger_loss: 0.05\n")
    with pytest.raises(ConfigError, match="train.sft.*decay_trigger_loss needs schedule: wsd"):
        load_config(cfg)


def test_a_run_shorter_than_its_decay_decays_all_the_way():
    s = LrSchedule(_wsd(steps=6, warmup_steps=0, decay_steps=40))  # configs/tiny.yaml with --set ...steps=6
    assert s(0) == 1.0 and s(3) == pytest.approx(1 - 0.9 * 3 / 6) and s(6) == pytest.approx(0.1)


def test_a_triggered_run_ends_early_finished_and_resumes_bit_identically(tmp_path):
    # a threshold every loss is under: the decay starts once the window (6 steps) is full, the run ends 4 later
    cfg = _wsd(steps=30, warmup_steps=2, decay_steps=4, decay_trigger_loss=1e3, decay_trigger_window=6,
               ckpt_every=2, log_every=1)
    data = pack(random_docs(), 32, pad_id=0)
    straight, lrs = tiny_model(), {}
    r = train(straight, data, cfg, tmp_path / "a", seed=1, on_log=lambda step, m: lrs.setdefault(step, m["lr"]))
    assert (r.steps, r.finished, r.decay_triggered_at) == (10, True, 6) and max(lrs) == 10
    # the lr logged at a step is the next step's: the decay starts at step 6 (0-based) and ends at the tenth
    assert lrs[5] == lrs[6] == pytest.approx(cfg.lr) and lrs[7] == pytest.approx(cfg.lr * (1 - 0.9 / 4))
    assert checkpoint.find_latest(tmp_path / "a").name == "step_00000010"
    for stop in (4, 8):  # killed before the trigger (half a window) and after it
        killed = tiny_model()
        early = train(killed, data, cfg, tmp_path / f"b{stop}", seed=1, stop_after=stop)
        assert (early.steps, early.finished) == (stop, False)
        resumed = tiny_model(seed=99)
        r2 = train(resumed, data, cfg, tmp_path / f"b{stop}", seed=1)
        assert (r2.resumed_from, r2.steps, r2.finished) == (stop, 10, True)
        assert same_weights(straight, resumed), stop
    plain = tiny_model()
    train(plain, data, _wsd(steps=10, warmup_steps=2, decay_steps=4, decay_trigger_loss=None, ckpt_every=100),
          tmp_path / "c", seed=1)
    assert same_weights(straight, plain)  # the same as a fixed schedule decaying over the same steps
    assert not same_weights(straight, tiny_model())
