"""The disk cache of what every run computes again (``rm.foundations.cache``): the memory estimate's traces, the BPE trained on a
run's texts, the tokenised splits. A hit gives exactly what computing gives; any input of the key changed is a miss;
a corrupt entry is computed again; a cache that cannot be written costs a run nothing but the time."""

import json
import logging
import os
import subprocess
import sys

import pytest

import rm.data.build as build
import rm.memory.trace as trace
from rm.foundations import cache
from rm.foundations.config import compose
from rm.data.build import DATA_SOURCES, build_split, split_identity, train_pairs
from rm.foundations.hardware import resolve_hardware
from rm.memory.terms import estimate_run
from rm.data.tokenizer import TOKENIZER_SOURCES, build_word_level_tokenizer, run_tokenizer, tokenizer_identity
from rm.settings.validate import validate
from tests.conftest import CONF_DIR, FAST_TINY
from tests.test_imports import import_graph


def closure(module):
    graph, seen, todo = import_graph(), set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


@pytest.mark.parametrize("module,listed", [("rm.memory.trace", trace.TRACE_SOURCES), ("rm.data.build", DATA_SOURCES),
                                           ("rm.data.tokenizer", TOKENIZER_SOURCES)])
def test_each_key_digests_every_rm_module_its_computation_imports(module, listed):
    """An import added to the code a cache entry comes from must join its key, or an edit there would be a stale hit."""
    assert set(listed) == closure(module)


