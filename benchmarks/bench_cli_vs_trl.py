"""An outsider's check of rm against TRL's RewardTrainer: rm only through its CLI, on data and a model shape it was
not tuned on, with throughput measured by this script rather than taken from rm's report.

    python benchmarks/bench_cli_vs_trl.py --smoke                  # 6 steps, 16 eval pairs: does everything run?
    python benchmarks/bench_cli_vs_trl.py                          # the measurement: both data sets, 64 steps each
    python benchmarks/bench_cli_vs_trl.py --data multi-turn --keep /tmp/bench   # one data set; keep every file

TRL comes with rm's ``bench`` extra (``pip install -e '.[bench]'``). Run it on an otherwise idle machine: the load
average printed beside each trainer says how idle it was. The default run (three turns of each rm layout) takes
about 20 minutes on an idle 2-core CPU.

``benchmarks/bench_vs_trl.py`` calls rm's internals on token ids made by rm's own generators. Here instead:

* **Data** (HH-RLHF layout, JSONL): conversations about Python standard-library functions and classes, whose
  answers are their docstrings (``inspect.getdoc``, available offline on any machine; the set depends on the Python
  version, which is printed with a digest of the data). Multi-turn pairs have 1 to 4 earlier question/answer
  exchanges; chosen and rejected share every turn but the last answer. The chosen answer is the docstring of the
  function the last question asks about. The rejected one is, half the time, an evasive reply naming that function
  (a cue visible in the answer alone, which is also much shorter) and otherwise the docstring of an unrelated function of another module (two
  well-formed docstrings: only matching the answer against the question tells them apart, a harder skill). The eval pairs are built from functions that no training pair mentions, and this script reports
  their accuracy per kind. Single-turn pairs are the last exchange alone.
* **Tokenizer**: a byte-level BPE trained here with the ``tokenizers`` library on the training texts (rm's default
  scheme for a model without a tokenizer: ``<pad> <unk> <s> </s>``, the 256 bytes, then merges, at most 4096
  tokens), saved with ``save_pretrained`` in a directory of its own; rm (``model.tokenizer=<dir>``) and TRL
  (``AutoTokenizer``) read the same files, and this script counts tokens with what they read.
* **Model**: a Llama-architecture reward model (3 layers, hidden 384, 6 heads, 2 KV heads, MLP 1024;
  bench_vs_trl.py uses a 4 x 256 Mistral). Not Qwen2: transformers 5 loads any tokenizer beside a Qwen2
  ``config.json`` as a ``Qwen2Tokenizer``, which re-splits this BPE's text, and rm refuses such a pair), random init from seed 0, saved with ``save_pretrained``; both trainers
  load that directory (rm: ``model.pretrained=<dir>``), so both start from the same weights.
* **rm** runs as ``python -m rm.train data=local data.train_files=[...] model.pretrained=<dir> ...`` in a subprocess,
  with no layout flags (``train.layout=auto`` picks them), with the README's CPU recommendation
  (``train.share_prefix=true train.packing=true train.max_tokens_per_micro_batch=4096``) and with the schema's default
  layout pinned (``train.layout=given``: no prefix sharing, group_by_length, micro-batches of 4); the last two
  without gradient checkpointing, as TRL runs. **TRL** runs ``RewardTrainer`` in a subprocess of this script, configured as
  bench_vs_trl.py does: 8 pairs per step, max length 512, AdamW lr 1e-3 with linear decay after 3 warm-up steps,
  clipping at 1, fp32, no gradient checkpointing, no dropout, the same threads (``OMP_NUM_THREADS`` for both).

What is measured:

* **whole command**: wall time of each trainer's subprocess, start-up, data, evaluation and saving included;
* **training throughput**: the run is two epochs of ``--steps / 2`` steps each, and the timed window is the second
  epoch, from the end of step ``--steps / 2`` to the end of the last step. Whatever order a trainer draws the pairs
  in, one epoch trains every training pair exactly once, so the window's real tokens are the sum, over the training
  set, of the chosen + rejected tokens (the text's own tokens, as TRL counts them; a prompt shared by rm counts
  twice), computed here from the data and the tokenizer. The window's ends are timestamps this script takes: for
  TRL a ``TrainerCallback`` at ``on_step_end``; for rm the modification time of ``metrics.jsonl`` when its line for
  that step appears (``train.logging.logging_steps`` is set to the epoch, and the file is polled every 20 ms). rm's own
  ``tokens_per_s`` for that window and TRL's own ``num_tokens`` count (which includes the EOS TRL appends to each
  text) are printed beside the independent figures;
* **eval accuracy** on the held-out pairs after the same steps: each trainer's own (rm's ``eval_accuracy`` in
  ``metrics.jsonl``, TRL's ``evaluate()``), and this script's, scoring each saved model with plain transformers
  (``AutoModelForSequenceClassification``), each read where both trainers train it (the EOS each
  appends: rm's bundle tokenizer adds it, TRL's saved one does not, and ``bundle_tokenizer_agrees`` counts that). TRL reads the training pairs in rm's order (``train_sampling_strategy="sequential"`` over
  the pairs rm takes at each step, seed 42), so both take the same optimizer steps; beside each rm row, the eval
  pairs on which only it or only TRL is right, and the exact sign test's p-value of that split (McNemar);
* **turns**: each rm layout runs ``--repeat`` times (default 3), in turns whose order rotates, so that each
  layout runs in each place of a turn equally often (with ``--repeat`` a multiple of 3); a row is its median turn,
  and beside it the median over turns of its ratio to the fastest rm row of the same turn. This CPU's speed wanders
  by up to 10-20% between runs of one command, more than the 5% that tells two layouts apart. TRL runs once;
* the 1-minute load average before and after each trainer.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAX_LENGTH, PAIRS_PER_STEP, LR, WARMUP_STEPS, EVAL_BATCH, SEED = 512, 8, 1e-3, 3, 8, 42
VOCAB_SIZE = 4096
SHAPE = {"model_type": "llama", "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 3,
         "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": MAX_LENGTH,
         "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
RM_LAYOUTS = {  # name: the layout overrides on top of the shared rm command line
    # What a new user runs: every layout knob left to train.layout=auto (checkpointing included).
    "rm, no layout flags": [],
    "rm, README CPU setting": ["train.share_prefix=true", "train.packing=true", "train.max_tokens_per_micro_batch=4096",
                               "train.gradient_checkpointing=false"],
    "rm, schema defaults (train.layout=given)": ["train.layout=given", "train.gradient_checkpointing=false"],
}
TRL = "TRL RewardTrainer"

# Modules whose public functions and classes supply the answers. Fixed and sorted by the loop below, so the same
# Python version gives the same data; a module missing from a build (e.g. sqlite3) is skipped.
STDLIB_MODULES = (
    "argparse", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmath", "codecs", "collections",
    "colorsys", "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email.message", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "functools",
    "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "inspect", "io",
    "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging", "math", "mimetypes", "numbers",
    "operator", "os", "os.path", "pathlib", "pickle", "platform", "plistlib", "pprint", "queue", "quopri", "random",
    "re", "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "socket", "sqlite3", "stat", "statistics",
    "string", "struct", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "threading", "time",
    "tokenize", "traceback", "types", "typing", "unicodedata", "urllib.parse", "urllib.request", "uuid", "warnings",
    "wave", "weakref", "xml.etree.ElementTree", "zipfile", "zlib",
)
QUESTIONS = (
    "What does {} do?", "How do I use {} in Python?", "Can you explain {} to me?",
    "I keep seeing {} in our code base. What is it for?", "What is {}?", "Quick question: what is {} used for?",
    "Could you tell me about {}, please?", "I am new to Python. What does {} do?",
)
# Unhelpful replies that name the function asked about, so that naming it does not tell the answers apart.
EVASIVE = (
    "I'm not sure what {name} does. You could try reading its documentation.",
    "Sorry, I can't help with {name} right now.",
    "Good question! {name} is part of the {module} module, but I don't remember the details.",
    "I would rather not guess about {name}; the Python docs explain it better than I could.",
    "You can find out yourself by running help({name}) in the interpreter.",
    "{name}? It's been a while since I used {module}, so I'd better not say.",
)
# evasive: learnt from the answer alone, as a small model learns it in a few dozen steps; wrong-function: both answers
# are docstrings, so only matching the answer with the question tells them apart (a harder, slower skill).
REJECTED_KINDS = ("evasive", "wrong-function")
ANSWER_WORDS = 90  # docstrings have a long tail; the first ~90 words keep most pairs within MAX_LENGTH
EARLIER_EXCHANGES = (1, 4)  # multi-turn: earlier question/answer exchanges before the last question


@dataclass(frozen=True)
class Doc:
    name: str  # e.g. "textwrap.dedent"
    module: str
    answer: str  # "textwrap.dedent(text): Remove any common leading whitespace ..."


@functools.lru_cache(maxsize=1)
def stdlib_docs() -> tuple[Doc, ...]:
    """Every public function and class of :data:`STDLIB_MODULES` with a docstring of at least 8 words, one per text.

    Read once per process, before torch and transformers are imported: torch replaces ``inspect.getfile``, which would
    then drop out of the set and change the data.
    """
    docs, seen = [], set()
    for module_name in STDLIB_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            # Only what the module defines itself: re-exports would give one docstring several names.
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            words = doc.split()
            if len(words) < 8 or doc in seen:
                continue
            seen.add(doc)
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):  # many builtins have none
                signature = "(...)"
            if len(signature) > 48:
                signature = "(...)"
            text = " ".join(words[:ANSWER_WORDS]) + (" ..." if len(words) > ANSWER_WORDS else "")
            docs.append(Doc(f"{module_name}.{attr}", module_name, f"{module_name}.{attr}{signature}: {text}"))
    return tuple(docs)


def split_docs(docs: tuple[Doc, ...]) -> tuple[list[Doc], list[Doc]]:
    """Train and eval pools of functions, about 80:20, by a hash of the name (stable whatever else changes)."""
    def bucket(doc):
        return int(hashlib.sha256(doc.name.encode()).hexdigest(), 16) % 5

    return [d for d in docs if bucket(d)], [d for d in docs if not bucket(d)]


def make_pairs(pool: list[Doc], n: int, seed: int, multi_turn: bool) -> tuple[list[dict], list[str]]:
    """``n`` HH-format pairs from ``pool`` and the kind of each pair's rejected answer (:data:`REJECTED_KINDS`).

    Multi-turn pairs start with earlier exchanges about other functions; then the question, the right answer
    (chosen) and a wrong one (rejected): half the time an evasive reply naming the function, half the time the
    docstring of an unrelated function of another module.
    """
    rng = random.Random(seed)
    pairs, kinds = [], []
    for _ in range(n):
        target = rng.choice(pool)
        others = [d for d in pool if d.module != target.module]
        wrong = rng.choice(others)
        earlier = rng.sample([d for d in others if d is not wrong], rng.randint(*EARLIER_EXCHANGES)) if multi_turn else []
        prompt = "".join(f"\n\nHuman: {rng.choice(QUESTIONS).format(d.name)}\n\nAssistant: {d.answer}" for d in earlier)
        prompt += f"\n\nHuman: {rng.choice(QUESTIONS).format(target.name)}\n\nAssistant: "
        kind = rng.choice(REJECTED_KINDS)
        rejected = rng.choice(EVASIVE).format(name=target.name, module=target.module) if kind == "evasive" else wrong.answer
        pairs.append({"chosen": prompt + target.answer, "rejected": prompt + rejected})
        kinds.append(kind)
    return pairs, kinds


def train_tokenizer(texts: list[str], out_dir: Path):
    """A byte-level BPE as rm builds its default one: ids 0-3 ``<pad> <unk> <s> </s>``, the 256 bytes, merges.

    Nothing is added to a text when it is tokenised (no post-processor), which is rm's convention; TRL appends
    ``</s>`` to each text itself. Saved in a directory of its own and returned as ``AutoTokenizer`` reads it back,
    which is how both trainers load it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    special = ["<pad>", "<unk>", "<s>", "</s>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>", model_max_length=2048,
                                        padding_side="right")
    tokenizer.save_pretrained(out_dir)
    loaded = AutoTokenizer.from_pretrained(out_dir)
    if any(loaded(t)["input_ids"] != tokenizer(t)["input_ids"] for t in texts[:64]):
        sys.exit(f"{out_dir} does not load back as the tokenizer trained ({type(loaded).__name__})")
    return loaded


