"""Tests for the synthetic preference data and the word-level tokenizer of its vocabulary (model.tokenizer=words)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

import pytest
import torch
from transformers import AutoTokenizer

from rm.data import synthetic
from rm.data.synthetic import emitted_words, generate_pairs, write_synthetic
from rm.data.tokenizer import VOCABULARY, build_word_level_tokenizer, encode_sides

SEP = "\n\nAssistant:"


@pytest.fixture(scope="module")
def tokenizer():
    return build_word_level_tokenizer()


@pytest.fixture(scope="module")
def train_pairs():
    return generate_pairs(2000, seed=0, split="train")


@pytest.fixture(scope="module")
def test_pairs():
    return generate_pairs(1000, seed=0, split="test")


def _split_last_answer(text: str) -> tuple[str, str]:
    prefix, answer = text.rsplit(SEP, 1)
    return prefix + SEP, answer


# --- determinism and splits -------------------------------------------------


def test_deterministic_for_same_arguments():
    assert generate_pairs(200, seed=3, split="train") == generate_pairs(200, seed=3, split="train")


def test_prefix_stable_across_n():
    # Growing n only appends pairs, so a small dataset is a prefix of a large one.
    assert generate_pairs(300, seed=3, split="train")[:100] == generate_pairs(100, seed=3, split="train")


def test_different_seed_gives_different_pairs():
    a = generate_pairs(200, seed=0, split="train")
    b = generate_pairs(200, seed=1, split="train")
    assert a != b
    # Not merely shifted or mostly shared: most pairs differ position by position.
    assert sum(x != y for x, y in zip(a, b)) > 150


def test_train_and_test_are_disjoint(train_pairs, test_pairs):
    train_keys = {(p["chosen"], p["rejected"]) for p in train_pairs}
    # A different test seed must not leak into train either.
    other_test = generate_pairs(1000, seed=7, split="test")
    for p in test_pairs + other_test:
        assert (p["chosen"], p["rejected"]) not in train_keys
    assert test_pairs != generate_pairs(1000, seed=0, split="train")


def test_invalid_arguments():
    with pytest.raises(ValueError):
        generate_pairs(10, seed=0, split="validation")
    with pytest.raises(ValueError):
        generate_pairs(-1, seed=0, split="train")
    assert generate_pairs(0, seed=0, split="train") == []


# --- format -------------------------------------------------------------------


def test_hh_format(train_pairs):
    assert len(train_pairs) == 2000
    n_multi_turn = 0
    for p in train_pairs:
        assert set(p) == {"chosen", "rejected"}
        chosen, rejected = p["chosen"], p["rejected"]
        assert chosen != rejected
        for text in (chosen, rejected):
            assert text.startswith("\n\nHuman: ")
            # The final turn is the assistant's, with a non-empty answer.
            assert text.rfind(SEP) > text.rfind("\n\nHuman:")
            assert _split_last_answer(text)[1].strip()
        c_prefix, c_answer = _split_last_answer(chosen)
        r_prefix, r_answer = _split_last_answer(rejected)
        assert c_prefix == r_prefix
        assert c_answer != r_answer
        n_multi_turn += chosen.count("\n\nHuman:") > 1
    # Filler turns make a good share of transcripts multi-turn.
    assert 0.2 < n_multi_turn / len(train_pairs) < 0.8


def test_vocabulary_is_sorted_and_unique():
    assert list(VOCABULARY) == sorted(set(VOCABULARY))
    # rm.data.tokenizer writes the words out (their ids must not move); the generator must emit exactly those.
    assert emitted_words() == VOCABULARY
    for word in ("Human", "Assistant", ":", ".", "?"):
        assert word in VOCABULARY


def test_no_unknown_tokens(tokenizer, train_pairs):
    texts = [t for p in train_pairs for t in (p["chosen"], p["rejected"])]
    ids = tokenizer(texts)["input_ids"]
    unk = tokenizer.unk_token_id
    bad = [t for t, row in zip(texts, ids) if unk in row]
    assert not bad, bad[:3]
    # Every vocabulary word is actually used somewhere (no dead entries from typos).
    used = {i for row in ids for i in row}
    unused = [w for w in VOCABULARY if tokenizer.convert_tokens_to_ids(w) not in used]
    assert set(unused) <= {"System"}, unused


def test_length_spread(tokenizer, train_pairs):
    lengths = [len(row) for row in tokenizer([p["chosen"] for p in train_pairs])["input_ids"]]
    lengths.sort()
    median = statistics.median(lengths)
    p95 = lengths[int(0.95 * len(lengths))]
    assert p95 >= 2 * median
    assert sum(n < 128 for n in lengths) / len(lengths) > 0.9
    assert sum(n < 256 for n in lengths) / len(lengths) > 0.99


# --- tokenizer ---------------------------------------------------------------


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<unk>", "<s>", "</s>"]) == [0, 1, 2, 3]
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id) == (0, 1)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (2, 3)
    assert tokenizer.padding_side == "right"
    assert len(tokenizer) == 4 + len(VOCABULARY)

    # A BOS is added, as Llama's and Mistral's tokenizers do (rm.data.tokenizer.BOS_ONLY); training appends the EOS.
    ids = tokenizer("Hello! What is my name?")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "Hello", "!", "What", "is", "my", "name", "?"]
    assert tokenizer("Hello!", add_special_tokens=False)["input_ids"] == ids[1:3]
    # Out-of-vocabulary words map to <unk> rather than failing.
    assert tokenizer("zebra", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


def test_tokenizer_round_trip(tokenizer, train_pairs, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = [p["chosen"] for p in train_pairs[:50]] + ["an unknown zebra sentence"]
    assert reloaded(texts)["input_ids"] == tokenizer(texts)["input_ids"]
    for attr in ("pad_token", "unk_token", "bos_token", "eos_token", "padding_side", "model_max_length"):
        assert getattr(reloaded, attr) == getattr(tokenizer, attr), attr
    assert reloaded.chat_template == tokenizer.chat_template
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    batch = reloaded(["Hello!", "What is my name?"], padding=True)
    assert batch["input_ids"][0][-1] == reloaded.pad_token_id  # right padding


def test_chat_template(tokenizer):
    messages = [
        {"role": "user", "content": "What is my name?"},
        {"role": "assistant", "content": "Your name is Anna."},
    ]
    # BOS, the HH transcript, and an EOS after the final answer, as Mistral's template writes them.
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<s>\n\nHuman: What is my name?\n\nAssistant: Your name is Anna.</s>"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s>\n\nHuman: What is my name?\n\nAssistant:"
    system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Good morning."}] + messages[:1], tokenize=False
    )
    assert system == "<s>\n\nSystem: Good morning.\n\nHuman: What is my name?"
    # A conversation gets the ids of its transcript as a plain-text side (rm.data.tokenizer.encode_sides).
    transcript = "\n\nHuman: What is my name?\n\nAssistant: Your name is Anna."
    assert tokenizer.apply_chat_template(messages)["input_ids"] == encode_sides(tokenizer, [transcript], templated=False)[0]
    assert tokenizer.unk_token_id not in tokenizer(system)["input_ids"]


# --- CLI ---------------------------------------------------------------------


def test_write_synthetic_and_cli(tmp_path):
    paths = write_synthetic(tmp_path / "a", n_train=30, n_test=12, seed=5)
    assert set(paths) == {"train", "test"}
    assert paths["train"].name == "train.jsonl" and paths["test"].name == "test.jsonl"
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    assert rows == generate_pairs(30, seed=5, split="train")

    out = tmp_path / "b"
    cli_paths = synthetic.main(["--out", str(out), "--n-train", "25", "--n-test", "7", "--seed", "5"])
    for split, n in (("train", 25), ("test", 7)):
        lines = (out / f"{split}.jsonl").read_text().splitlines()
        assert len(lines) == n
        assert all(set(json.loads(line)) == {"chosen", "rejected"} for line in lines)
        assert cli_paths[split] == out / f"{split}.jsonl"


# --- learnability: the response alone is not enough ---------------------------


def _word_counts(texts, tokenizer) -> list[dict[int, int]]:
    """Bag-of-words counts of each text, keyed by token id (no special tokens)."""
    out = []
    for seq in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        counts: dict[int, int] = defaultdict(int)
        for i in seq:
            counts[i] += 1
        out.append(counts)
    return out


def _pair_features(pairs, tokenizer, with_prompt: bool) -> torch.Tensor:
    """Pairwise features phi(chosen) - phi(rejected), one row per pair.

    Response-only: phi is the bag of words of the final answer. With the prompt:
    additionally, for each answer word, its count if the word also occurs in
    the prompt (a "copies from the prompt" feature). The prompt is shared by
    both sides, so its own bag of words would cancel in the difference.
    """
    v = len(tokenizer)
    prompts, c_answers = zip(*(_split_last_answer(p["chosen"]) for p in pairs))
    r_answers = [_split_last_answer(p["rejected"])[1] for p in pairs]
    x = torch.zeros(len(pairs), 2 * v if with_prompt else v)
    for row, (pb, cb, rb) in enumerate(
        zip(
            _word_counts(prompts, tokenizer),
            _word_counts(c_answers, tokenizer),
            _word_counts(r_answers, tokenizer),
        )
    ):
        for j in set(cb) | set(rb):
            d = cb.get(j, 0) - rb.get(j, 0)
            x[row, j] = d
            if with_prompt and j in pb:
                x[row, v + j] = d
    return x


def _fit_and_score(train_x: torch.Tensor, test_x: torch.Tensor, steps: int = 300) -> float:
    """Pairwise logistic regression (-logsigmoid(w . diff)); returns test accuracy."""
    w = torch.zeros(train_x.shape[1], requires_grad=True)
    opt = torch.optim.Adam([w], lr=0.05)
    for _ in range(steps):
        loss = -torch.nn.functional.logsigmoid(train_x @ w).mean() + 1e-4 * (w**2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        margin = test_x @ w
    # Ties (e.g. an unseen word) count as half right, like a coin flip.
    return ((margin > 0).float() + 0.5 * (margin == 0).float()).mean().item()


def test_response_only_baseline_cannot_solve_task(tokenizer, train_pairs, test_pairs):
    torch.manual_seed(0)
    response_acc = _fit_and_score(
        _pair_features(train_pairs, tokenizer, with_prompt=False),
        _pair_features(test_pairs, tokenizer, with_prompt=False),
    )

    # Best possible response-only memoriser: score each distinct answer string
    # by how often it was chosen versus rejected in train.
    counts = defaultdict(lambda: [0, 0])
    for p in train_pairs:
        counts[_split_last_answer(p["chosen"])[1]][0] += 1
        counts[_split_last_answer(p["rejected"])[1]][1] += 1

    def memo(answer):
        c, r = counts[answer]
        return (c + 1) / (c + r + 2)

    memo_acc = 0.0
    for p in test_pairs:
        c = memo(_split_last_answer(p["chosen"])[1])
        r = memo(_split_last_answer(p["rejected"])[1])
        memo_acc += (c > r) + 0.5 * (c == r)
    memo_acc /= len(test_pairs)

    # Same model plus "answer word occurs in the prompt" features: crude (it
    # cannot compare numbers or check category membership), but it relates
    # the answer to the prompt.
    aware_acc = _fit_and_score(
        _pair_features(train_pairs, tokenizer, with_prompt=True),
        _pair_features(test_pairs, tokenizer, with_prompt=True),
    )

    # The unhelpful pairs give the response-only models some signal, but far
    # from all of it.
    assert 0.5 < response_acc < 0.8, response_acc
    assert 0.5 < memo_acc < 0.85, memo_acc
    # Reading the prompt helps a lot, even with this crude model.
    assert aware_acc > max(response_acc, memo_acc) + 0.1, (aware_acc, response_acc, memo_acc)


def test_preference_is_determined_by_prompt(train_pairs, test_pairs):
    # A prompt-aware model can reach 100% only if no answer is preferred for one
    # occurrence of a prompt and dispreferred for another.
    chosen_for = defaultdict(set)
    rejected_for = defaultdict(set)
    for p in train_pairs + test_pairs:
        prefix, c_answer = _split_last_answer(p["chosen"])
        chosen_for[prefix].add(c_answer)
        rejected_for[prefix].add(_split_last_answer(p["rejected"])[1])
    for prefix in chosen_for:
        assert not chosen_for[prefix] & rejected_for[prefix], prefix
    # Whereas the answer alone is ambiguous: in most pairs the chosen answer
    # string is the rejected answer of some other pair.
    rejected_answers = {a for s in rejected_for.values() for a in s}
    pairs = train_pairs + test_pairs
    ambiguous = sum(_split_last_answer(p["chosen"])[1] in rejected_answers for p in pairs)
    assert ambiguous > 0.5 * len(pairs)


# --- multi-turn mode (data.synthetic_multi_turn) ------------------------------


def test_single_turn_stream_is_unchanged_by_the_multi_turn_option():
    """The first 20 single-turn pairs of seed 0 hash as they did before multi-turn mode existed (the demo's data)."""
    import hashlib

    pairs = generate_pairs(20, seed=0, split="train", multi_turn=False)
    digest = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()
    assert digest == "5c15f518f573e6ff1f7993db7f92ae555e27d6ee7e119047130e787d1198b56d"


def test_multi_turn_pairs_are_hh_like_and_mostly_shared_prompt(tokenizer):
    """Every conversation has at least two human turns, the sides differ only after the last
    "Assistant:", no token is unknown, and the shared prompt carries over 95% of the pairs' tokens
    (counted once per side, as an unshared trainer computes them); single-turn pairs share less."""
    from rm.data.collator import common_prefix_length

    def prefix_share(pairs):
        shared = total = 0
        for p in pairs:
            c, r = tokenizer(p["chosen"])["input_ids"], tokenizer(p["rejected"])["input_ids"]
            shared, total = shared + 2 * common_prefix_length(c, r), total + len(c) + len(r)
        return shared / total

    pairs = generate_pairs(500, seed=0, split="train", multi_turn=True)
    assert pairs != generate_pairs(500, seed=0, split="train")
    for p in pairs:
        assert p["chosen"].count("\n\nHuman:") >= 2
        assert _split_last_answer(p["chosen"])[0] == _split_last_answer(p["rejected"])[0]
        assert tokenizer.unk_token_id not in tokenizer(p["chosen"] + p["rejected"])["input_ids"]
    multi, single = prefix_share(pairs), prefix_share(generate_pairs(500, seed=0, split="train"))
    assert multi > 0.95 and multi > single, (multi, single)
