"""Deterministic synthetic pairwise preference data in Anthropic HH-RLHF format.

The data exists so the whole training pipeline can be exercised end to end on a
laptop CPU, without a model or dataset hub, and so that a tiny reward model
trained on it gives a meaningful accuracy number.

Every pair is two full transcripts (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``)
that share everything up to the last ``"\\n\\nAssistant:"`` and differ only in
the final answer. Two task families are mixed, both of which need the answer
to be checked against the prompt (a copy, which a 2-layer transformer learns
in a few hundred steps):

* **Fact recall** – the human states a fact ("My favourite colour is red.",
  possibly several turns earlier, sometimes next to a same-category fact about
  someone else) and later asks for it. The chosen answer uses the stated value,
  the rejected one another value of the same closed set (by default never the
  relative's value; see ``_DISTRACTOR_AS_REJECTED_PROB``).
* **Repeat** – the human asks the assistant to repeat one or two words; the
  rejected answer swaps one word for another word of the same set.
* **Unhelpful** – on a minority of pairs (any family) the rejected answer is
  replaced by a generic refusal such as "I don't know.".

Tasks that need world knowledge (which number is larger, is a fox an animal)
were tried and left out: a tiny model does not learn them within the demo's
few minutes on a CPU.

Why a response-only model cannot reach 100%: in both families the value in the
answer is drawn uniformly from a closed set, and every value is as likely to
be the chosen one as the rejected one, so the final answer alone carries no
information about which side is preferred; only relating it to the prompt
does. Only the unhelpful pairs can be scored from the response alone, which
puts a response-only model near 50% on most pairs and around 60% overall
(``tests/data/test_synthetic.py`` measures a bag-of-words model on the answers),
while a model that reads prompt and response can be right on every pair.

Filler turns (greetings, chit-chat) of varied length come before the task so
that sequence lengths have a long-tailed spread: most transcripts are short, a
few are several times the median, and nearly all stay under ~120 words.

**Multi-turn mode** (``multi_turn=True``, ``data.synthetic_multi_turn``): every
conversation first has 1 to 4 earlier exchanges of chit-chat (human turns of 1 to
3 sentences, assistant replies of 1 to 2), as HH-RLHF conversations do, so the
prompt the two transcripts share carries most of each pair's tokens: with the
word-level tokenizer (``model.tokenizer=words``), a median of 139 tokens per side and about 98% of a pair's
tokens in the prompt (counted once per side; prompt : answers about 23 : 1),
against 33 tokens and 93% in single-turn mode.
This is the data on which scoring the shared prompt once (``train.share_prefix``)
pays. The task and the answers are drawn as in single-turn mode, from the same
closed vocabulary.

The generator uses a closed vocabulary: :func:`emitted_words` collects every
literal fragment and slot value below, split the way the ``tokenizers``
``Whitespace`` pre-tokenizer splits text (``\\w+|[^\\w\\s]+``); they are the words of the word-level
tokenizer (:data:`rm.data.tokenizer.VOCABULARY`, ``model.tokenizer=words``), which so covers the data with no unknown
tokens. The demo's default, a byte-level BPE trained on the data, covers any text.

Train and test are kept disjoint by construction: each pair is assigned to a
split by a stable hash of its text and sampling rejects pairs that hash to the
other split, so no test pair can equal a train pair whatever the seeds and
sizes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import string
from pathlib import Path
from typing import Sequence

__all__ = [
    "emitted_words",
    "SPLITS",
    "generate_pairs",
    "write_synthetic",
    "main",
]

SPLITS = ("train", "test")

# Share of the pair space (by stable hash) that belongs to the test split.
_TEST_BUCKETS = 20  # out of 100

# Same rule as ``tokenizers.pre_tokenizers.Whitespace``.
_PRETOKENIZE_RE = re.compile(r"\w+|[^\w\s]+")

_ROLE_WORDS = ("Human", "Assistant", "System", ":")

# ---------------------------------------------------------------------------
# Slot values. All lower-case except proper nouns, so that the answer copies the
# exact token seen in the prompt.
# ---------------------------------------------------------------------------
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")
ANIMALS = ("cat", "dog", "horse", "rabbit", "parrot", "turtle", "fox", "owl")
FRUITS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum")
CITIES = ("Paris", "London", "Tokyo", "Berlin", "Rome", "Madrid", "Cairo", "Lima")
NAMES = ("Anna", "Ben", "Carla", "David", "Elena", "Frank", "Grace", "Hugo")
SPORTS = ("tennis", "football", "golf", "hockey", "chess", "boxing", "rugby", "cricket")
RELATIVES = ("sister", "brother", "friend", "mother", "father", "cousin")

# Fact-recall templates: (statement about me, statement about a relative,
# questions, answer templates, value set). "{r}" is a relative, "{v}" the value.
_FACTS = (
    (
        "My favourite colour is {v}.",
        "My {r}'s favourite colour is {v}.",
        ("What is my favourite colour?", "Do you remember my favourite colour?"),
        ("Your favourite colour is {v}.", "It is {v}."),
        COLOURS,
    ),
    (
        "I have a pet {v} at home.",
        "My {r} has a pet {v}.",
        ("What kind of pet do I have?", "Which pet do I have at home?"),
        ("You have a pet {v}.", "It is a {v}."),
        ANIMALS,
    ),
    (
        "The fruit I like best is the {v}.",
        "The fruit my {r} likes best is the {v}.",
        ("Which fruit do I like best?", "What is my favourite fruit?"),
        ("You like the {v} best.", "Your favourite fruit is the {v}."),
        FRUITS,
    ),
    (
        "I live in {v}.",
        "My {r} lives in {v}.",
        ("Which city do I live in?", "Where do I live?"),
        ("You live in {v}.", "Your city is {v}."),
        CITIES,
    ),
    (
        "My name is {v}.",
        "My {r} is called {v}.",
        ("What is my name?", "Do you remember my name?"),
        ("Your name is {v}.", "You are {v}."),
        NAMES,
    ),
    (
        "The sport I play is {v}.",
        "My {r} plays {v}.",
        ("Which sport do I play?", "What sport do I play?"),
        ("You play {v}.", "Your sport is {v}."),
        SPORTS,
    ),
)

# Fact stated inside the final question turn, before the question.
_FACT_LEADS = ("", "Here is something about me.", "Let me tell you something.")
# Assistant reply when the fact is stated in an earlier turn.
_ACKS = (
    "Thanks for telling me.",
    "Got it, I will remember that.",
    "Nice, that is good to know.",
    "Okay, noted.",
)

_REPEAT_WORDS = COLOURS + ANIMALS + FRUITS + SPORTS
_REPEAT_QUESTIONS = (
    "Please repeat these words : {w}.",
    "Can you say these words back to me : {w}?",
    "Repeat after me : {w}.",
)
_REPEAT_ANSWERS = ("{w}.", "Sure : {w}.")

_UNHELPFUL = (
    "I don't know.",
    "Sorry, I cannot help with that.",
    "I am not sure, please ask someone else.",
    "That is not something I can answer.",
)

# Filler chit-chat. Sentences of very different lengths so that transcripts
# get a long-tailed length distribution.
_FILLER_HUMAN = (
    "Hi there.",
    "Hello!",
    "Good morning.",
    "Can you help me with a few questions?",
    "I have a question for you.",
    "Hello, I hope you are doing well today.",
    "I had a long day at work and I am quite tired now.",
    "My friend told me that you are good at answering questions.",
    "I am planning a small trip with my family next month.",
    "The weather here has been cold and rainy for most of the week, so I stayed inside.",
    "Yesterday I went for a long walk in the park near my house and saw many birds.",
    "I am trying to learn cooking and painting this year, but it is hard to find the time.",
)
_FILLER_ASSISTANT = (
    "Hello! How can I help you today?",
    "Of course, I am happy to help.",
    "Sure, go ahead and ask me anything.",
    "That sounds nice.",
    "I am sorry to hear that. Try to take a break when you can.",
    "That sounds like a lovely time.",
    "Good luck with that! Learning new things takes time, so be patient with yourself.",
)
# Number of filler exchanges before the task, heavily skewed to few turns.
_FILLER_TURN_WEIGHTS = (50, 25, 13, 8, 4)  # for 0, 1, 2, ... turns
# Number of sentences in one filler human turn.
_FILLER_SENTENCE_WEIGHTS = (70, 20, 8, 2)  # for 1, 2, 3, 4 sentences

# Mix of task families (relative weights).
_TASK_WEIGHTS = {"fact": 60, "repeat": 40}
# Probability that the rejected answer is replaced by a generic refusal. This
# is the only signal a response-only model can use.
_UNHELPFUL_PROB = 0.2
# Probability that a fact-recall prompt also mentions a relative's value of the
# same category, and, given that, that the rejected answer uses the relative's
# value, so that "the value appears in the prompt" is not always enough.
_DISTRACTOR_PROB = 0.3
_DISTRACTOR_AS_REJECTED_PROB = 0.0
# Probability that the fact is stated in an earlier turn rather than in the
# question turn.
_EARLIER_TURN_PROB = 0.4


def _literal_texts() -> list[str]:
    """Collects every literal text the generator can emit, placeholders removed."""
    templates: list[str] = []
    for me, rel, questions, answers, _values in _FACTS:
        templates += [me, rel, *questions, *answers]
    templates += list(_FACT_LEADS) + list(_ACKS)
    templates += list(_REPEAT_QUESTIONS) + list(_REPEAT_ANSWERS)
    templates += list(_UNHELPFUL) + list(_FILLER_HUMAN) + list(_FILLER_ASSISTANT)
    texts = [
        literal
        for template in templates
        for literal, _field, _spec, _conv in string.Formatter().parse(template)
    ]
    values = COLOURS + ANIMALS + FRUITS + CITIES + NAMES + SPORTS + RELATIVES
    texts += list(values)
    texts += list(_ROLE_WORDS)
    return texts


def emitted_words() -> tuple[str, ...]:
    """Every token the generator can emit, sorted, as the ``Whitespace`` pre-tokenizer splits text: the words
    :data:`rm.data.tokenizer.VOCABULARY` must hold (``tests/data/test_synthetic.py`` holds them equal)."""
    words: set[str] = set()
    for text in _literal_texts():
        words.update(_PRETOKENIZE_RE.findall(text))
    return tuple(sorted(words))


def _transcript(turns: Sequence[tuple[str, str]]) -> str:
    """Renders (role, text) turns as an HH-RLHF transcript."""
    return "".join(f"\n\n{role}: {text}" for role, text in turns)


def _filler_turns(rng: random.Random) -> list[tuple[str, str]]:
    """Draws zero or more chit-chat exchanges to precede the task."""
    n_turns = rng.choices(range(len(_FILLER_TURN_WEIGHTS)), weights=_FILLER_TURN_WEIGHTS)[0]
    turns: list[tuple[str, str]] = []
    for _ in range(n_turns):
        n_sent = 1 + rng.choices(
            range(len(_FILLER_SENTENCE_WEIGHTS)), weights=_FILLER_SENTENCE_WEIGHTS
        )[0]
        human = " ".join(rng.sample(_FILLER_HUMAN, n_sent))
        turns += [("Human", human), ("Assistant", rng.choice(_FILLER_ASSISTANT))]
    return turns


def _other(rng: random.Random, values: Sequence[str], *exclude: str) -> str:
    """Draws a value from ``values`` that is not in ``exclude``."""
    return rng.choice([v for v in values if v not in exclude])


def _task_fact(rng: random.Random) -> tuple[list[tuple[str, str]], str, str]:
    me, rel, questions, answers, values = rng.choice(_FACTS)
    value = rng.choice(values)
    facts = [me.format(v=value)]
    wrong = _other(rng, values, value)
    if rng.random() < _DISTRACTOR_PROB:
        other = _other(rng, values, value, wrong)
        facts.append(rel.format(r=rng.choice(RELATIVES), v=other))
        rng.shuffle(facts)
        if rng.random() < _DISTRACTOR_AS_REJECTED_PROB:
            wrong = other
    question = rng.choice(questions)
    answer = rng.choice(answers)
    if rng.random() < _EARLIER_TURN_PROB:
        turns = [("Human", " ".join(facts)), ("Assistant", rng.choice(_ACKS))]
        turns += _filler_turns(rng)[:2]  # a short gap between fact and question
        turns.append(("Human", question))
    else:
        lead = rng.choice(_FACT_LEADS)
        turns = [("Human", " ".join(filter(None, [lead, *facts, question])))]
    return turns, answer.format(v=value), answer.format(v=wrong)


def _task_repeat(rng: random.Random) -> tuple[list[tuple[str, str]], str, str]:
    k = rng.randint(1, 2)
    words = rng.sample(_REPEAT_WORDS, k)
    altered = list(words)
    altered[rng.randrange(k)] = _other(rng, _REPEAT_WORDS, *words)
    question = rng.choice(_REPEAT_QUESTIONS).format(w=" ".join(words))
    answer = rng.choice(_REPEAT_ANSWERS)
    return (
        [("Human", question)],
        answer.format(w=" ".join(words)),
        answer.format(w=" ".join(altered)),
    )


_TASKS = {
    "fact": _task_fact,
    "repeat": _task_repeat,
}


# Multi-turn mode: earlier exchanges, and sentences per human turn / per assistant reply in them.
_HISTORY_EXCHANGES = (1, 4)
_HISTORY_HUMAN_SENTENCES = (1, 3)
_HISTORY_ASSISTANT_SENTENCES = (1, 2)


def _history(rng: random.Random) -> list[tuple[str, str]]:
    """Earlier exchanges of a multi-turn conversation: chit-chat before the task."""
    turns: list[tuple[str, str]] = []
    for _ in range(rng.randint(*_HISTORY_EXCHANGES)):
        human = " ".join(rng.sample(_FILLER_HUMAN, rng.randint(*_HISTORY_HUMAN_SENTENCES)))
        reply = " ".join(rng.sample(_FILLER_ASSISTANT, rng.randint(*_HISTORY_ASSISTANT_SENTENCES)))
        turns += [("Human", human), ("Assistant", reply)]
    return turns


def _one_pair(rng: random.Random, multi_turn: bool = False) -> dict[str, str]:
    """Draws one pair (without regard to the split)."""
    names = list(_TASK_WEIGHTS)
    task = rng.choices(names, weights=[_TASK_WEIGHTS[n] for n in names])[0]
    turns, chosen, rejected = _TASKS[task](rng)
    if task != "fact":
        turns = _filler_turns(rng) + turns
    if rng.random() < _UNHELPFUL_PROB:
        rejected = rng.choice(_UNHELPFUL)
    if multi_turn:  # drawn last, so that the single-turn stream of draws is unchanged by the option's existence
        turns = _history(rng) + turns
    prefix = _transcript(turns) + "\n\nAssistant: "
    return {"chosen": prefix + chosen, "rejected": prefix + rejected}


def _split_of(pair: dict[str, str]) -> str:
    """Assigns a pair to a split by a stable hash of its text.

    Python's ``hash`` is salted per process, so a cryptographic hash is used to
    keep the assignment identical across runs and machines.
    """
    digest = hashlib.sha256(
        (pair["chosen"] + "\x1f" + pair["rejected"]).encode("utf-8")
    ).digest()
    return "test" if int.from_bytes(digest[:8], "big") % 100 < _TEST_BUCKETS else "train"


def generate_pairs(n: int, seed: int, split: str, multi_turn: bool = False) -> list[dict[str, str]]:
    """Generates synthetic HH-RLHF style preference pairs.

    Args:
        n: Number of pairs to return.
        seed: Base random seed. The split name is mixed into it, so the same
            seed gives different train and test data.
        split: ``"train"`` or ``"test"``. Pairs are additionally filtered by a
            stable hash so the two splits never share an identical pair.
        multi_turn: Precede every task with 2 to 6 exchanges of chit-chat, so that
            the shared prompt carries most of the tokens (see the module doc).

    Returns:
        A list of ``n`` dicts with keys ``"chosen"`` and ``"rejected"``, each a
        full transcript starting with ``"\\n\\nHuman:"``; the two transcripts
        share everything up to the last ``"\\n\\nAssistant:"``.

    Raises:
        ValueError: If ``split`` is unknown or ``n`` is negative.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # A string seed is hashed deterministically by random.Random (version 2),
    # independent of PYTHONHASHSEED.
    rng = random.Random(f"rm-synthetic:{seed}:{split}" + (":multi-turn" if multi_turn else ""))
    pairs: list[dict[str, str]] = []
    while len(pairs) < n:
        pair = _one_pair(rng, multi_turn)
        if _split_of(pair) == split:
            pairs.append(pair)
    return pairs