def unwritable(tmp_path):
    """A cache root nothing can be written under, whoever runs the test (root ignores permission bits): below a file."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return str(blocker / "cache")


# ---- the memory estimate's traces

def planned(*overrides):
    cfg = compose([*FAST_TINY, *overrides])
    cfg.hardware = resolve_hardware(cfg.hardware)
    return cfg, validate(cfg, 1)


@pytest.fixture
def traced(monkeypatch):
    """The traces really run (not read from a cache), as their arguments; starts with nothing held in memory."""
    ran = []
    run_trace, run_inference = trace._run_trace, trace._run_inference_trace
    monkeypatch.setattr(trace, "_run_trace", lambda *args: ran.append(args[1:]) or run_trace(*args))
    monkeypatch.setattr(trace, "_run_inference_trace", lambda *args: ran.append(args[1:]) or run_inference(*args))
    trace.clear_cache()
    yield ran
    trace.clear_cache()


def again(*overrides):
    """The estimate in a new process, as it were: nothing held in memory, only the disk cache."""
    trace.clear_cache()
    return estimate_run(*planned(*overrides))


def test_a_cached_trace_gives_the_same_estimate_without_tracing(traced):
    computed = estimate_run(*planned())
    assert traced and list((cache.cache_root() / "trace").glob("*.json"))
    traced.clear()
    assert again() == computed  # every field, the activations to the byte
    assert traced == []


GPU = ["hardware=h100_80g"]  # a CPU trains in 32-true only


@pytest.mark.parametrize("base,change", [
    ([], ["train.micro_batch_size=4"]), ([], ["train.eval_batch_size=16"]), ([], ["data.max_length=32"]),
    ([], ["model.intermediate_size=128"]), ([], ["model.attn_implementation=eager"]),
    ([], ["train.gradient_checkpointing=true"]), ([], ["memory_profile=lora"]), ([], ["train.share_prefix=true"]),
    ([], ["train.packing=true"]), ([], GPU), (GPU, [*GPU, "train.precision=bf16-mixed"]),
])
def test_a_changed_setting_that_shapes_the_trace_is_traced_again(traced, base, change):
    estimate_run(*planned(*base))
    traced.clear()
    again(*change)
    assert traced, f"{change}: read from the cache of another shape"


@pytest.mark.parametrize("part", ["rm", "libraries"])
def test_changed_rm_code_or_library_version_is_traced_again(traced, monkeypatch, part):
    estimate_run(*planned())
    traced.clear()
    environment = trace._environment()
    changed = {**environment, part: "another"}
    monkeypatch.setattr(trace, "_environment", lambda: changed)
    again()
    assert traced


@pytest.mark.parametrize("damage", ["garbage", "truncated", "value_changed", "empty"])
def test_a_corrupt_trace_entry_is_traced_again(traced, damage):
    computed = estimate_run(*planned())
    entries = list((cache.cache_root() / "trace").glob("*.json"))
    for path in entries:
        text = path.read_text()
        if damage == "garbage":
            path.write_bytes(b"\x00\xff not json")
        elif damage == "truncated":
            path.write_text(text[: len(text) // 2])
        elif damage == "value_changed":  # still JSON, a number edited: the checksum no longer matches
            stored = json.loads(text)
            value = stored["value"]
            stored["value"] = value + 1 if isinstance(value, int) else {**value, "num_layers": value["num_layers"] + 1}
            path.write_text(json.dumps(stored))
        else:
            path.write_text("")
    traced.clear()
    assert again() == computed
    assert len(traced) == len(entries)
    assert all(cache.read_json(path) is not None for path in entries)  # written again, whole


def test_a_cache_that_cannot_be_written_changes_nothing_but_the_time(traced, monkeypatch, tmp_path):
    computed = estimate_run(*planned())
    monkeypatch.setenv("RM_CACHE", unwritable(tmp_path))
    traced.clear()
    assert again() == computed
    traced.clear()
    assert again() == computed and traced  # nothing was kept


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_a_read_only_cache_directory_changes_nothing_but_the_time(traced, monkeypatch, tmp_path):
    computed = estimate_run(*planned())
    root = tmp_path / "read-only"
    root.mkdir()
    root.chmod(0o500)
    monkeypatch.setenv("RM_CACHE", str(root))
    try:
        assert again() == computed
    finally:
        root.chmod(0o700)


# ---- the tokenised splits

def data_cfg(*overrides):
    return compose(["experiment=tiny", "data.synthetic_train_size=120", "data.synthetic_test_size=40",
                    "data.max_length=48", *overrides]).data


WORDS = build_word_level_tokenizer()


@pytest.fixture
def tokenised(monkeypatch):
    """The splits really loaded and tokenised (not read from a cache), by split name."""
    ran = []
    compute = build._tokenised_split
    monkeypatch.setattr(build, "_tokenised_split", lambda cfg, tok, split: ran.append(split) or compute(cfg, tok, split))
    return ran


def same(a, b):
    """Equal splits: the same token ids and margins, row by row, with the same features, and equal counts."""
    (ds_a, counts_a), (ds_b, counts_b) = a, b
    return ds_a.features == ds_b.features and ds_a.to_dict() == ds_b.to_dict() and counts_a == counts_b


def test_a_cached_split_has_the_same_tokens_and_counts(tokenised, caplog):
    computed = build_split(data_cfg(), WORDS, "train")
    assert tokenised == ["train"]
    with caplog.at_level(logging.INFO, logger="rm.data"):
        cached = build_split(data_cfg(), WORDS, "train")
    assert tokenised == ["train"]  # not tokenised again
    assert same(cached, computed)
    assert "tokenised pairs read from the cache" in caplog.text
    assert f"data synthetic [train]: {computed[1].format()}" in caplog.text  # the counts are logged as computed


@pytest.mark.parametrize("change", [
    ["data.max_length=40"], ["data.truncation=drop"], ["data.duplicates=drop"], ["data.identical_pairs=keep"],
    ["data.synthetic_seed=1"], ["data.synthetic_train_size=100"], ["data.max_train_samples=50"],
    ["data.synthetic_multi_turn=true"],
])
def test_a_changed_data_setting_is_tokenised_again(tokenised, change):
    build_split(data_cfg(), WORDS, "train")
    changed = build_split(data_cfg(*change), WORDS, "train")
    assert tokenised == ["train", "train"], change
    tokenised.clear()
    assert same(build_split(data_cfg(*change), WORDS, "train"), changed) and tokenised == []


def test_another_tokenizer_is_tokenised_again(tokenised):
    cfg = data_cfg()
    build_split(cfg, WORDS, "train")
    bpe = run_tokenizer(compose(["experiment=tiny"]).model, train_pairs(cfg))
    build_split(cfg, bpe, "train")
    padded_left = build_word_level_tokenizer()
    padded_left.pad_token = "<unk>"  # another pad id: the pad-in-text check reads it
    build_split(cfg, padded_left, "train")
    assert tokenised == ["train"] * 3
    assert len({tokenizer_identity(t) for t in (WORDS, bpe, padded_left)}) == 3


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"prompt": f"\n\nHuman: say {w}\n\nAssistant:", "chosen": f" {w} indeed", "rejected": " no"}
        for w in ("apple", "banana", "cherry", "grape", "lemon", "mango")]


def local_cfg(path, *overrides):
    return compose(["experiment=tiny", "data=local", f"data.train_files=[{path}]", "data.max_length=48", *overrides]).data


def test_a_local_split_is_keyed_by_its_bytes_not_its_path(tokenised, tmp_path):
    first = build_split(local_cfg(write_jsonl(tmp_path / "a.jsonl", ROWS)), WORDS, "train")
    # The same bytes under another name: the same rows, read from the cache.
    assert same(build_split(local_cfg(write_jsonl(tmp_path / "b.jsonl", ROWS)), WORDS, "train"), first)
    assert tokenised == ["train"]
    # The first file edited in place: its rows again.
    edited = build_split(local_cfg(write_jsonl(tmp_path / "a.jsonl", ROWS[:-1])), WORDS, "train")
    assert tokenised == ["train", "train"] and len(edited[0]) == len(first[0]) - 1


def test_what_loading_logged_is_logged_again_on_a_hit(tokenised, tmp_path, caplog):
    rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"], "prompt": "ignored"} for r in ROWS]
    cfg = local_cfg(write_jsonl(tmp_path / "hh.jsonl", rows), "data.format=hh")
    warning = "format 'hh' ignores the 'prompt' column"
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rm.data"):
            build_split(cfg, WORDS, "train")
        assert [r.levelname for r in caplog.records if warning in r.getMessage()] == ["WARNING"]
    assert tokenised == ["train"]


@pytest.mark.parametrize("damage", ["data_byte", "entry_garbage", "data_removed"])
def test_a_corrupt_split_entry_is_tokenised_again(tokenised, damage):
    cfg = data_cfg()
    computed = build_split(cfg, WORDS, "train")
    entry = build.split_cache_entry(cfg, WORDS, "train")
    arrow = next(entry.glob("*.arrow"))
    if damage == "data_byte":  # a flipped byte in the token ids: the file's digest no longer matches
        data = bytearray(arrow.read_bytes())
        data[len(data) // 2] ^= 0x01
        arrow.write_bytes(bytes(data))
    elif damage == "entry_garbage":
        (entry / "entry.json").write_text("{")
    else:
        arrow.unlink()
    assert same(build_split(cfg, WORDS, "train"), computed)
    assert tokenised == ["train", "train"]
    assert same(build_split(cfg, WORDS, "train"), computed) and tokenised == ["train", "train"]  # the entry was repaired


def test_hub_data_is_not_cached():
    """Its revision is not known before it loads: nothing says a cached copy is the data the hub serves now."""
    assert split_identity(compose(["data=hh_helpful"]).data, "train") is None


def test_a_split_cache_that_cannot_be_written_changes_nothing_but_the_time(tokenised, monkeypatch, tmp_path, caplog):
    computed = build_split(data_cfg(), WORDS, "train")
    monkeypatch.setenv("RM_CACHE", unwritable(tmp_path))
    caplog.set_level(logging.INFO, logger="rm.data")
    assert same(build_split(data_cfg(), WORDS, "train"), computed)
    assert same(build_split(data_cfg(), WORDS, "train"), computed)
    assert tokenised == ["train"] * 3
    # said as it is: not "kept in the cache for the next run"
    assert "kept in the cache" not in caplog.text
    assert caplog.text.count(f"not kept for the next run, which tokenises again: the cache {unwritable(tmp_path)}") == 2


# ---- the byte-level BPE trained on the train split's texts

def test_a_cached_bpe_tokenises_as_the_trained_one():
    cfg = data_cfg()
    model = compose(["experiment=tiny"]).model
    identity = split_identity(cfg, "train")
    trained = run_tokenizer(model, train_pairs(cfg), texts_identity=identity)

    def not_read(renderer):
        raise AssertionError("the texts were read: the BPE was trained again")

    cached = run_tokenizer(model, not_read, texts_identity=identity)
    assert tokenizer_identity(cached) == tokenizer_identity(trained)
    texts = list(train_pairs(cfg)(WORDS)["chosen"][:20])
    assert cached(texts)["input_ids"] == trained(texts)["input_ids"]
    with pytest.raises(AssertionError, match="trained again"):  # another size is another tokenizer
        run_tokenizer(compose(["experiment=tiny", "model.vocab_size=400"]).model, not_read, texts_identity=identity)
    with pytest.raises(AssertionError, match="trained again"):  # other texts
        run_tokenizer(model, not_read, texts_identity=split_identity(data_cfg("data.synthetic_seed=3"), "train"))


# ---- whole runs

@pytest.mark.slow
def test_a_warm_run_trains_as_a_cold_one_and_an_unwritable_cache_fails_nothing(tmp_path, monkeypatch, caplog):
    """The same command three times: with a cache it cannot write to, with an empty one, and with the one the second
    filled. Same tokens (the data digest every checkpoint records), same estimate, same step and evaluation."""
    import rm.train as rm_train
    from rm.foundations.config import to_run_config
    from rm.runs.resume import data_digest
    from tests.conftest import compose_run

    digests = []
    monkeypatch.setattr("rm.training.run_setup.data_digest", lambda ds: digests.append(data_digest(ds)) or digests[-1])
    overrides = ["train.max_steps=1", "train.logging.eval_steps=0", "train.share_prefix=true"]
    runs = {}
    for name, root in [("unwritable", unwritable(tmp_path)), ("cold", str(tmp_path / "cache")), ("warm", str(tmp_path / "cache"))]:
        monkeypatch.setenv("RM_CACHE", root)
        trace.clear_cache()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            result = rm_train.train(to_run_config(compose_run(FAST_TINY + overrides)), tmp_path / name)
        memory = json.loads((tmp_path / name / "memory.json").read_text())
        runs[name] = (result, memory["estimate"], caplog.text.count("read from the cache"))
    assert runs["unwritable"][2] == runs["cold"][2] == 0
    assert runs["warm"][2] == 3  # the tokenizer, the train split, the eval split
    assert len(set(digests)) == 1
    timed = ("tokens_per_s",)  # the only figure that depends on how fast the machine was
    for name in ("unwritable", "warm"):
        result, cold = ({k: v for k, v in runs[n][0].items() if k not in timed} for n in (name, "cold"))
        assert result == cold, name  # the evaluation after the step, the estimate's peak
        assert runs[name][1] == runs["cold"][1], name


def test_one_process_unwraps_its_model_without_importing_deepspeed():
    """``accelerator.unwrap_model`` imports deepspeed to test for its engine: a second of every run's wrap-up."""
    code = (
        "import sys, torch\n"
        "from rm.distributed.engine import AccelerateEngine\n"
        "engine = AccelerateEngine(cpu=True, precision='32-true', gradient_accumulation_steps=1, max_grad_norm=1.0)\n"
        "model = engine.prepare(torch.nn.Linear(2, 1), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),\n"
        "                       lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))\n"
        "unwrapped = engine.unwrapped_model()\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
        "assert unwrapped is engine.accelerator.unwrap_model(engine.model)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=CONF_DIR.parent, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(CONF_DIR.parent)})
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup"])
@pytest.mark.parametrize("warmup,total", [(0, 1), (1, 1), (3, 10), (5, 800), (40, 800), (7, 7)])
def test_the_schedule_is_transformers_at_every_step(kind, warmup, total):
    """rm's schedule (``rm.training.run_setup.lr_schedule``) stands in for transformers' ``get_scheduler``, whose module imports
    PEFT and bitsandbytes: the same learning rate after every step, to the bit, and a checkpoint of one loads in the
    other."""
    import torch
    from transformers import get_scheduler

    from rm.training.run_setup import lr_schedule

    ours, theirs = (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2e-3) for _ in range(2))
    mine, reference = lr_schedule(kind, ours, warmup, total), get_scheduler(kind, theirs, num_warmup_steps=warmup,
                                                                            num_training_steps=total)
    for _ in range(total + 2):
        assert mine.get_last_lr() == reference.get_last_lr()
        for opt, sched in ((ours, mine), (theirs, reference)):
            opt.step()
            sched.step()
    assert mine.state_dict() == reference.state_dict()


def test_a_full_fine_tune_imports_neither_peft_nor_bitsandbytes():
    """What a run without LoRA, 4-bit weights or 8-bit states never calls is not imported (seconds of its start-up)."""
    code = ("import sys, rm.train, rm.training.run_setup\n"
            "loaded = [m for m in ('peft', 'bitsandbytes', 'deepspeed') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=CONF_DIR.parent, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(CONF_DIR.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
