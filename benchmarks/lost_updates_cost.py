"""What the lost-update check (``rm.foundations.lost_updates``, ``health.lost_updates_threshold``) costs per training step.

    python benchmarks/lost_updates_cost.py                       # experiment=tiny's model, pure bf16, 30 + 30 steps
    python benchmarks/lost_updates_cost.py --steps 20 model.hidden_size=512 model.intermediate_size=1024 \\
        model.num_hidden_layers=4 model.num_attention_heads=8 model.num_key_value_heads=4 model.head_dim=64

Builds one real run (``rm.training.run_setup.setup``: data, model, accelerate engine, torch AdamW on bf16 weights at
lr 1e-5) and times ``rm.training.trainer.train_step`` with the probe attached and without, alternating step by step on
the same run, so that a change of load on a shared machine hits both alike. The "with" steps include the
logging-step read (:meth:`HealthMonitor.lost_update_fraction`, one reduce and one host read) every 10 steps.
Prints the median wall-clock and CPU (``time.process_time``, one thread: less inflated by other processes)
seconds of each, the overhead in percent, and the probe's own cost (snapshot + compare, timed alone over many
repeats) as a share of the step, which is the steadier number where steps are noisy. Also the 1-minute load
average before and after. Nothing is asserted: a timing on a shared machine is not a test.

Trailing arguments are Hydra overrides on top of the defaults below.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULTS = [
    "experiment=tiny", "hardware=cpu", "hardware.bf16=true", "train.precision=bf16-true", "train.optim.learning_rate=1e-5",
    "data.synthetic_train_size=2048", "data.synthetic_test_size=64", "data.max_length=64",
    "train.micro_batch_size=8", "train.global_batch_size=16", "train.share_prefix=false",
    "train.logging.eval_steps=0", "preflight=off",
]


def backward_only(run) -> None:
    """One micro-batch's forward and backward, no optimizer step: gradients in place for the probe to read."""
    from rm.modelling.loss import bradley_terry_loss
    from rm.modelling.model import pair_rewards
    from rm.training.trainer import MODEL_INPUTS, to_device

    indices = run.batches.for_step(run.state.step)[0]
    inputs = to_device(run.train_collator(run.train_set.select(indices)), (*MODEL_INPUTS, "margin"), run.engine.device)
    margin = inputs.pop("margin")
    with run.engine.autocast():
        loss = bradley_terry_loss(*pair_rewards(run.model, **inputs), margin, 0.0)
    loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each kind (after 4 warm-up steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is the step's own)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides on top of the defaults")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from rm.foundations.config import compose
    from rm.training.run_setup import setup
    from rm.training.trainer import train_step

    load_before = os.getloadavg()[0]
    cfg = compose(DEFAULTS + [f"train.max_steps={2 * args.steps + 8}"] + args.overrides)
    with tempfile.TemporaryDirectory() as run_dir, ExitStack() as cleanup:
        run = setup(cfg, Path(run_dir), DEFAULTS + args.overrides, cleanup, [], None)
        probe = run.health._probe
        assert probe is not None, "no probe: health.lost_updates_threshold=0, or a DeepSpeed run"
        params = sum(p.numel() for p in run.engine.stepped_parameters())
        times = {True: [], False: []}
        # Pairs of steps, with-without then without-with (ABBA): neither kind always comes first in a pair.
        order = [watched for pair in range(args.steps + 2) for watched in ((True, False) if pair % 2 else (False, True))]
        for i, watched in enumerate(order):
            run.health._probe = probe if watched else None
            wall, cpu = time.perf_counter(), time.process_time()
            stats = train_step(run, run.batches.for_step(run.state.step))
            if watched and i % 20 < 2:  # a logging step every 10 watched steps
                run.health.lost_update_fraction(run.state.step + 1, run.engine.reduce)
            float(stats.loss)  # the step's work is done before the clock stops (no-op on a CPU, a sync on CUDA)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            run.state.add_step(stats.loss, stats.tokens, taken=True)
            if i >= 4:
                times[watched].append((wall, cpu))
        run.health._probe = probe
        fraction = run.health.lost_update_fraction(run.state.step, run.engine.reduce)

        backward_only(run)  # the probe alone, on the weights and gradients of a real step
        repeats = 200
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(repeats):
            probe.snapshot()
            probe.compare()
        probe_wall, probe_cpu = (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats
        run.engine.end()
    load_after = os.getloadavg()[0]

    def median(watched, k):
        return statistics.median(t[k] for t in times[watched])

    print(f"model: {cfg.model.num_hidden_layers} layers x hidden {cfg.model.hidden_size}, {params:,} trainable "
          f"parameters, {cfg.train.precision} weights, torch AdamW; {probe.size} elements watched in "
          f"{len(probe.watched)} tensors; {args.steps} steps of each kind, {args.threads} thread(s)")
    print(f"lost_update_fraction of the last logging window: {fraction:.3f}")
    for k, clock in ((0, "wall"), (1, "cpu")):
        with_, without = median(True, k), median(False, k)
        # Each step against the other of its pair: the steps differ in their pairs' lengths, which pairing cancels.
        paired = statistics.median(w[k] - wo[k] for w, wo in zip(times[True], times[False]))
        print(f"median step {clock:4s}: with {with_ * 1e3:8.2f} ms, without {without * 1e3:8.2f} ms, "
              f"overhead {100 * (with_ - without) / without:+.2f}% (median paired difference "
              f"{100 * paired / without:+.2f}%)")
    print(f"probe alone (snapshot + compare): {probe_wall * 1e3:.3f} ms wall, {probe_cpu * 1e3:.3f} ms cpu = "
          f"{100 * probe_wall / median(False, 0):.2f}% / {100 * probe_cpu / median(False, 1):.2f}% of a step")
    print(f"1-min load average: {load_before:.2f} before, {load_after:.2f} after ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
