"""Lost updates (rm.foundations.lost_updates) and the ``lost_updates`` alarm (rm.training.health)."""

import logging

import pytest
import torch

import rm.train as rm_train
from rm.training.health import CONTINUE, SKIP, lost_updates_alarm
from rm.foundations.lost_updates import LostUpdateProbe, lost_fraction, lost_updates, sample_positions
from rm.training.run_setup import watch_lost_updates
from rm.settings.validate import ConfigError, validate
from tests.training.test_health import monitor, read_metrics, take_step


# ---------------------------------------------------------------- the pure functions


def test_a_bf16_update_below_its_spacing_is_lost_and_the_same_update_in_fp32_is_not():
    # bf16 spaces values near 0.02 by 2^-13 = 1.2e-4: subtracting 1e-5 rounds back to the same bits.
    before = torch.full((4,), 0.02, dtype=torch.bfloat16)
    gradient = torch.tensor([1.0, -1.0, 0.0, 1.0])  # the third was not meant to move: not counted
    assert lost_updates(before, before - 1e-5, gradient).tolist() == [3, 3]
    assert lost_updates(before.float(), before.float() - 1e-5, gradient).tolist() == [0, 3]
    # A bf16 update above the spacing is kept; only the unchanged element with a gradient is lost.
    after = before.clone()
    after[:2] -= 1e-3
    assert lost_updates(before, after, gradient).tolist() == [1, 3]


def test_bits_not_values_decide_a_change():
    zero = torch.zeros(2)
    assert lost_updates(zero, -zero, torch.ones(2)).tolist() == [0, 2]  # 0.0 -> -0.0 did change
    nan = torch.full((2,), float("nan"))
    assert lost_updates(nan, nan.clone(), torch.ones(2)).tolist() == [2, 2]  # NaN stayed NaN: nothing moved
    with pytest.raises(ValueError):
        lost_updates(zero, zero.bfloat16(), torch.ones(2))


def test_sample_positions_are_seeded_distinct_and_spread_over_every_tensor():
    numels = [1000, 10, 50_000, 3000]
    chosen = sample_positions(numels, 2048, seed=7)
    again = sample_positions(numels, 2048, seed=7)
    assert [(i, p.tolist()) for i, p in chosen] == [(i, p.tolist()) for i, p in again]
    assert [(i, p.tolist()) for i, p in sample_positions(numels, 2048, seed=8)] != [(i, p.tolist()) for i, p in chosen]
    for i, positions in chosen:
        assert 0 <= positions.min() and positions.max() < numels[i] and len(positions.unique()) == len(positions)
    sizes = {i: len(p) for i, p in chosen}
    assert 1900 < sum(sizes.values()) <= 2048  # drawn with replacement: a few duplicates at most
    assert sizes[2] > 10 * sizes[0] > 0 and sizes[3] > 0  # uniform over elements, so in proportion to size
    assert [(i, p.tolist()) for i, p in sample_positions([2, 1], 10, seed=0)] == [(0, [0, 1]), (1, [0])]
    assert sample_positions([], 10, seed=0) == [] and sample_positions([5], 0, seed=0) == []


def test_lost_fraction_and_the_alarm_threshold():
    assert lost_fraction([1, 4]) == 0.25 and lost_fraction([0, 0]) is None
    alarm = lost_updates_alarm(0.85, 0.5, 3)
    assert alarm.name == "lost_updates" and "train.precision=bf16-mixed" in alarm.message
    assert "learning rate" in alarm.message and "85%" in alarm.message
    assert lost_updates_alarm(0.5, 0.5, 3) is None  # strictly above
    assert lost_updates_alarm(1.0, 0.0, 3) is None  # 0 disables
    assert lost_updates_alarm(None, 0.5, 0) is None  # nothing counted


