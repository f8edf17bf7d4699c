"""Property-based tests (hypothesis) of the data loader and config validation, and corrupted jsonl.

What must hold for any input: the pipeline either gives a clear error of a documented kind
(ValueError / ConfigError / FileNotFoundError, naming the key, file or row) or keeps going with
every row accounted for. Never a raw decoder, arrow or key error half-way through.
"""

import json
import random

import datasets
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rm.data.audit import audit_split  # noqa: E402
from rm.data.build import build_split  # noqa: E402
from rm.data.normalise import normalise_pairs  # noqa: E402
from rm.data.tokenise import pair_lengths, tokenize_pairs  # noqa: E402
from rm.data.synthetic import write_synthetic  # noqa: E402
from rm.foundations.config import compose  # noqa: E402
from rm.foundations.hardware import resolve_hardware  # noqa: E402
from rm.data.build import train_pairs  # noqa: E402
from rm.data.tokenizer import run_tokenizer  # noqa: E402
from rm.settings.validate import ConfigError, validate  # noqa: E402

FAST = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
_TINY = compose(["experiment=tiny", "data.synthetic_train_size=512"])
TOKENIZER = run_tokenizer(_TINY.model, train_pairs(_TINY.data))  # the default byte-level BPE, trained on synthetic pairs
# Any string: words the tokenizer knows, unknown ones, control characters, emoji, the pad token itself.
TEXT = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(["Human:", "Assistant:", "\n\n", "the", "cat", "[PAD]", "🙂", "", " "]), max_size=60).map("".join),
)
VALUE = st.one_of(TEXT, st.none(), st.integers(), st.floats(allow_nan=True), st.lists(st.integers(), max_size=3))


@pytest.mark.reliability("Data", "any rows at all (property-based: random strings, numbers, lists, None)", "every row kept or dropped for a counted reason")
@FAST
@given(rows=st.lists(st.fixed_dictionaries({"prompt": VALUE, "chosen": VALUE, "rejected": VALUE}), min_size=1, max_size=20),
       max_length=st.integers(min_value=2, max_value=64),
       truncation=st.sampled_from(["truncate", "drop"]),
       identical=st.sampled_from(["drop", "keep"]),
       duplicates=st.sampled_from(["keep", "drop"]))
def test_any_rows_are_kept_or_skipped_and_counted(rows, max_length, truncation, identical, duplicates):
    raw = datasets.Dataset.from_list([{k: json.dumps(v) if not isinstance(v, str) and v is not None else v
                                       for k, v in r.items()} for r in rows])
    pairs, norm = normalise_pairs(raw, "prompt", TOKENIZER, on_malformed="skip")
    tokenised, counts = tokenize_pairs(pairs, TOKENIZER, max_length, truncation=truncation, on_malformed="skip",
                                       identical=identical, duplicates=duplicates, counts=norm)
    # audit_split raises when the rows read less the drops by reason are not the pairs kept.
    audit = audit_split(counts, *pair_lengths(tokenised))
    assert audit["pairs_in"] == len(rows) and audit["pairs_out"] == len(tokenised)
    for row in tokenised:
        assert 0 < len(row["chosen_input_ids"]) <= max_length and 0 < len(row["rejected_input_ids"]) <= max_length


@pytest.mark.reliability("Configuration", "any sizes at all (property-based)", "a plan whose accumulation x micro x world = global, or a `ConfigError` naming `train.`/`data.`/`lora.` keys")
@FAST
@given(micro=st.integers(-2, 64), global_=st.integers(-2, 256), eval_=st.integers(-2, 64),
       max_length=st.integers(-2, 1024), r=st.integers(-2, 64), world=st.integers(1, 8),
       warmup=st.floats(-1, 2, allow_nan=False))
def test_any_sizes_validate_to_a_plan_or_an_error_naming_the_keys(micro, global_, eval_, max_length, r, world, warmup):
    cfg = compose(["experiment=tiny", "memory_profile=lora"])
    cfg.hardware = resolve_hardware(cfg.hardware)
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.eval_batch_size = micro, global_, eval_
    cfg.data.max_length, cfg.lora.r, cfg.train.optim.warmup_ratio = max_length, r, warmup
    try:
        plan = validate(cfg, world)
    except ConfigError as err:
        message = str(err)
        assert any(key in message for key in ("train.", "data.", "lora.")), message
        return
    assert plan.gradient_accumulation_steps * micro * world == global_
    assert micro > 0 and eval_ > 0 and r > 0 and 0 < max_length <= cfg.model.max_position_embeddings


@pytest.fixture(scope="module")
def clean_jsonl(tmp_path_factory):
    out = write_synthetic(tmp_path_factory.mktemp("clean"), n_train=40, n_test=8, seed=0)
    return out["train"].read_bytes()


@pytest.mark.reliability("Data", "invalid JSON line", "stops, naming the file, the line and the column")
@pytest.mark.reliability("Data", "a file that is not UTF-8, or cut inside a character", "stops, naming the file, line and byte, with the fix (`iconv`)")
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 12), truncate=st.booleans())
def test_corrupted_jsonl_gives_a_clear_error_or_counted_skips(tmp_path_factory, clean_jsonl, seed, flips, truncate):
    rng = random.Random(seed)
    data = bytearray(clean_jsonl)
    for _ in range(flips):  # overwrite random bytes with random values: broken JSON, broken UTF-8, stray quotes
        data[rng.randrange(len(data))] = rng.choice([0x22, 0x7B, 0x7D, 0x0A, 0xFF, 0xC3, 0x00, rng.randrange(256)])
    if truncate:  # a file cut short, e.g. a copy that stopped
        data = data[: rng.randrange(1, len(data))]
    path = tmp_path_factory.mktemp("fuzz") / "train.jsonl"
    path.write_bytes(bytes(data))
    cfg = compose(["experiment=tiny", "data=local", f"data.train_files=[{path}]", f"data.eval_files=[{path}]",
                   "data.max_length=64"])
    try:
        ds, counts = build_split(cfg.data, TOKENIZER, "train")
    except ValueError as err:  # ConfigError is a ValueError too
        assert str(path) in str(err) or "data local [train]" in str(err), err
        return
    assert len(ds) == counts.pairs_out > 0
