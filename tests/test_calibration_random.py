"""benchmarks/memory_calibration.py --random: the draw is reproducible and only yields configurations the project's
validation accepts; the table marks misses and keeps failed points. Nothing trains here (the real runs take minutes)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("memory_calibration", ROOT / "benchmarks" / "memory_calibration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_random_calibration_draw_is_reproducible_and_valid():
    from rm.foundations.config import compose
    from rm.settings.validate import validate

    mc = _bench()
    first, redrawn = mc.draw_valid_points(4, seed=7)
    again, redrawn_again = mc.draw_valid_points(4, seed=7)
    assert first == again and redrawn == redrawn_again
    assert first != mc.draw_valid_points(4, seed=8)[0]
    for p in first:
        overrides = mc.random_overrides(p)
        nproc = mc.RANDOM_LAYOUTS[p["layout"]][0]
        validate(compose(overrides), nproc)  # raises if refused
        assert all(o in overrides for o in mc.PRECISIONS_DRAWN[p["precision"]][1])
        assert f"train.global_batch_size={p['micro'] * nproc * p['accumulation']}" in overrides
        assert p["params"] <= mc.RANDOM_MAX_PARAMS


def test_random_pairs_have_a_length_spread_and_over_length_rows(tmp_path):
    mc = _bench()
    spec = {"seed": 3, "pairs": 128, "long_fraction": 0.3, "median_fraction": 0.3, "sigma": 0.8}
    mc.write_random_pairs(tmp_path / "p", spec, max_length=64)
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    lengths = [len(r["prompt"].split()) for r in rows]
    assert len(rows) == 128 and len((tmp_path / "p_eval.jsonl").read_text().splitlines()) == 8
    assert sum(n > 64 for n in lengths) >= 20 and min(lengths) < 32 and len(set(lengths)) > 30


def test_random_calibration_table_marks_misses_and_failures(tmp_path):
    mc = _bench()
    points, _ = mc.draw_valid_points(3, seed=1)
    measured = {"estimate_mib": 10.0, "phase": "forward/backward", "measured_per_rank_mib": [10.0, 9.0],
                "errors_per_rank_pct": [0.0, 11.1]}
    rows = [{"index": 0, "point": points[0], "short": mc.short_form(points[0]), **measured},
            {"index": 1, "point": points[1], "short": mc.short_form(points[1]), **measured, "errors_per_rank_pct": [0.0, -1.0]},
            {"index": 2, "point": points[2], "short": mc.short_form(points[2]), "failed": "RuntimeError: boom"}]
    meta = {"command": "python benchmarks/memory_calibration.py --random 3 --seed 1", "date": "d", "elapsed_s": 1,
            "cpu_count": 2, "load_min_max": [0.1, 0.2], "complete": True, "seed": 1, "redrawn": {"x": 2},
            "precisions_drawn": mc.PRECISIONS_DRAWN, "max_params": mc.RANDOM_MAX_PARAMS, "max_flops": mc.RANDOM_MAX_FLOPS}
    out = tmp_path / "random.md"
    mc.write_random_doc(out, meta, rows)
    mc.plot_random(rows, out.with_suffix(".png"))
    text = out.read_text()
    assert "3 points (seed 1): 2 measured, 1 failed, 1 MISS" in text and "largest over +11.10%" in text
    assert text.count("**MISS**") == 1 and "failed: `RuntimeError: boom`" in text
    assert out.with_suffix(".png").stat().st_size > 0


def test_each_rank_is_compared_with_its_own_estimate():
    """memory.json's rank_peak_bytes: rank 0 estimated 10 MiB and measured 10, rank 1 estimated 11.5 and measured 11
    (+4.55%, within the band); the verdict's estimate is the largest. An older memory.json without it compares every
    rank with the verdict's: rank 0 is then 15% over, a miss."""
    mc = _bench()
    mib = 2**20
    estimate = {"peak_bytes": 11.5 * mib, "peak_phase": "forward/backward", "rank_peak_bytes": [10 * mib, 11.5 * mib],
                "weights": 4 * mib}
    measured = [{"peak_allocated_bytes": 10 * mib}, {"peak_allocated_bytes": 11 * mib}]
    row = mc.point_result({"estimate": estimate, "measured": measured[0], "measured_per_rank": measured})
    assert row["estimate_per_rank_mib"] == [10.0, 11.5] and row["estimate_mib"] == 11.5
    assert [round(e, 2) for e in row["errors_per_rank_pct"]] == [0.0, 4.55]
    assert not mc.is_miss(row)
    del estimate["rank_peak_bytes"]
    row = mc.point_result({"estimate": estimate, "measured": measured[0], "measured_per_rank": measured})
    assert [round(e, 2) for e in row["errors_per_rank_pct"]] == [15.0, 4.55] and mc.is_miss(row)


def test_a_failed_point_records_the_ranks_own_error():
    """torchrun's summary (stderr) names no cause; rm logs a rank's traceback and error to its log (stdout). The seed-7
    QLoRA draw recorded six two-process points as 'ChildFailedError' while rank 1's log said why."""
    import subprocess

    mc = _bench()
    proc = subprocess.CompletedProcess([], 1, stdout="[rm.train][ERROR] - Traceback (most recent call last):\n"
                                       "ValueError: Unrecognized model in /cache/random_init/mistral-fe53.\n"
                                       "this is a bug in rm, not a problem with your settings or data\n",
                                       stderr="torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                                              "  exitcode  : 1 (pid: 29593)\n")
    assert mc.failure_line(mc.rank_errors(proc), 1) == "ValueError: Unrecognized model in /cache/random_init/mistral-fe53."


def test_a_qlora_point_finds_its_random_init_saved_or_builds_it(tmp_path):
    """--random-init saved (the default) saves the point's init where its run looks, keyed as rm keys it (the pad id of
    the tokenizer the run builds, the run's seed); built leaves the point's own cache empty. Other profiles have none."""
    from unittest import mock

    from accelerate.utils import set_seed

    from rm.foundations.config import compose
    from rm.modelling.model import random_init_saved

    mc = _bench()
    overrides = ["experiment=tiny", "memory_profile=qlora", "data.synthetic_train_size=16", "data.synthetic_test_size=4"]
    assert mc.prepare_random_init(overrides, tmp_path / "built", saved=False) == "built"
    assert mc.prepare_random_init(overrides, tmp_path / "saved", saved=True) == "saved"
    assert mc.prepare_random_init(["experiment=tiny", "memory_profile=lora"], tmp_path / "lora", saved=True) is None
    cfg = compose(overrides)
    set_seed(cfg.train.seed)
    for cache, saved in (("saved", True), ("built", False)):
        with mock.patch.dict("os.environ", mc.random_init_env(tmp_path / cache)):
            assert random_init_saved(cfg.model, 0) is saved
