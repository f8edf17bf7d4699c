"""Does rm's reward model learn what TRL's RewardTrainer learns, on pairs whose preference can only be read against
the prompt?

    python benchmarks/learning_vs_trl.py                                  # trl + rm, single-turn, 400 steps, seed 1
    python benchmarks/learning_vs_trl.py --data single multi --seeds 1 2 3 --steps 1200 --jobs 2 \\
        --only trl rm rm-cosine trl-cosine --out-json learning.json --write-doc learning.md
    python benchmarks/learning_vs_trl.py --only rm-padded rm-padded-grouped rm-packed rm-packed-grouped \\
        rm-prefix-shared rm-prefix-shared-grouped rm-prefix-shared-packed rm-prefix-shared-packed-grouped

**Data** (``benchmarks/learning_data.py``): HH-format transcripts where the chosen answer answers the question the
human asked (names its entity and aspect) and the rejected one answers another question of the same distribution;
every answer text is chosen exactly as often as it is rejected, so nothing in the answer alone tells the sides apart.
``--data single``: one exchange; ``--data multi``: 2-6 earlier exchanges (chit-chat, earlier questions) before the
final question, the prompt then holding most tokens. Eval pairs use (question, answer) combinations unseen in
training. The data is fixed per data set (``--data-seed``); ``--seeds`` vary the training seed (init and order).
Each data set has its own defaults (``learning_data.SINGLE_DEFAULTS`` / ``MULTI_DEFAULTS``), so neither needs a data
flag: single-turn ``--topical-scale 1``; multi-turn ``--topical-scale 2 --distractor 0 --history-scale 0
--history-decay 0.5 --history-apart 1`` (the final exchange names its subject about twice as often; 2-6 earlier
exchanges, P(k) in proportion to 0.5^(k-2), without topical sentences, about other categories than the pair's, none
about the rejected answer's entity). Those are what TRL learns at 400 steps (0.851 / 0.893 / 0.847 at seeds 1-3,
where the first multi-turn set stayed at 0.52): ``learning_data``'s doc, "Multi-turn defaults". A flag overrides the
default for every ``--data`` of the run.

**Runs at once**: ``--jobs N`` runs N child runs at a time (each with ``--threads`` threads: N x threads should fit
the cores), the likely longest first (TRL's runs, then the data set of more tokens); the results and tables are the
same as one at a time, tokens/s and times are then under the load of the others.

**Tokenizer**: a byte-level BPE trained here on the training texts (``<pad> <unk> <s> </s>`` = ids 0-3), saved as a
``PreTrainedTokenizerFast``; ``--style bos`` (default) adds ``<s>`` before each text as Llama's and Mistral's do,
``--style bos_eos`` adds ``<s> ... </s>``. Both trainers load that directory as their users would: TRL with
``AutoTokenizer.from_pretrained`` (then its own ``add_eos`` and the tokenizer's special tokens), rm with
``model.tokenizer=<dir>`` (rm's own reward convention, whatever it is in the tree).

**Model and run**: Mistral architecture, 4 layers, hidden 256, MLP 1024, 4 heads, 2 KV heads, head_dim 64, vocabulary
the tokenizer's size rounded up to a multiple of 64, 1024 positions, random init after ``set_seed(seed)`` (at one
seed, TRL's model and rm's are the same weights: checked against rm's saved model after a step at learning rate 0,
every tensor equal, 2026-11-29); fp32;
8 pairs a step; lr 3e-4; ``--steps`` (400); max length 512 (the data stays under it: the count of longer sides is
printed). TRL: ``RewardConfig`` defaults except what must match (lr, batch, steps, max_length, seed, CPU, fp32,
evaluation, no checkpoints, and no gradient checkpointing, which rm's automatic layout also turns off here: it only
changes speed), so TRL's own schedule (linear, no warm-up in TRL 1.16 / transformers 5). rm: ``python -m rm.train``
with the overrides in :func:`rm_command`, its own schedule (linear, no warm-up: TRL's, rm's default since
2026-11-29) and no layout flag, unless a row says otherwise (:data:`ROWS`).

**Rows** (``--only``; :data:`ROWS`): ``trl``; ``rm`` (no layout flag); ``rm-cosine`` (rm with
``train.optim.lr_scheduler_type=cosine train.optim.warmup_ratio=0.03``, rm's default before 2026-11-29); ``trl-cosine`` (TRL with
``lr_scheduler_type="cosine", warmup_steps=0.03``; transformers 5 reads a ``warmup_steps`` below 1 as a ratio and
rounds up as rm does); and rm's layouts, each pinned by putting its knobs on the command line, which
``train.layout=auto`` then keeps as the user's (``rm/plan/auto.py:user_knobs``) while it still picks the
micro-batch, checkpointing and token budget: ``rm-padded`` (``train.share_prefix=false train.packing=false``),
``rm-packed`` (``train.share_prefix=false train.packing=true``), ``rm-prefix-shared`` (``train.share_prefix=true
train.packing=false``: one row per pair), ``rm-prefix-shared-packed`` (both true, what ``auto`` picks on a CPU here),
each with ``train.group_by_length=false``, and with ``=true`` as ``...-grouped``. The table says what each ran.

**Read-outs**: eval accuracy and loss on the 504 eval pairs after the last step: TRL's ``evaluate()``
(``eval_accuracy``, ``eval_loss``), rm's ``eval`` record of the last step in ``<run dir>/metrics.jsonl``. Real
tokens/s: non-pad tokens of chosen + rejected over training time (evaluation excluded): TRL's own ``num_tokens``
(its attention-mask sum over the steps) over the time from ``on_train_begin`` to the last ``on_step_end`` less the
evaluations; rm's logged windows of ``metrics.jsonl`` (``tokens_per_s`` x window time), less its evaluations. Both
count BOS and EOS where the trainer adds them; rm counts a shared prompt twice, as an unshared trainer computes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_cli_vs_trl import child_env  # noqa: E402  (OMP/MKL threads, PYTHONPATH for the children)
from learning_data import MULTI_DEFAULTS, SINGLE_DEFAULTS, STYLES, data_knobs, write_data  # noqa: E402

MAX_LENGTH, PAIRS_PER_STEP, LR, EVAL_BATCH = 512, 8, 3e-4, 8
SHAPE = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 1024}
# rm's model.* defaults (rm/foundations/config.py:ModelConfig), given to TRL's model too so that both build the same config
CONFIG_EXTRA = {"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
# Cosine after a 3% warm-up: rm's default schedule until 2026-11-29 (benchmarks/results/learning.md, "Schedules"), kept as a row
TRL_COSINE = {"lr_scheduler_type": "cosine", "warmup_steps": 0.03}  # a warmup_steps below 1 is a ratio in transformers 5
RM_COSINE = ["train.optim.lr_scheduler_type=cosine", "train.optim.warmup_ratio=0.03"]


def _layout(share: bool, packing: bool, grouped: bool) -> list:
    """Overrides that pin a layout: the three knobs on the command line, so train.layout=auto keeps them (a knob set
    on the command line is the user's: rm/plan/auto.py:user_knobs); micro-batch, checkpointing and token budget stay
    rm's automatic choice."""
    return [f"train.share_prefix={str(share).lower()}", f"train.packing={str(packing).lower()}",
            f"train.group_by_length={str(grouped).lower()}"]


# row: (trainer, settings). rm: Hydra overrides on top of rm_command; TRL: RewardConfig fields.
ROWS = {
    "trl": ("trl", {}),
    "rm": ("rm", []),  # no layout flag: train.layout=auto picks every knob
    "rm-cosine": ("rm", RM_COSINE),
    "trl-cosine": ("trl", TRL_COSINE),
    **{f"rm-{name}{'-grouped' if grouped else ''}": ("rm", _layout(share, packing, grouped))
       for name, share, packing in (("padded", False, False), ("packed", False, True),
                                    ("prefix-shared", True, False), ("prefix-shared-packed", True, True))
       for grouped in (False, True)},
}


def vocab_rows(tokenizer_size: int) -> int:
    return 64 * math.ceil(tokenizer_size / 64)


def rm_command(data: dict, row_overrides: list, steps: int, seed: int, eval_every: int, run_dir: Path) -> list:
    """``python -m rm.train`` as a user with these files and this model shape runs it.

    Not ``experiment=tiny``: it sets ``train.share_prefix``, ``train.micro_batch_size`` and
    ``train.gradient_checkpointing`` away from their schema defaults, which ``train.layout=auto`` then keeps as the
    user's; its groups are named one by one instead (model=tiny data=local hardware=cpu memory_profile=full).
    """
    shape = [f"model.{k}={v}" for k, v in SHAPE.items()]
    return [
        sys.executable, "-m", "rm.train",
        "model=tiny", "data=local", "hardware=cpu", "memory_profile=full",
        "model.name=mistral_4x256", f"model.tokenizer={data['tokenizer_dir']}", f"model.vocab_size={data['vocab_rows']}",
        *shape,
        "data.format=hh", f"data.train_files=[{data['train_file']}]", f"data.eval_files=[{data['eval_file']}]",
        f"data.max_length={MAX_LENGTH}",
        "train.precision=32-true", f"train.optim.learning_rate={LR}", f"train.global_batch_size={PAIRS_PER_STEP}",
        f"train.max_steps={steps}", f"train.seed={seed}", f"train.eval_batch_size={EVAL_BATCH}",
        f"train.logging.eval_steps={eval_every}", "train.checkpoint.save_steps=0", "train.logging.logging_steps=10",
        f"hydra.run.dir={run_dir}", *row_overrides,
    ]


def run_rm(row: str, data: dict, args, seed: int, workdir: Path) -> dict:
    run_dir = workdir / f"{row}-seed{seed}"
    command = rm_command(data, ROWS[row][1], args.steps, seed, args.eval_every, run_dir)
    log_path = workdir / f"{row}-seed{seed}.out"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run(command, cwd=ROOT, env=child_env(args.threads), stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{row} seed {seed} failed (exit {done.returncode}):\n  {' '.join(command)}\n{log_path.read_text()[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["event"] == "train"}
    evals = {r["step"]: r for r in records if r["event"] == "eval"}
    # Each logged window: tokens_per_s x its seconds. A window after an evaluation holds the evaluation's time
    # (rm restarts the window at the logging step, then evaluates): taken out here, as the eval record's time less
    # the train record's of the same step.
    seconds = tokens = 0.0
    previous = 0
    for step in sorted(train):
        window = train[step]["step_time_s"] * (step - previous)
        seconds += window
        tokens += train[step]["tokens_per_s"] * window
        previous = step
    seconds -= sum(e["time"] - train[s]["time"] for s, e in evals.items() if s in train and s < args.steps)
    # rm's own token count of the training sides against TRL's (BOS + text + EOS): which convention rm tokenised with
    audit = json.loads((run_dir / "data_audit.json").read_text())["splits"]["train"]
    rm_tokens = sum(audit["lengths"][side]["kept"]["mean"] for side in ("chosen", "rejected")) * audit["pairs_out"]
    per_side = (rm_tokens - data["train_tokens"]) / (2 * audit["pairs_out"])
    summary = (run_dir / "train.log").read_text()
    layout = re.search(r"^\s+layout\s+(.+)$", summary, re.M)
    return {"eval_accuracy": evals[args.steps]["eval_accuracy"], "eval_loss": evals[args.steps]["eval_loss"],
            "curve": {s: e["eval_accuracy"] for s, e in sorted(evals.items())},
            "real_tokens": round(tokens), "train_s": seconds, "wall_s": wall,
            "layout": layout.group(1).strip() if layout else None, "command": " ".join(command[1:]),
            "tokens_per_side_vs_trl": round(per_side, 3)}


def run_trl(row: str, data: dict, args, seed: int, workdir: Path) -> dict:
    out = workdir / f"{row}-seed{seed}.json"
    job = {"data": data, "steps": args.steps, "seed": seed, "threads": args.threads, "eval_every": args.eval_every,
           "schedule": ROWS[row][1], "output_dir": str(workdir / f"{row}-seed{seed}"), "out": str(out)}
    job_file = workdir / f"{row}-seed{seed}.job.json"
    job_file.write_text(json.dumps(job))
    log_path = workdir / f"{row}-seed{seed}.out"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, __file__, "--trl-child", str(job_file)], cwd=ROOT,
                              env=child_env(args.threads), stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{row} seed {seed} failed (exit {done.returncode}):\n{log_path.read_text()[-3000:]}")
    settings = ", ".join(f"{k}={v}" for k, v in ROWS[row][1].items())
    return {**json.loads(out.read_text()), "wall_s": wall, "layout": None,
            "command": f"RewardTrainer, RewardConfig defaults{' + ' + settings if settings else ''}"}


def trl_child(job_file: str) -> None:
    """TRL's RewardTrainer on the JSONL files, as a TRL user runs it: text columns, AutoTokenizer, TRL's tokenisation."""
    job = json.loads(Path(job_file).read_text())
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback, set_seed
    from trl import RewardConfig, RewardTrainer

    torch.set_num_threads(job["threads"])
    data, steps, every = job["data"], job["steps"], job["eval_every"]
    tokenizer = AutoTokenizer.from_pretrained(data["tokenizer_dir"])
    config = AutoConfig.for_model("mistral", vocab_size=data["vocab_rows"], num_labels=1,
                                  pad_token_id=tokenizer.pad_token_id, **SHAPE, **CONFIG_EXTRA)
    set_seed(job["seed"])  # as rm does before it builds its model from the shape
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    train = datasets.load_dataset("json", data_files=data["train_file"], split="train")
    eval_set = datasets.load_dataset("json", data_files=data["eval_file"], split="train")

    class Clock(TrainerCallback):
        begin, ends, evals = 0.0, {}, []

        def on_train_begin(self, args, state, control, **kwargs):
            Clock.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            Clock.ends[state.global_step] = time.perf_counter()

        def on_evaluate(self, args, state, control, **kwargs):
            Clock.evals.append((state.global_step, time.perf_counter()))

    config = RewardConfig(
        output_dir=job["output_dir"], learning_rate=LR, per_device_train_batch_size=PAIRS_PER_STEP, max_steps=steps,
        max_length=MAX_LENGTH, seed=job["seed"], report_to=[], use_cpu=True, bf16=False,
        per_device_eval_batch_size=EVAL_BATCH, eval_strategy="steps" if every else "no", eval_steps=every or None,
        save_strategy="no", gradient_checkpointing=False, **job["schedule"])
    trainer = RewardTrainer(model=model, args=config, train_dataset=train, eval_dataset=eval_set,
                            processing_class=tokenizer, callbacks=[Clock()])
    dropped = {"train": len(train) - len(trainer.train_dataset), "eval": len(eval_set) - len(trainer.eval_dataset)}
    first = trainer.train_dataset[0]["chosen_ids"]  # what TRL's own tokenisation made of a text: BOS ... EOS
    trainer.train()
    history = trainer.state.log_history
    curve = {h["step"]: h for h in history if "eval_accuracy" in h}
    final = curve.get(steps) or {**trainer.evaluate(), "step": steps}
    curve[steps] = final
    tokens = [h["num_tokens"] for h in history if "num_tokens" in h and "loss" in h and h["step"] == steps]
    last = Clock.ends[steps]
    paused = sum(t - Clock.ends[s] for s, t in Clock.evals if s < steps)
    Path(job["out"]).write_text(json.dumps({
        "eval_accuracy": final["eval_accuracy"], "eval_loss": final["eval_loss"],
        "curve": {s: h["eval_accuracy"] for s, h in sorted(curve.items())},
        "real_tokens": int(tokens[-1] if tokens else trainer._total_train_tokens), "train_s": last - Clock.begin - paused,
        "dropped_over_max_length": dropped, "first_chosen_ids": first[:3] + ["..."] + first[-3:],
    }))


def prepare(kind: str, args, workdir: Path) -> dict:
    """The data set's files and tokenizer, and what the table says about them."""
    out = workdir / kind
    k = data_knobs(kind, **{name: getattr(args, name) for name in MULTI_DEFAULTS})  # the kind's defaults, or flags
    k["history_apart"] = bool(k["history_apart"])
    made = write_data(kind, out, args.data_seed, args.train_pairs, args.eval_pairs, args.vocab_size, args.style,
                      k["distractor"], args.entities, args.filler_scale, args.same_category, k["topical_scale"],
                      k["history_scale"], k["history_decay"], k["history_apart"])
    tokenizer = made["tokenizer"]
    train, evals = made["train"], made["eval"]
    over = train["over_511"] + evals["over_511"]
    about = (f"{train['pairs']:,} train / {evals['pairs']:,} eval pairs (data seed {args.data_seed}; {args.entities} "
             f"entities x 10 categories, topical scale {k['topical_scale']}, filler scale {args.filler_scale}, "
             f"rejected of the same category {args.same_category:.0%}"
             + (f"; 2-6 earlier exchanges, P(k) in proportion to {k['history_decay']}^(k-2), their topical "
                f"sentences scaled by {k['history_scale']}"
                f"{', of categories apart from the pair' + chr(39) + 's' if k['history_apart'] else ''}, "
                f"distractor {k['distractor']}" if kind == "multi" else "")
             + f"); tokens per side "
             f"as TRL counts them (BOS, text, EOS): median {train['median_tokens']:.0f}, p90 {train['p90_tokens']}, "
             f"max {max(train['max_tokens'], evals['max_tokens'])}; sides over {MAX_LENGTH - 1}: {over}; "
             f"shared prompt : answer tokens {train['prompt_to_answer']:.2f} : 1; every answer text chosen as often "
             f"as rejected (largest imbalance {max(train['answer_imbalance'], evals['answer_imbalance'])}); eval final "
             f"questions seen verbatim in train: {evals['final_question_in_train']}; tokenizer {made['vocab']} tokens "
             f"(style {args.style}: {STYLES[args.style]}), embedding rows {vocab_rows(made['vocab'])}")
    if over:
        print(f"WARNING: {over} sides exceed {MAX_LENGTH - 1} tokens: TRL drops those pairs, rm truncates them", flush=True)
    return {"train_file": str(out / "train.jsonl"), "eval_file": str(out / "eval.jsonl"),
            "tokenizer_dir": str(out / "tokenizer"), "vocab": len(tokenizer), "vocab_rows": vocab_rows(len(tokenizer)),
            "train_tokens": train["tokens"],
            "about": about}


def fmt(values, spec):
    return ", ".join(format(v, spec) for v in values)


def table(kind: str, data: dict, results: dict, args) -> str:
    lines = [f"### {kind}-turn data, {args.steps} steps", "", data["about"] + ".", "",
             "| row | eval accuracy: median (per seed) | eval loss: median (per seed) | real tokens/s: median "
             "| training s | whole run s | load 1-min before -> after | settings |",
             "|---|---|---|---|---|---|---|---|"]
    for row, runs in results.items():
        acc, loss = [r["eval_accuracy"] for r in runs], [r["eval_loss"] for r in runs]
        tps = statistics.median(r["real_tokens"] / r["train_s"] for r in runs)
        settings = " ".join(ROWS[row][1]) if ROWS[row][0] == "rm" else (
            ", ".join(f"{k}={v}" for k, v in ROWS[row][1].items()) or "RewardConfig defaults")
        ran = runs[0].get("layout")
        if ran:  # rm's ids per side against TRL's BOS + text + EOS: 0 when rm tokenises as TRL does
            ran += f"; ids per side vs TRL's {runs[0]['tokens_per_side_vs_trl']:+.2f}"
        lines.append(
            f"| {row} | {statistics.median(acc):.3f} ({fmt(acc, '.3f')}) | {statistics.median(loss):.4f} "
            f"({fmt(loss, '.4f')}) | {tps:,.0f} | {statistics.median(r['train_s'] for r in runs):.0f} "
            f"| {statistics.median(r['wall_s'] for r in runs):.0f} "
            f"| {fmt([r['load'][0] for r in runs], '.2f')} -> {fmt([r['load'][1] for r in runs], '.2f')} "
            f"| {settings or 'no layout flag'}{f'; ran: {ran}' if ran else ''} |")
    if args.eval_every:
        steps = sorted({int(s) for runs in results.values() for r in runs for s in r["curve"]})
        lines += ["", "Eval accuracy during training (median over seeds):", "",
                  "| row | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---|" * len(steps)]
        for row, runs in results.items():
            cells = [statistics.median(r["curve"][str(s)] if str(s) in r["curve"] else r["curve"][s] for r in runs)
                     for s in steps]
            lines.append(f"| {row} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def git_state() -> str:
    """HEAD and whether rm's sources differ from it (read-only: no index refresh)."""
    def git(*a):
        return subprocess.run(["git", "--no-optional-locks", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    changed = git("diff", "--stat", "HEAD", "--", "rm", "conf").splitlines()
    subject = git("log", "-1", "--format=%s")
    head = f"{git('log', '-1', '--format=%h')} ({subject[:60]}{'...' if len(subject) > 60 else ''})"
    return head + (f", with uncommitted changes to rm/ and conf/ ({changed[-1].strip()})" if changed else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", nargs="+", choices=["single", "multi"], default=["single"])
    parser.add_argument("--only", nargs="+", choices=list(ROWS), default=["trl", "rm"], metavar="ROW",
                        help=f"rows to run, in this order: {', '.join(ROWS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], help="training seeds (init and order); medians")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", dest="eval_every", type=int, default=0,
                        help="also evaluate every N steps (a multiple of 10; 0: at the end only)")
    parser.add_argument("--data-seed", dest="data_seed", type=int, default=0)
    parser.add_argument("--train-pairs", dest="train_pairs", type=int, default=2000)
    # 504, not 500: TRL's eval_accuracy is the mean of its batches' accuracies, exact only when every batch is full
    parser.add_argument("--eval-pairs", dest="eval_pairs", type=int, default=504, help="a multiple of 8")
    parser.add_argument("--distractor", type=float, default=None,
                        help="multi-turn: chance that an earlier exchange is about the rejected answer's entity "
                             f"({MULTI_DEFAULTS['distractor']})")
    parser.add_argument("--history-scale", dest="history_scale", type=float, default=None,
                        help="multi-turn: scales the topical sentences of the earlier exchanges "
                             f"({MULTI_DEFAULTS['history_scale']}: none)")
    parser.add_argument("--history-decay", dest="history_decay", type=float, default=None,
                        help="multi-turn: P(k earlier exchanges) in proportion to decay^(k-2), k = 2..6; 1: uniform "
                             f"({MULTI_DEFAULTS['history_decay']})")
    parser.add_argument("--history-apart", dest="history_apart", type=int, choices=[0, 1], default=None,
                        help="multi-turn: 1: the earlier exchanges' subjects are of other categories than the final "
                             f"question's and the rejected answer's ({int(MULTI_DEFAULTS['history_apart'])})")
    parser.add_argument("--entities", type=int, default=2, help="entities per category (10 categories, at most 12)")
    parser.add_argument("--topical-scale", dest="topical_scale", type=float, default=None,
                        help="scales the median count of sentences naming the subject after the (final) question and "
                             f"in answers (single {SINGLE_DEFAULTS['topical_scale']}, multi "
                             f"{MULTI_DEFAULTS['topical_scale']})")
    parser.add_argument("--filler-scale", dest="filler_scale", type=float, default=0.0,
                        help="scales the median count of filler sentences that name no subject (0: none)")
    parser.add_argument("--same-category", dest="same_category", type=float, default=0.5,
                        help="chance that the rejected answer's entity is of the asked entity's category")
    parser.add_argument("--style", choices=list(STYLES), default="bos", help="tokenizer post-processor")
    parser.add_argument("--vocab-size", dest="vocab_size", type=int, default=3000, help="BPE vocabulary, at most")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once (each a child with --threads threads): N x threads should fit the cores")
    parser.add_argument("--out-json", dest="out_json", help="raw results, rewritten after every run")
    parser.add_argument("--write-doc", dest="write_doc", metavar="PATH", help="write the markdown here")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (data, run directories, logs)")
    parser.add_argument("--trl-child", dest="trl_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(args.trl_child)
    if args.eval_pairs % EVAL_BATCH:
        parser.error(f"--eval-pairs must be a multiple of {EVAL_BATCH}: TRL averages its batches' accuracies")
    if args.eval_every % 10:
        parser.error("--eval-every must be a multiple of 10 (rm's logging steps)")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    started, load_start = time.time(), os.getloadavg()
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="learning_vs_trl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    saved, prepared, sections = {}, {}, []
    runs = [(kind, row, seed) for kind in args.data for row in args.only for seed in args.seeds]
    done = 0

    def run_one(kind: str, row: str, seed: int) -> dict:
        load = os.getloadavg()[0]
        runner = run_trl if ROWS[row][0] == "trl" else run_rm
        r = runner(row, prepared[kind], args, seed, workdir / kind)
        r.update(seed=seed, load=(load, os.getloadavg()[0]))
        return r

    try:
        for kind in args.data:
            prepared[kind] = data = prepare(kind, args, workdir)
            print(f"{kind}: {data['about']}", flush=True)
            saved[kind] = {"about": data["about"], "runs": {row: [] for row in args.only}}
        # --jobs runs at once, each its own child; the likely longest start first (TRL's, about twice rm's time here,
        # then the data set of more tokens), so that no long run is left alone at the end. Results are filed by data
        # set, row and seed whatever order they finish in.
        def cost(run):
            return prepared[run[0]]["train_tokens"] * (2 if ROWS[run[1]][0] == "trl" else 1)

        pool = ThreadPoolExecutor(max_workers=args.jobs)
        try:
            futures = {pool.submit(run_one, *run): run for run in sorted(runs, key=cost, reverse=True)}
            for future in as_completed(futures):
                kind, row, seed = futures[future]
                r = future.result()
                results = saved[kind]["runs"][row]
                results.append(r)
                results.sort(key=lambda x: args.seeds.index(x["seed"]))
                done += 1
                print(f"[{done}/{len(runs)}] {kind} {row} seed {seed}: eval accuracy {r['eval_accuracy']:.3f}, loss "
                      f"{r['eval_loss']:.4f}; {r['real_tokens'] / r['train_s']:,.0f} real tokens/s, training "
                      f"{r['train_s']:.0f} s, whole run {r['wall_s']:.0f} s; load {r['load'][0]:.2f} -> "
                      f"{r['load'][1]:.2f}" + (f"; ids per side vs TRL's {r['tokens_per_side_vs_trl']:+.2f}; "
                                               f"{r['layout']}" if r.get("layout") else ""), flush=True)
                if args.out_json:
                    Path(args.out_json).write_text(json.dumps(saved, indent=1))
        finally:  # a failed run: the runs not started yet are dropped, those running finish
            pool.shutdown(wait=True, cancel_futures=True)
        for kind in args.data:
            sections.append(table(kind, prepared[kind], saved[kind]["runs"], args))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    load_end = os.getloadavg()
    import torch
    import transformers
    import trl

    footer = (f"`python benchmarks/learning_vs_trl.py {' '.join(sys.argv[1:])}`, "
              f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))}-{time.strftime('%H:%M UTC', time.gmtime())} "
              f"({time.time() - started:.0f} s); {platform.node() or 'machine'}: {os.cpu_count()} CPU cores, "
              f"{platform.processor() or platform.machine()}, {args.threads} thread(s) per run (OMP_NUM_THREADS), "
              f"{args.jobs} run(s) at a time; "
              f"load average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_start)} before, "
              f"{'/'.join(f'{x:.2f}' for x in load_end)} after; torch {torch.__version__}, transformers "
              f"{transformers.__version__}, trl {trl.__version__}; rm at {git_state()}.")
    text = "\n\n".join(sections) + "\n\n" + footer + "\n"
    print("\n" + text)
    if args.out_json:
        Path(args.out_json).write_text(json.dumps({**saved, "footer": footer}, indent=1))
    if args.write_doc:
        Path(args.write_doc).write_text(text)
        print(f"wrote {args.write_doc}")


if __name__ == "__main__":
    main()