def save_random_model(tokenizer, out_dir: Path) -> int:
    """The Llama-style reward model of :data:`SHAPE`, random init from seed 0, saved (weights and config only)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(
        SHAPE["model_type"], vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, use_cache=False,
        **{k: v for k, v in SHAPE.items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def prepare(kind: str, steps: int, eval_pairs: int, workdir: Path) -> dict:
    """Writes ``train.jsonl``, ``eval.jsonl``, ``tokenizer/`` and ``model/`` (random init) for one data set.

    The training set is exactly one epoch of ``steps / 2`` optimizer steps. Pairs with a side longer than
    ``MAX_LENGTH`` tokens with its EOS are left out (both trainers append an EOS; TRL drops what exceeds
    ``max_length``, rm would truncate), so both trainers train on every pair as it is.
    """
    train_pool, eval_pool = split_docs(stdlib_docs())
    multi_turn = kind == "multi-turn"
    n_train = PAIRS_PER_STEP * steps // 2
    # More candidates than needed (some are too long), at least a fixed number: the tokenizer is trained on the train
    # candidates, so that it, the model's vocabulary and the pairs chosen (a prefix of the candidates) stay the same
    # whatever --steps is. The seeds make every run of this script alike.
    candidates = {"train": make_pairs(train_pool, max(1024, 2 * n_train + 64), seed=1, multi_turn=multi_turn),
                  "eval": make_pairs(eval_pool, max(512, 2 * eval_pairs + 64), seed=2, multi_turn=multi_turn)}
    model_dir, tokenizer_dir = workdir / "model", workdir / "tokenizer"
    tokenizer = train_tokenizer([t for p in candidates["train"][0] for t in (p["chosen"], p["rejected"])], tokenizer_dir)
    parameters = save_random_model(tokenizer, model_dir)

    kept, lengths, eval_kinds = {}, {}, []
    for split, want in (("train", n_train), ("eval", eval_pairs)):
        rows, sizes = [], []
        for pair, rejected_kind in zip(*candidates[split]):
            ids = [tokenizer(pair[side] + tokenizer.eos_token)["input_ids"] for side in ("chosen", "rejected")]
            if max(map(len, ids)) <= MAX_LENGTH:
                rows.append(pair)
                sizes.append(ids)
                if split == "eval":
                    eval_kinds.append(rejected_kind)
            if len(rows) == want:
                break
        if len(rows) < want:
            sys.exit(f"only {len(rows)} {split} pairs of {kind} data fit in {MAX_LENGTH} tokens; {want} needed")
        kept[split], lengths[split] = rows, sizes
        with open(workdir / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    train_ids = lengths["train"]
    prefix = [common_prefix(c, r) for c, r in train_ids]
    both = sum(len(c) + len(r) for c, r in train_ids)
    digest = hashlib.sha256((workdir / "train.jsonl").read_bytes() + (workdir / "eval.jsonl").read_bytes()).hexdigest()
    return {
        "kind": kind, "train_pairs": len(kept["train"]), "eval_pairs": len(kept["eval"]),
        "train_pool": len(train_pool), "eval_pool": len(eval_pool),
        "epoch_tokens": both,  # chosen + rejected tokens of the training set: one epoch's real tokens
        "median_tokens": statistics.median(len(s) for pair in train_ids for s in pair),
        "prompt_to_answer": sum(prefix) / (both - 2 * sum(prefix)),
        "vocab": len(tokenizer), "parameters": parameters, "digest": digest[:12], "eval_kinds": eval_kinds,
        "train_file": str(workdir / "train.jsonl"), "eval_file": str(workdir / "eval.jsonl"), "model_dir": str(model_dir),
        "tokenizer_dir": str(tokenizer_dir),
    }


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def child_env(threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def rm_command(data: dict, steps: int, run_dir: Path, layout: list[str]) -> list[str]:
    """The ``python -m rm.train`` command line: the README's "Your own data" plus the settings shared with TRL."""
    epoch = steps // 2
    shape = [f"model.{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in SHAPE.items()]
    return [
        sys.executable, "-m", "rm.train",
        "data=local", f"data.train_files=[{data['train_file']}]", f"data.eval_files=[{data['eval_file']}]",
        f"data.max_length={MAX_LENGTH}",
        # A local model directory; its shape numbers repeated for the pre-flight memory estimate, which reads the
        # model group rather than the directory.
        "model=llama3_8b", "model.name=bench_llama_3x384", f"model.pretrained={data['model_dir']}",
        f"model.tokenizer={data['tokenizer_dir']}",
        f"model.vocab_size={data['vocab']}", *shape,
        "hardware=cpu", "memory_profile=full", "train.precision=32-true",
        f"train.max_steps={steps}", f"train.global_batch_size={PAIRS_PER_STEP}", f"train.eval_batch_size={EVAL_BATCH}",
        f"train.optim.learning_rate={LR}", "train.optim.lr_scheduler_type=linear",
        # rm takes a ratio and rounds warm-up steps up: half a step under WARMUP_STEPS rounds to exactly WARMUP_STEPS.
        f"train.optim.warmup_ratio={(WARMUP_STEPS - 0.5) / steps}", "train.optim.max_grad_norm=1.0", "train.optim.weight_decay=0.0",
        f"train.logging.logging_steps={epoch}", "train.logging.eval_steps=0", "train.checkpoint.save_steps=0", f"train.seed={SEED}",
        f"hydra.run.dir={run_dir}", *layout,
    ]


def watch_metrics(proc: subprocess.Popen, path: Path) -> dict[int, float]:
    """Wall-clock time of each ``train`` line of rm's ``metrics.jsonl``, until ``proc`` exits.

    The time is the file's modification time when one new line is found (the moment rm wrote it), else the time of
    the poll that found the lines.
    """
    marks, seen, size = {}, 0, 0
    while True:
        done = proc.poll() is not None
        if path.is_file() and path.stat().st_size != size:
            stat, now = path.stat(), time.time()
            size = stat.st_size
            lines = path.read_text().splitlines(keepends=True)
            fresh = [json.loads(line) for line in lines[seen:] if line.endswith("\n")]
            seen += len(fresh)
            for record in fresh:
                if record.get("event") == "train":
                    marks[record["step"]] = stat.st_mtime if len(fresh) == 1 else now
        if done:
            return marks
        time.sleep(0.02)


def check_rm_data(run_dir: Path, data: dict) -> None:
    """rm must have trained every pair whole, with the benchmark's token count: else the window's tokens are not the
    benchmark's sum."""
    audit = json.loads((run_dir / "data_audit.json").read_text())["splits"]["train"]
    lengths = audit["lengths"]
    tokens = round(sum(lengths[side]["kept"]["mean"] * audit["pairs_out"] for side in ("chosen", "rejected")))
    if (audit["pairs_out"], audit["truncated"], tokens) != (data["train_pairs"], 0, data["epoch_tokens"]):
        sys.exit(f"rm's data audit ({run_dir / 'data_audit.json'}): {audit['pairs_out']} pairs, {audit['truncated']} "
                 f"truncated, {tokens:,} tokens; the benchmark counted {data['train_pairs']} pairs, "
                 f"{data['epoch_tokens']:,} tokens")


def run_rm(name: str, layout: list[str], data: dict, args, workdir: Path, repeat: int) -> dict:
    # Hydra's override grammar takes no parentheses, commas or "=" in a value
    run_dir = workdir / (re.sub(r"[^\w.-]+", "_", name) + f"-{repeat}")
    command = rm_command(data, args.steps, run_dir, layout)
    log_path = workdir / f"{run_dir.name}.out"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=child_env(args.threads), stdout=log, stderr=subprocess.STDOUT)
        marks = watch_metrics(proc, run_dir / "metrics.jsonl")
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = log_path.read_text()[-3000:]
        sys.exit(f"{name} failed (exit {proc.returncode}):\n  {' '.join(command)}\n{tail}")
    check_rm_data(run_dir, data)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epoch = args.steps // 2
    train = {r["step"]: r for r in records if r["event"] == "train"}
    evals = [r for r in records if r["event"] == "eval"]
    return {"command": " ".join(command), "wall_s": wall, "window_s": marks[args.steps] - marks[epoch],
            "self_tokens_per_s": train[args.steps]["tokens_per_s"], "eval_accuracy": evals[-1]["eval_accuracy"],
            "model_dir": str(run_dir / "final"), "append_eos": True}


