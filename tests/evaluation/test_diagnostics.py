"""Eval diagnostics: the pure functions against hand-worked numbers, then a short run that writes them."""

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForSequenceClassification

import rm.train as rm_train
from rm.foundations.config import to_run_config
from rm.data.build import build_extra_eval_sets, build_split
from rm.data.collator import PairCollator
from rm.data.synthetic import generate_pairs
from rm.evaluation.diagnostics import (
    PairScores,
    accuracy_by_length_bucket,
    diagnostic_keys,
    eval_keys,
    expected_calibration_error,
    longer_wins_accuracy,
    mean_std,
    pair_diagnostics,
    pairwise_accuracy,
    reward_length_correlation,
    tie_rate,
)
from rm.distributed.engine import AccelerateEngine
from rm.modelling.loss import build_loss
from rm.evaluation.metrics import evaluate
from rm.data.build import train_pairs
from rm.data.tokenizer import run_tokenizer
from rm.settings.validate import ConfigError, validate
from tests.conftest import CONF_DIR, FAST_TINY, compose_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BUCKETS = ["-inf..-65", "-64..-17", "-16..-1", "0", "1..16", "17..64", "65..inf"]

# Four pairs that exercise a right pair, a tie, a wrong pair, and both tails of the length buckets.
CHOSEN, REJECTED = [2.0, 1.0, 0.5, 3.0], [1.0, 1.0, 1.5, 0.0]
CHOSEN_LEN, REJECTED_LEN = [10, 5, 100, 30], [4, 5, 20, 100]


def test_accuracy_ties_and_longer_wins_by_hand():
    """rewards c = [2, 1, 0.5, 3], r = [1, 1, 1.5, 0]: c > r for pairs 0 and 3; pair 1 is a tie (wrong).
    accuracy = 2/4 = 0.5, tie rate = 1/4 = 0.25.
    lengths c = [10, 5, 100, 30], r = [4, 5, 20, 100]: the longer side is chosen in pairs 0 and 2 (1 each),
    pair 1 has equal lengths (1/2), pair 3's chosen is shorter (0): longer-wins = 2.5/4 = 0.625.
    """
    assert pairwise_accuracy(CHOSEN, REJECTED) == 0.5
    assert tie_rate(CHOSEN, REJECTED) == 0.25
    assert longer_wins_accuracy(CHOSEN_LEN, REJECTED_LEN) == 0.625


def test_accuracy_by_length_bucket_by_hand():
    """d = len_c - len_r = [6, 0, 80, -70] puts one pair in each of 1..16, 0, 65..inf and -inf..-65.
    Model: pair 0 right (1..16: 1.0), pair 1 tie (0: 0.0), pair 2 wrong (65..inf: 0.0), pair 3 right
    (-inf..-65: 1.0). Longer wins: 1.0 where d > 0, 0.5 at d = 0, 0.0 where d < 0. The other three
    buckets are empty: 0 pairs, NaN. Bucket accuracies weighted by pairs: (1 + 0 + 0 + 1) / 4 = 0.5,
    the overall accuracy.
    """
    buckets = {b.label: b for b in accuracy_by_length_bucket(CHOSEN, REJECTED, CHOSEN_LEN, REJECTED_LEN)}
    assert list(buckets) == BUCKETS
    expected = {"1..16": (1, 1.0, 1.0), "0": (1, 0.0, 0.5), "65..inf": (1, 0.0, 1.0), "-inf..-65": (1, 1.0, 0.0)}
    for label, b in buckets.items():
        if label in expected:
            assert (b.pairs, b.accuracy, b.longer_wins_accuracy) == expected[label]
        else:
            assert b.pairs == 0 and math.isnan(b.accuracy) and math.isnan(b.longer_wins_accuracy)


def test_bucket_edges_are_inclusive_as_documented():
    """d at every edge, plus -200 and 300: -inf..-65 gets {-200, -65}, -64..-17 {-64, -17},
    -16..-1 {-16, -1}, 0 {0}, 1..16 {1, 16}, 17..64 {17, 64}, 65..inf {65, 300}."""
    d = [-200, -65, -64, -17, -16, -1, 0, 1, 16, 17, 64, 65, 300]
    rejected_len = [300] * len(d)
    chosen_len = [300 + x for x in d]
    counts = [b.pairs for b in accuracy_by_length_bucket([1.0] * len(d), [0.0] * len(d), chosen_len, rejected_len)]
    assert counts == [2, 2, 2, 1, 2, 2, 2]