def adamw_step(dtype, lr, zero_rows=0):
    """One torch AdamW step on a 256 x 256 weight from N(0, 0.02), watched by a probe; returns its counts."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(256, 256) * 0.02).to(dtype))
    weight.grad = torch.randn(256, 256).to(dtype)
    weight.grad[:zero_rows] = 0
    optimizer = torch.optim.AdamW([weight], lr=lr, weight_decay=0.0)
    probe = LostUpdateProbe([weight], seed=0, sample_size=2048)
    probe.snapshot()
    optimizer.step()
    return probe.compare().tolist()


def test_probe_sees_pure_bf16_adamw_lose_small_updates_and_fp32_keep_them():
    lost, counted = adamw_step(torch.bfloat16, 1e-5)
    assert counted > 1900 and lost / counted > 0.8
    assert adamw_step(torch.float32, 1e-5)[0] == 0
    lost, counted = adamw_step(torch.bfloat16, 1e-2)  # updates far above bf16's spacing: (almost) none lost
    assert lost / counted < 0.05
    # Elements without a gradient are not counted: a quarter of the rows have none.
    assert 0.7 < adamw_step(torch.bfloat16, 1e-5, zero_rows=64)[1] / counted < 0.8


def test_probe_takes_gradients_as_zero_where_there_are_none_and_mixed_dtypes():
    body = torch.nn.Parameter(torch.full((8,), 0.02, dtype=torch.bfloat16))
    head = torch.nn.Parameter(torch.full((4,), 0.02))  # an fp32 head beside a bf16 body
    frozen_out = torch.nn.Parameter(torch.ones(3))  # no gradient this step
    body.grad, head.grad = torch.ones(8, dtype=torch.bfloat16), torch.ones(4)
    probe = LostUpdateProbe([body, head, frozen_out], seed=0)
    assert probe.size == 15 and probe.compare() is None  # no snapshot yet
    probe.snapshot()
    with torch.no_grad():
        body -= 1e-5  # lost in bf16
        head -= 1e-5  # kept in fp32
    assert probe.compare().tolist() == [8, 12]


# ---------------------------------------------------------------- the monitor


def test_monitor_alarms_on_the_running_fraction_after_warmup_at_logging_steps():
    """The probe watches 4 elements; the "optimizer" below moves them or not. Warmup is 1 step: step 1's
    lost updates (a learning rate near 0) are logged in the window but not held against the run."""
    weight = torch.nn.Parameter(torch.zeros(4))
    health = monitor(loss_scaling=True)  # as under fp16, a step the engine drops (step 5) is no alarm
    health.watch_updates(LostUpdateProbe([weight], seed=0), warmup_steps=1)

    def step(n, moves, applied=True, loss=0.5):
        weight.grad = torch.ones(4)
        action = take_step(health, n, [loss])
        if moves and action == CONTINUE:
            with torch.no_grad():
                weight.add_(1.0)
        return action, health.after_update(n, applied)

    step(1, moves=False)
    step(2, moves=True)
    assert health.lost_update_fraction(2, reduce=lambda t: t) == 0.5  # the window: 4 lost of 8
    assert health.fired == []  # after warmup: 0 of 4
    step(3, moves=False)
    step(4, moves=True)
    assert health.lost_update_fraction(4, reduce=lambda t: t) == 0.5 and health.fired == []  # running: 4 of 12
    step(5, moves=False, applied=False)  # the engine dropped the update (fp16 overflow): not a lost one
    assert health.lost_update_fraction(5, reduce=lambda t: t) is None
    step(6, moves=False)
    assert health.lost_update_fraction(6, reduce=lambda t: t) == 1.0
    assert health.fired == []  # running: 8 of 16, not above 0.5
    step(7, moves=False)
    assert health.lost_update_fraction(7, reduce=lambda t: t) == 1.0
    assert health.fired == ["lost_updates"]  # running: 12 of 20
    alarm = health.alarms[0]
    assert alarm["step"] == 7 and "60% of the sampled weight updates over 5 step(s) after warmup" in alarm["message"]
    # The running counts carry over a resume.
    resumed = monitor()
    resumed.load_state_dict(health.state_dict())
    assert resumed.state_dict()["lost_updates"] == [12, 20, 5]


def test_monitor_skipped_steps_take_no_snapshot():
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.ones(2)
    health = monitor(on_nonfinite="skip")
    health.watch_updates(LostUpdateProbe([weight], seed=0), warmup_steps=0)
    assert take_step(health, 1, [float("nan")]) == SKIP and health.after_update(1, False) == CONTINUE
    assert health.lost_update_fraction(1, reduce=lambda t: t) is None and health.fired == ["nonfinite_loss"]


def test_no_probe_no_metric():
    assert monitor().lost_update_fraction(1, reduce=lambda t: t) is None


class Stub:
    def __init__(self, params):
        self.params = params

    def stepped_parameters(self):
        return self.params


def test_only_the_optimizers_own_weights_are_watched(tiny_cfg, caplog):
    cfg = tiny_cfg()
    health = monitor()
    with caplog.at_level(logging.INFO, logger="rm.train"):
        watch_lost_updates(health, Stub(None), cfg.health, cfg.train, total_steps=10)  # DeepSpeed: fp32 master partitions
    assert health._probe is None and "DeepSpeed updates fp32 master partitions" in caplog.text
    off = tiny_cfg("health.lost_updates_threshold=0")
    watch_lost_updates(health, Stub([torch.nn.Parameter(torch.zeros(3))]), off.health, off.train, 10)
    assert health._probe is None  # off: nothing measured
    watch_lost_updates(health, Stub([torch.nn.Parameter(torch.zeros(3))]), cfg.health, cfg.train, total_steps=100)
    assert health._probe.size == 3 and health._warmup_steps == 5  # experiment=tiny: warmup_ratio 0.05


def test_threshold_is_a_fraction(tiny_cfg):
    with pytest.raises(ConfigError, match=r"health.lost_updates_threshold=1.5 must be in \[0, 1\]"):
        validate(tiny_cfg("health.lost_updates_threshold=1.5"), 1)


# ---------------------------------------------------------------- end to end


def lost_metrics(run_dir):
    return [m["lost_update_fraction"] for m in read_metrics(run_dir) if m["event"] == "train"]


def test_pure_bf16_at_lr_1e5_raises_the_alarm(tiny_cfg, tmp_path, fresh_accelerator_state):
    """train.precision=bf16-true trains bf16 weights with torch AdamW (on the CPU too): at 1e-5 most
    sampled updates round to nothing (about 95% on the tiny model)."""
    cfg = tiny_cfg("hardware.bf16=true", "train.precision=bf16-true", "train.optim.learning_rate=1e-5", "train.max_steps=2",
                   "train.logging.eval_steps=0")
    result = rm_train.train(cfg, tmp_path)
    assert result["status"] == "ok" and "lost_updates" in result["alarms"]
    assert lost_metrics(tmp_path)[0] > 0.5
    alarm = next(m for m in read_metrics(tmp_path) if m["event"] == "alarm" and m["name"] == "lost_updates")
    assert alarm["step"] == 2 and "bf16-mixed" in alarm["message"]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fp32_at_lr_1e5_raises_no_alarm(tiny_cfg, tmp_path, fresh_accelerator_state, precision):
    """Same run with fp32 weights for the optimizer (32-true, and bf16-mixed's master weights under autocast).
    Step 1 is warmup at a learning rate of 0: its updates are all lost (the window logs about 0.5), but the
    alarm reads only the steps after warmup, where nothing is lost."""
    cfg = tiny_cfg("train.optim.learning_rate=1e-5", "train.max_steps=2", "train.logging.eval_steps=0", f"train.precision={precision}",
                   "hardware.bf16=true")
    result = rm_train.train(cfg, tmp_path)
    assert result["status"] == "ok" and result["alarms"] == []
    [window] = lost_metrics(tmp_path)
    assert 0.4 < window < 0.6