def run_trl(data: dict, args, workdir: Path) -> dict:
    out = workdir / "trl_result.json"
    job = {**data, "steps": args.steps, "threads": args.threads, "output_dir": str(workdir / "trl"), "out": str(out)}
    (workdir / "trl_job.json").write_text(json.dumps(job))
    log_path = workdir / "trl.out"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, __file__, "--trl-child", str(workdir / "trl_job.json")], cwd=ROOT,
                              env=child_env(args.threads), stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{TRL} failed (exit {done.returncode}):\n{log_path.read_text()[-3000:]}")
    return {**json.loads(out.read_text()), "wall_s": wall, "model_dir": str(workdir / "trl" / "final"), "append_eos": True}


def rm_pair_order(num_pairs: int, steps: int) -> list[int]:
    """The training pairs rm takes at steps 0 .. ``steps - 1``, in that order (one process, seed :data:`SEED`)."""
    from rm.data.batching import micro_batches_for_step

    return [i for step in range(steps)
            for i in micro_batches_for_step(step, num_pairs, PAIRS_PER_STEP, PAIRS_PER_STEP, 1, 0, SEED)[0]]


def trl_child(job_file: str) -> None:
    """TRL's RewardTrainer on the JSONL files, as a TRL user would run it (text columns, TRL's own tokenisation)."""
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(job["threads"])
    steps, epoch = job["steps"], job["steps"] // 2
    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer_dir"])
    model = AutoModelForSequenceClassification.from_pretrained(job["model_dir"], num_labels=1, dtype=torch.float32)
    train = datasets.load_dataset("json", data_files=job["train_file"], split="train")
    # The pairs of each step are rm's (train.seed=SEED), read in that order: both trainers then take the same
    # optimizer steps, and their eval accuracies differ only by how each computes them, not by luck of the draw.
    train = train.select(rm_pair_order(len(train), steps))
    eval_set = datasets.load_dataset("json", data_files=job["eval_file"], split="train")

    class StepClock(TrainerCallback):
        """Wall-clock time at the end of each optimizer step."""
        ends: dict = {}

        def on_step_end(self, args, state, control, **kwargs):
            StepClock.ends[state.global_step] = time.time()

    config = RewardConfig(
        output_dir=job["output_dir"], per_device_train_batch_size=PAIRS_PER_STEP, gradient_accumulation_steps=1,
        per_device_eval_batch_size=EVAL_BATCH, max_steps=steps, learning_rate=LR, lr_scheduler_type="linear",
        warmup_steps=WARMUP_STEPS, max_grad_norm=1.0, weight_decay=0.0, logging_steps=epoch, save_strategy="no",
        eval_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        max_length=MAX_LENGTH, seed=SEED, dataloader_num_workers=0, disable_dropout=True,
        train_sampling_strategy="sequential",
    )
    trainer = RewardTrainer(model=model, args=config, train_dataset=train, eval_dataset=eval_set,
                            processing_class=tokenizer, callbacks=[StepClock()])
    if len(trainer.train_dataset) != len(train):
        sys.exit(f"TRL dropped {len(train) - len(trainer.train_dataset)} training pairs (longer than max_length)")
    trainer.train()
    logged = {h["step"]: h for h in trainer.state.log_history if "num_tokens" in h and "loss" in h}
    metrics = trainer.evaluate()
    trainer.save_model(str(Path(job["output_dir"]) / "final"))
    window = StepClock.ends[steps] - StepClock.ends[epoch]
    Path(job["out"]).write_text(json.dumps({
        "window_s": window, "self_tokens_per_s": (logged[steps]["num_tokens"] - logged[epoch]["num_tokens"]) / window,
        "eval_accuracy": metrics["eval_accuracy"],
    }))