def test_correlation_means_and_stds_by_hand():
    """rewards c = [2, 0], r = [1, 1] -> pooled [2, 0, 1, 1], mean 1, deviations [1, -1, 0, 0];
    lengths c = [4, 2], r = [2, 4] -> pooled [4, 2, 2, 4], mean 3, deviations [1, -1, -1, 1].
    Pearson r = (1 + 1 + 0 + 0) / sqrt(2 * 4) = 1/sqrt(2) = 0.70711.
    Population stds: chosen [2, 0] -> 1; rejected [1, 1] -> 0; pooled sqrt(2/4) = 0.70711.
    """
    chosen, rejected, lc, lr = [2.0, 0.0], [1.0, 1.0], [4, 2], [2, 4]
    assert reward_length_correlation(chosen, rejected, lc, lr) == pytest.approx(1 / math.sqrt(2))
    assert mean_std(chosen) == (1.0, 1.0)
    assert mean_std(rejected) == (1.0, 0.0)
    scores = PairScores(*(torch.tensor(v, dtype=torch.float64) for v in (chosen, rejected, lc, lr)))
    diag = pair_diagnostics(scores)
    assert (diag["reward_mean"], diag["reward_std"]) == pytest.approx((1.0, math.sqrt(0.5)))
    assert math.isnan(reward_length_correlation(chosen, rejected, [3, 3], [3, 3]))  # constant lengths


def test_ece_on_the_symmetrised_pairs_by_hand():
    """p = sigmoid(d): d = ln 3 gives 3/4, d = -ln 3 gives 1/4.

    Two pairs, d = ln 3 and -ln 3 (right once, wrong once, each time saying 3/4 for the higher side).
    Symmetrised: (0.75, 1), (0.25, 0), (0.25, 1), (0.75, 0). Bin [0.2, 0.3): labels {0, 1}, mean 0.5,
    probability 0.25 -> 2/4 * 0.25; bin [0.7, 0.8): mean label 0.5, probability 0.75 -> 2/4 * 0.25.
    ECE = 0.25: it says 75% and is right 50% of the time.

    Four pairs, three at ln 3 and one at -ln 3 (right 3 times in 4, saying 3/4): bin [0.7, 0.8) holds
    labels [1, 1, 1, 0] at 0.75, bin [0.2, 0.3) labels [0, 0, 0, 1] at 0.25: ECE = 0, calibrated.
    (With every label 1, unsymmetrised, it would be 1 - mean p = 1 - 0.625 = 0.375.)

    One pair at d = ln 9 (p = 0.9): (0.9, 1) and (0.1, 0) lie in different bins, each alone:
    ECE = (0.1 + 0.1) / 2 = 0.1, under-confident.
    """
    ln3 = math.log(3)
    assert expected_calibration_error([ln3, -ln3], [0.0, 0.0]) == pytest.approx(0.25)
    assert expected_calibration_error([ln3, ln3, ln3, -ln3], [0.0] * 4) == pytest.approx(0.0, abs=1e-12)
    assert expected_calibration_error([math.log(9) + 1.0], [1.0]) == pytest.approx(0.1)
    assert math.isnan(expected_calibration_error([], []))


def test_diagnostic_keys_match_what_is_computed():
    scores = PairScores(*(torch.tensor(v, dtype=torch.float64) for v in (CHOSEN, REJECTED, CHOSEN_LEN, REJECTED_LEN)))
    diag = pair_diagnostics(scores)
    assert list(diag) == diagnostic_keys()
    assert diag["acc_len_diff_1..16"] == 1.0 and diag["pairs_len_diff_1..16"] == 1 and diag["tie_rate"] == 0.25


# --------------------------------------------------------------------------- #
# A short real run with an extra eval set
# --------------------------------------------------------------------------- #


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def diag_run(tmp_path_factory):
    """Six steps of the tiny model, evaluated at steps 3 and 6 on the main set and on "hard" (40 other pairs)."""
    tmp = tmp_path_factory.mktemp("diag")
    hard = write_jsonl(tmp / "hard.jsonl", generate_pairs(40, seed=7, split="test"))
    cfg = to_run_config(compose_run(FAST_TINY + [
        "train.max_steps=6", "train.logging.eval_steps=3", "train.logging.tensorboard=true", f"+data.extra_eval_files.hard=[{hard}]",
    ]))
    run_dir = tmp / "run"
    result = rm_train.train(cfg, run_dir)
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, run_dir, result, [e for e in evals if e["event"] == "eval"]