def _write_jsonl(path: Path, rows: Sequence[dict[str, str]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_synthetic(out_dir: str | Path, n_train: int, n_test: int, seed: int) -> dict[str, Path]:
    """Writes ``train.jsonl`` and ``test.jsonl`` synthetic preference files.

    Args:
        out_dir: Directory to write into; created if missing.
        n_train: Number of train pairs.
        n_test: Number of test pairs.
        seed: Base random seed (see :func:`generate_pairs`).

    Returns:
        ``{"train": path, "test": path}`` to the written JSONL files, one
        ``{"chosen": ..., "rejected": ...}`` object per line.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, n in (("train", n_train), ("test", n_test)):
        path = out / f"{split}.jsonl"
        _write_jsonl(path, generate_pairs(n, seed, split))
        paths[split] = path
    return paths


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    """Command-line entry point: ``python -m rm.data.synthetic --out DIR ...``.

    Args:
        argv: Arguments to parse; ``None`` reads ``sys.argv``.

    Returns:
        The paths written, as returned by :func:`write_synthetic`.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--n-train", type=int, default=8000, help="number of train pairs")
    parser.add_argument("--n-test", type=int, default=1000, help="number of test pairs")
    parser.add_argument("--seed", type=int, default=0, help="base random seed")
    args = parser.parse_args(argv)
    paths = write_synthetic(args.out, args.n_train, args.n_test, args.seed)
    counts = {"train": args.n_train, "test": args.n_test}
    for split, path in paths.items():
        print(f"{split}: {counts[split]} pairs -> {path}")
    return paths


if __name__ == "__main__":
    main()