def bench_accuracy(model_dir: str, data: dict, append_eos: bool) -> dict[str, float]:
    """Pairwise accuracy of a saved model on the eval pairs, in all and per kind of rejected answer, scored with plain
    transformers as the README's snippet does, tokenised as in training (the benchmark's tokenizer directory).

    Also how many eval texts the tokenizer saved in the model's own directory (what ``AutoTokenizer`` loads from it)
    tokenises as in training: ``bundle_tokenizer_agrees``.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data["tokenizer_dir"])
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    pairs = [json.loads(line) for line in Path(data["eval_file"]).read_text().splitlines()]
    suffix = tokenizer.eos_token if append_eos else ""
    right = []
    with torch.no_grad():
        for i in range(0, len(pairs), EVAL_BATCH):
            batch = pairs[i : i + EVAL_BATCH]
            texts = [p[side] + suffix for side in ("chosen", "rejected") for p in batch]
            rewards = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits[:, 0]
            right += (rewards[: len(batch)] > rewards[len(batch):]).tolist()
    accuracy = {"all": sum(right) / len(right)}
    for kind in REJECTED_KINDS:
        mine = [ok for ok, k in zip(right, data["eval_kinds"]) if k == kind]
        accuracy[kind] = sum(mine) / max(1, len(mine))
    bundled = AutoTokenizer.from_pretrained(model_dir)
    texts = [p[side] for p in pairs for side in ("chosen", "rejected")]
    agrees = sum(bundled(t)["input_ids"] == tokenizer(t + suffix)["input_ids"] for t in texts)
    return {"accuracy": accuracy, "right": right, "bundle_tokenizer": type(bundled).__name__,
            "bundle_tokenizer_agrees": f"{agrees}/{len(texts)}"}


def run_dataset(kind: str, args, workdir: Path) -> str:
    data = prepare(kind, args.steps, args.eval_pairs, workdir)
    print(f"{kind} data: {data['train_pairs']} train / {data['eval_pairs']} eval pairs (functions: "
          f"{data['train_pool']} train / {data['eval_pool']} eval, disjoint), median sequence "
          f"{data['median_tokens']:.0f} tokens, shared prompt : answer tokens = {data['prompt_to_answer']:.2f} : 1, "
          f"one epoch = {data['epoch_tokens']:,} chosen + rejected tokens; tokenizer {data['vocab']} tokens; "
          f"model {data['parameters']:,} parameters; data sha256 {data['digest']} (Python {platform.python_version()})",
          flush=True)
    def measured(name: str, result: dict, load_before: float) -> dict:
        result.update(load_before=load_before, load_after=os.getloadavg()[0])
        result["tokens_per_s"] = data["epoch_tokens"] / result["window_s"]
        print(f"    whole command {result['wall_s']:.1f} s; second epoch {result['window_s']:.2f} s: "
              f"{data['train_pairs'] / result['window_s']:.2f} pairs/s, {result['tokens_per_s']:,.0f} real tokens/s "
              f"(self-reported {result['self_tokens_per_s']:,.0f}); eval accuracy {result['eval_accuracy']:.3f}; "
              f"load {load_before:.2f} -> {result['load_after']:.2f}", flush=True)
        if "command" in result:
            print(f"    {result['command']}", flush=True)
        return result

    load = os.getloadavg()[0]
    print(f"  {TRL}: running (1-minute load average {load:.2f}) ...", flush=True)
    results = {TRL: measured(TRL, run_trl(data, args, workdir), load)}
    # rm's layouts in turns, the order rotated each turn so that every layout runs in every place of a turn (after
    # TRL, after each other layout) as often as the others do: a drift of the machine's speed, or what a run leaves
    # behind for the next, falls on each alike. Each is reported by the median of its turns.
    runs = {name: [] for name in RM_LAYOUTS}
    names = list(RM_LAYOUTS)
    for turn in range(args.repeat):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            load = os.getloadavg()[0]
            print(f"  {name} ({turn + 1} of {args.repeat}): running (1-minute load average {load:.2f}) ...", flush=True)
            runs[name].append(measured(name, run_rm(name, RM_LAYOUTS[name], data, args, workdir, turn), load))
    for name, turns in runs.items():
        result = dict(turns[0])  # its model is the one scored below; every turn trains the same steps
        for key in ("wall_s", "window_s", "self_tokens_per_s", "load_before", "load_after"):
            result[key] = statistics.median(t[key] for t in turns)
        result["tokens_per_s"] = data["epoch_tokens"] / result["window_s"]
        result["turns_tokens_per_s"] = [t["tokens_per_s"] for t in turns]
        # Within a turn the layouts ran minutes apart, so each turn's ratio to its fastest row is freer of the
        # machine's drift than the ratio of medians taken over turns far apart.
        result["turns_x_fastest"] = [t["tokens_per_s"] / max(runs[other][i]["tokens_per_s"] for other in runs)
                                     for i, t in enumerate(turns)]
        result["turns_eval_accuracy"] = [t["eval_accuracy"] for t in turns]
        results[name] = result
    for result in results.values():
        result["pairs_per_s"] = data["train_pairs"] / result["window_s"]
    # Scored after every trainer has finished, so that it loads no trainer's machine.
    for result in results.values():
        result.update(bench_accuracy(result["model_dir"], data, result["append_eos"]))
    for result in results.values():
        result["against_trl"] = paired(result["right"], results[TRL]["right"])
    return table(kind, data, results, args), results


def paired(mine: list[bool], theirs: list[bool]) -> dict:
    """Two models' verdicts on the same eval pairs: on how many they differ each way, and the two-sided exact sign
    test's p-value of those discordant pairs (McNemar's exact test): how likely so lopsided a split is if the two
    are equally accurate."""
    better = sum(a and not b for a, b in zip(mine, theirs))
    worse = sum(b and not a for a, b in zip(mine, theirs))
    n, k = better + worse, min(better, worse)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"only_this_right": better, "only_trl_right": worse, "p_value": p}


def table(kind: str, data: dict, results: dict, args) -> str:
    trl = results[TRL]
    best = max(r["tokens_per_s"] for name, r in results.items() if name != TRL)
    lines = [f"### {kind} data, {args.steps} steps ({args.steps // 2} timed), {args.threads} threads, "
             f"rm's rows the median of {args.repeat} turns", "",
             "| trainer | whole command (s) | x TRL | timed epoch (s) | pairs/s | real tokens/s (each turn) | x TRL "
             "| x fastest rm row | x fastest rm row of its turn: median (each turn) | self-reported tokens/s "
             "| eval acc (own; each turn) "
             "| eval acc (this script): all / evasive / wrong function | eval pairs only it / only TRL got right (p) "
             "| load before -> after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        turns = r.get("turns_tokens_per_s", [])
        each = f" ({', '.join(f'{t:,.0f}' for t in turns)})" if len(turns) > 1 else ""
        own = ", ".join(f"{a:.3f}" for a in r.get("turns_eval_accuracy", [r["eval_accuracy"]]))
        per_turn = r.get("turns_x_fastest", [])
        in_turn = (f"{statistics.median(per_turn):.3f} ({', '.join(f'{x:.3f}' for x in per_turn)})"
                   if per_turn else "-")
        vs = r["against_trl"]
        versus = "-" if name == TRL else f"{vs['only_this_right']} / {vs['only_trl_right']} ({vs['p_value']:.2f})"
        lines.append(
            f"| {name} | {r['wall_s']:.1f} | {trl['wall_s'] / r['wall_s']:.2f} | {r['window_s']:.2f} | {r['pairs_per_s']:.2f} "
            f"| {r['tokens_per_s']:,.0f}{each} | {r['tokens_per_s'] / trl['tokens_per_s']:.2f} "
            f"| {'-' if name == TRL else format(r['tokens_per_s'] / best, '.3f')} | {in_turn} "
            f"| {r['self_tokens_per_s']:,.0f} "
            f"| {own} | {' / '.join(f'{v:.3f}' for v in r['accuracy'].values())} | {versus} "
            f"| {r['load_before']:.2f} -> {r['load_after']:.2f} |")
    lines += ["", "Real tokens/s: the training set's chosen + rejected tokens (one epoch) over the timed epoch, both "
              "measured by this script; for rm the median turn's (whole command and load too). Self-reported: rm's "
              "`tokens_per_s` for that window; for TRL its own `num_tokens` count over the same window, which includes "
              "the EOS TRL appends to every text. x TRL of the whole command is TRL's time over the trainer's (above 1: "
              "faster than TRL). x fastest rm row: of the medians; of its turn: each turn's tokens/s over the fastest rm "
              "row's in the same turn, minutes apart, so less of the machine's drift between turns is in it. TRL reads "
              "the training pairs in rm's order, so every trainer takes the same optimizer "
              "steps; the last column counts the eval pairs on which one model of the two is right and the other wrong, "
              "with the exact two-sided sign test's p-value (McNemar): a small p says the two are not equally accurate.",
              ""]
    lines += [f"- {name}: the saved model directory's own tokenizer (`AutoTokenizer.from_pretrained`) is a "
              f"{r['bundle_tokenizer']} and tokenises {r['bundle_tokenizer_agrees']} eval texts as in training"
              for name, r in results.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64, help="optimizer steps, an even number: two epochs, the second timed")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every trainer")
    parser.add_argument("--data", nargs="+", default=["multi-turn", "single-turn"], choices=["multi-turn", "single-turn"])
    parser.add_argument("--eval-pairs", dest="eval_pairs", type=int, default=128, help="held-out pairs (a multiple of 8)")
    parser.add_argument("--repeat", type=int, default=3, help="turns of each rm layout (TRL runs once); medians reported")
    parser.add_argument("--smoke", action="store_true", help="a few steps and eval pairs: checks that everything runs")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (data, model, run directories, logs)")
    parser.add_argument("--trl-child", dest="trl_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(args.trl_child)
    if args.smoke:
        args.steps, args.eval_pairs, args.repeat = 6, 16, 1
    if args.steps < 2 or args.steps % 2 or args.eval_pairs % EVAL_BATCH or args.repeat < 1:
        parser.error(f"--steps must be even and at least 2, --eval-pairs a multiple of {EVAL_BATCH}, --repeat at least 1")
    if args.keep and Path(args.keep).exists() and any(Path(args.keep).iterdir()):
        # rm refuses to overwrite a finished run directory, and stale files would mix with this run's.
        parser.error(f"--keep {args.keep}: give a new or empty directory")

    start, load = time.perf_counter(), os.getloadavg()
    stdlib_docs()  # before anything imports torch (see there)
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_cli_vs_trl-"))
    sections = []
    try:
        for kind in args.data:
            (workdir / kind).mkdir(parents=True, exist_ok=True)
            section, results = run_dataset(kind, args, workdir / kind)
            sections.append(section)
            (workdir / kind / "results.json").write_text(json.dumps(results, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    after = os.getloadavg()
    print("\n" + "\n\n".join(sections))
    print(f"\n1-minute load average {load[0]:.2f} before, {after[0]:.2f} after; {os.cpu_count()} CPU cores; "
          f"{time.perf_counter() - start:.0f} s in all; `python benchmarks/bench_cli_vs_trl.py {' '.join(sys.argv[1:])}`")


if __name__ == "__main__":
    main()