def test_every_eval_writes_the_diagnostics_of_every_set(diag_run):
    _, _, result, evals = diag_run
    assert [e["step"] for e in evals] == [3, 6]
    for e in evals:
        assert set(eval_keys("eval_")) <= e.keys() and set(eval_keys("eval_hard_")) <= e.keys()
        assert e["eval_pairs"] == 128 and e["eval_hard_pairs"] == 40
    assert {"eval_accuracy", "eval_reward_mean", "eval_reward_std", "eval_hard_ece"} <= result.keys()


@pytest.mark.parametrize("prefix", ["eval_", "eval_hard_"])
def test_logged_diagnostics_are_consistent(diag_run, prefix):
    """Bucket counts add up to the pairs and bucket accuracies, weighted by them, to the accuracy."""
    e = diag_run[3][-1]
    pairs = [e[f"{prefix}pairs_len_diff_{b}"] for b in BUCKETS]
    assert sum(pairs) == e[f"{prefix}pairs"]
    weighted = sum(n * e[f"{prefix}acc_len_diff_{b}"] for n, b in zip(pairs, BUCKETS) if n)
    assert weighted / sum(pairs) == pytest.approx(e[f"{prefix}accuracy"], abs=1e-12)
    for key in ("tie_rate", "ece", "longer_wins_accuracy"):
        assert 0 <= e[prefix + key] <= 1
    assert -1 <= e[prefix + "reward_length_corr"] <= 1
    assert e[prefix + "reward_std"] > 0 and e[prefix + "chosen_reward_std"] >= 0


def test_plot_is_a_png_of_every_set(diag_run):
    from matplotlib.image import imread

    path = diag_run[1] / "eval_plots.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = imread(path).shape
    assert width == 1200 and height == 2 * 380  # two rows of panels: eval and eval_hard, at 100 dpi


def test_tensorboard_gets_the_new_keys(diag_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(diag_run[1] / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"eval/eval_ece", "eval/eval_acc_len_diff_1..16", "eval/eval_reward_mean", "eval/eval_hard_tie_rate"} <= tags
    assert [s.step for s in acc.Scalars("eval/eval_hard_longer_wins_accuracy")] == [3, 6]


def test_evaluate_gathers_every_pairs_rewards_and_lengths(diag_run):
    """evaluate on the saved model: the vectors are in eval-set order (each reward equals the pair scored
    alone), lengths are the real token counts, and the metrics are functions of these vectors."""
    cfg, run_dir, _, evals = diag_run
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "final").eval()
    tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data))
    eval_set, _ = build_split(cfg.data, tokenizer, "eval")
    engine = AccelerateEngine(cpu=True, precision="32-true", gradient_accumulation_steps=1, max_grad_norm=1.0)
    metrics, scores = evaluate(model, eval_set, PairCollator(tokenizer.pad_token_id), 48, engine,
                               build_loss(cfg.train, cfg.data))

    assert len(scores) == metrics["eval_pairs"] == len(eval_set)
    assert scores.chosen_lengths.tolist() == [len(x) for x in eval_set["chosen_input_ids"]]
    assert scores.rejected_lengths.tolist() == [len(x) for x in eval_set["rejected_input_ids"]]
    with torch.no_grad():
        for i in (0, 57, len(eval_set) - 1):
            alone = model(input_ids=torch.tensor([eval_set[i]["rejected_input_ids"]])).logits.item()
            assert scores.rejected[i].item() == pytest.approx(alone, abs=1e-5)
    rewards = torch.cat([scores.chosen, scores.rejected])
    assert metrics["eval_reward_mean"] == pytest.approx(rewards.mean().item(), abs=1e-12)
    assert metrics["eval_reward_std"] == pytest.approx(rewards.std(correction=0).item(), abs=1e-12)
    assert metrics["eval_accuracy"] == (scores.chosen > scores.rejected).double().mean().item()
    assert metrics["eval_margin"] == pytest.approx((scores.chosen - scores.rejected).mean().item(), abs=1e-6)
    assert 0 <= metrics["eval_tie_rate"] <= 1
    # The saved model gives the run's own final evaluation.
    assert metrics["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)
    assert metrics["eval_reward_mean"] == pytest.approx(evals[-1]["eval_reward_mean"], rel=1e-5, abs=1e-6)


# --------------------------------------------------------------------------- #
# Config: names and files of the extra sets
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "override,needle",
    [
        ("+data.extra_eval_files.chosen=[x.jsonl]", "data.extra_eval_files.chosen: its metric eval_chosen_reward_mean "
                                                     "is also a metric of the main eval set"),
        ("+data.extra_eval_files.hard=[]", "data.extra_eval_files.hard lists no file"),
        ("+data.extra_eval_files={a/b:[x.jsonl]}", "data.extra_eval_files.a/b: a name is letters, digits"),
    ],
)
def test_validate_rejects_bad_extra_eval_sets(tiny_cfg, override, needle):
    with pytest.raises(ConfigError) as info:
        validate(tiny_cfg(override), world_size=1)
    assert needle in str(info.value)


def test_two_extra_names_whose_keys_collide_are_rejected(tiny_cfg):
    """"a" reports eval_a_chosen_reward_mean as its chosen_reward_mean, "a_chosen" as its reward_mean."""
    with pytest.raises(ConfigError, match="data.extra_eval_files.a_chosen: its metric eval_a_chosen_reward_mean is "
                                          "also a metric of data.extra_eval_files.a;"):
        validate(tiny_cfg("+data.extra_eval_files={a:[x.jsonl],a_chosen:[y.jsonl]}"), world_size=1)


def test_missing_extra_file_names_its_own_key(tiny_cfg, tmp_path):
    cfg = tiny_cfg(f"+data.extra_eval_files.hard=[{tmp_path}/nope.jsonl]")
    with pytest.raises(FileNotFoundError, match=r"data\.extra_eval_files\.hard: no file matches"):
        build_extra_eval_sets(cfg.data, run_tokenizer(cfg.model, train_pairs(cfg.data)))


# --------------------------------------------------------------------------- #
# Two processes
# --------------------------------------------------------------------------- #

WORKER = """
import json, sys
import datasets, torch
from transformers import AutoModelForSequenceClassification
from rm.data.collator import PairCollator
from rm.distributed.engine import AccelerateEngine
from rm.modelling.loss import build_loss
from rm.modelling.loss import PairLoss
from rm.evaluation.metrics import evaluate

model_dir, data_dir, pad, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
engine = AccelerateEngine(cpu=True, precision="32-true", gradient_accumulation_steps=1, max_grad_norm=1.0)
model = AutoModelForSequenceClassification.from_pretrained(model_dir)
loss = PairLoss(center_rewards_coefficient=0.0, uses_margin=False)  # the tiny run's
metrics, s = evaluate(model, datasets.load_from_disk(data_dir), PairCollator(pad), 8, engine, loss)
vectors = [v.tolist() for v in (s.chosen, s.rejected, s.chosen_lengths, s.rejected_lengths)]
with open(f"{out}/rank{engine.process_index}.json", "w") as f:
    json.dump({"metrics": metrics, "vectors": vectors}, f)
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_gather_the_same_vectors_as_one(diag_run, tmp_path):
    """33 pairs over 2 gloo processes (17 + 16 in batches of 8: rank 1 runs one padding forward):
    every rank ends with all 33 pairs' rewards and lengths, equal to one process's."""
    cfg, run_dir, _, _ = diag_run
    tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data))
    eval_set = build_split(cfg.data, tokenizer, "eval")[0].select(range(33))
    eval_set.save_to_disk(tmp_path / "pairs")
    (tmp_path / "worker.py").write_text(WORKER)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
         str(tmp_path / "worker.py"), str(run_dir / "final"), str(tmp_path / "pairs"), str(tokenizer.pad_token_id),
         str(tmp_path)],
        cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "final")
    engine = AccelerateEngine(cpu=True, precision="32-true", gradient_accumulation_steps=1, max_grad_norm=1.0)
    one, s = evaluate(model, eval_set, PairCollator(tokenizer.pad_token_id), 8, engine, build_loss(cfg.train, cfg.data))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["vectors"][2:] == [s.chosen_lengths.tolist(), s.rejected_lengths.tolist()]
        assert got["vectors"][0] == pytest.approx(s.chosen.tolist(), abs=1e-5)
        assert got["vectors"][1] == pytest.approx(s.rejected.tolist(), abs=1e-5)
        assert got["metrics"]["eval_pairs"] == 33
        assert got["metrics"]["eval_reward_mean"] == pytest.approx(one["eval_reward_mean"], abs=1e-5)
