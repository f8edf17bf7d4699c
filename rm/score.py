"""Score pairs or single texts with a trained reward model.

    python -m rm.score --model outputs/.../final --input pairs.jsonl [--output scored.jsonl]

The scored rows are JSON lines on stdout (``--output -`` too; the counts and the accuracy then go to stderr), or in
the ``--output`` file.

Pairs (any layout ``rm.train`` reads: HH transcripts, prompt/chosen/rejected,
conversational messages) get ``reward_chosen``/``reward_rejected`` and the
pairwise accuracy is printed; rows with a ``text`` column get ``reward``, and so
do single conversations (chat rollouts: a ``messages`` list and no ``chosen``),
rendered by the bundle's chat template as a pair's side is.
Only transformers (and PEFT for a LoRA adapter directory, whose base is the one
``adapter_config.json`` names or the ``base/`` saved beside it) is used to load the
model, so this also checks that a saved model is usable outside ``rm``; each text is
tokenised as training tokenised its sides (:func:`rm.data.tokenizer.encode_sides`, with the
bundle's ``trained_tokenizer/``: a plain text gets the EOS appended unless it ends with it,
a conversation is rendered by the chat template) and its reward read at its last token, the
EOS (docs/export.md, "Use your reward model"). ``--normalize`` reports
``(reward - mean) / std`` with the eval statistics of ``reward_stats.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import List, Optional, Sequence

from rm.foundations.errors import ConfigError, DataError, boundary, stop_on_signals


def score_token_rows(model, tokenizer, rows: Sequence[Sequence[int]], batch_size: int) -> List[float]:
    """Rewards of already tokenised sequences, in order, read at each one's last real token."""
    import torch  # here, so that --help answers without loading torch

    from rm.modelling.model import sequence_rewards

    rewards: List[float] = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = tokenizer.pad({"input_ids": list(rows[start : start + batch_size])}, return_tensors="pt")
            out = sequence_rewards(model, batch["input_ids"].to(device), batch["attention_mask"].to(device))
            rewards += out.float().cpu().tolist()
    return rewards


def reward_function(model_dir: str, *, device: Optional[str] = None, batch_size: int = 16, max_length: int = 2048):
    """A bundle as a TRL reward function (GRPO, RLOO), scoring as training tokenised its sides:
    ``GRPOTrainer(reward_funcs=reward_function("outputs/<date>/<time>/final"), ...)``.

    TRL's own path for a reward model given by its path tokenises ``prompt + completion`` with
    ``add_special_tokens=False`` after decoding the completion without its EOS: a plain text then has neither the
    BOS nor the EOS it trained with, and its reward is read at another token. Here each prompt and completion is
    joined and tokenised by :func:`rm.data.tokenizer.encode_sides` with the bundle's ``trained_tokenizer/``: plain text
    with the tokenizer's special tokens and the EOS appended, a conversation (lists of messages) rendered by the
    chat template. The model loads once, in eval mode, on ``device`` (default: CUDA when there is one).

    Returns:
        ``rm_reward(prompts, completions, **kwargs) -> list[float]``, one reward per completion.
    """
    import torch

    from rm.data.tokenise import leading_special_ids, truncate_left
    from rm.modelling.bundle import bundle_tokenizer, load_checked_bundle
    from rm.data.tokenizer import encode_sides

    directory = check_model_dir(model_dir)
    tokenizer, append_eos = bundle_tokenizer(directory)
    model = load_checked_bundle(directory, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lead = leading_special_ids(tokenizer)

    def rm_reward(prompts, completions, **kwargs) -> List[float]:
        templated = not isinstance(prompts[0], str)
        if templated:  # conversations: the prompt's messages, then the completion's
            texts = [tokenizer.apply_chat_template(list(p) + list(c), tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        rows = [truncate_left(ids, lead, max_length)
                for ids in encode_sides(tokenizer, texts, templated=templated, append_eos=append_eos)]
        return score_token_rows(model, tokenizer, rows, batch_size)

    return rm_reward


def conversation_texts(conversations: Sequence, tokenizer, where: str = "--input") -> List[str]:
    """Each conversation rendered by the chat template, checked as a pair's side is (rm.data.normalise).

    Args:
        where: what the rows are named by in an error (``--input <file>``).

    Raises:
        DataError: a conversation that is not a list of role/content messages ending on an assistant answer,
            or that the template cannot render (names the row).
    """
    from rm.data.normalise import conversation_text

    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where} has a 'messages' column, and the model's tokenizer has no chat template to render it")
    texts = []
    for i, messages in enumerate(conversations):
        try:
            texts.append(conversation_text(messages, tokenizer))
        except ValueError as err:
            raise DataError(f"{where} row {i}: {err}", row=i) from None
    return texts


def input_kind(columns: Sequence[str], fmt: str) -> str:
    """What a file of ``--input`` with these columns holds to score under ``--format fmt``: ``pairs`` (any layout
    rm.train reads), ``texts`` (a ``text`` column) or ``conversations`` (single chats: ``messages``, no ``chosen``).

    >>> input_kind(["prompt", "chosen", "rejected"], "auto"), input_kind(["text"], "auto"), input_kind(["messages"], "auto")
    ('pairs', 'texts', 'conversations')
    """
    unpaired = "chosen" not in columns
    if fmt == "text" or (fmt == "auto" and "text" in columns and unpaired):
        return "texts"
    if fmt in ("auto", "messages") and "messages" in columns and unpaired:
        return "conversations"
    return "pairs"


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse then names the option and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def check_model_dir(path: str) -> Path:
    """The model directory, or a :class:`ConfigError` saying what is wrong with ``--model``.

    Checked before transformers sees the path: for a directory that does not exist it would
    try the path as a Hub id and fail with "Repo id must be in the form ...".
    """
    directory = Path(path).expanduser()
    if directory.is_file():
        raise ConfigError(f"--model {path} is a file: give the directory that holds it (--model {directory.parent})")
    if not directory.is_dir():
        raise ConfigError(f"--model {path}: no such directory; give the final/ directory that rm.train wrote")
    if (directory / "final" / "config.json").is_file() and not (directory / "config.json").is_file():
        raise ConfigError(f"--model {path} is a run directory: give its final/ directory (--model {directory / 'final'})")
    if (directory / "adapter_config.json").is_file():  # a LoRA final/: load_bundle finds the base it names
        return directory
    weights = list(directory.glob("*.safetensors")) + list(directory.glob("pytorch_model*.bin"))
    if not (directory / "config.json").is_file() or not weights:
        raise ConfigError(f"--model {path} holds no model (config.json and *.safetensors weights expected); "
                          "give the final/ directory that rm.train wrote")
    return directory


def check_output(path: str, inputs: Sequence[str]) -> Path:
    """``--output`` as a file this command can write, or a :class:`ConfigError` naming it.

    Checked before the model loads and any row is scored: the file is written last, and a path that cannot take it
    would otherwise lose the whole scoring (and name only the hidden temporary file beside it). An ``--output`` that
    is one of the ``--input`` files would replace the user's data with the scored rows, which keep only some columns.
    """
    from rm.data.load import expand_files

    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(f"--output {path} is a directory: give a file to write, e.g. --output {target / 'scored.jsonl'}")
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(f"--output {path}: its directory {parent} does not exist; create it (mkdir -p {parent}) "
                          "or write elsewhere")
    if target.exists():
        for file in expand_files(inputs, "--input"):
            if target.samefile(file):
                raise ConfigError(f"--output {path} is also an --input file: the scored rows would replace your data; "
                                  "write them to another file")
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rm.score", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="directory written by rm.train (its final/, final/merged/ or a LoRA adapter final/)")
    parser.add_argument("--input", required=True, nargs="+", help="jsonl / json / parquet file(s)")
    parser.add_argument("--output", help="write the rows with their rewards here (jsonl); without it, or with '-', they "
                                         "go to stdout as JSON lines and the counts to stderr")
    parser.add_argument("--format", default="auto", choices=("auto", "hh", "prompt", "messages", "text"))
    parser.add_argument("--max-length", type=_positive_int, default=2048, help="tokens; longer sequences lose their start")
    parser.add_argument("--batch-size", type=_positive_int, default=16)
    parser.add_argument("--on-malformed", default="skip", choices=("skip", "error"))
    parser.add_argument("--normalize", action="store_true",
                        help="report (reward - mean) / std with the eval mean and std of the model's reward_stats.json")
    args = parser.parse_args(argv)
    answer = sys.stdout
    if args.output in (None, "-"):  # stdout is the answer: what is said along the way goes to stderr
        with redirect_stdout(sys.stderr):
            records = _score(args)
        for rec in records:
            answer.write(json.dumps(rec) + "\n")
        answer.flush()
        return 0
    check_output(args.output, args.input)
    records = _score(args)
    tmp = Path(args.output).with_name(f".tmp-{Path(args.output).name}")
    try:  # renamed into place: a stopped run leaves no --output cut short
        with open(tmp, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        tmp.replace(args.output)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {args.output}")
    return 0


def _score(args) -> List[dict]:
    """The rows of ``--input`` with their rewards; prints the counts and the accuracy."""
    # Imported here so that --help answers without loading torch's model stack.
    from rm.data.build import without_row
    from rm.data.load import expand_files, load_preference_split, locate_row
    from rm.data.normalise import max_chars_for
    from rm.data.tokenise import encode_texts, leading_special_ids, tokenize_pairs, truncate_left
    from rm.modelling.bundle import bundle_tokenizer, load_checked_bundle, read_reward_stats

    model_dir = check_model_dir(args.model)
    stats = read_reward_stats(model_dir) if args.normalize else None
    if args.normalize and stats is None:
        raise ConfigError(f"--normalize needs {model_dir}/reward_stats.json (written when the run had an eval set)")
    # Each file is read on its own, as rm.train reads the files of a split (rm.data.build): files of different
    # layouts or columns (an hh file and a prompt file, texts with and without an id column) are each read as their
    # own, where one read of all of them stops at the first file whose columns differ (datasets' CastError).
    files = expand_files(args.input, "--input")  # a pattern matching no file: DataError naming it
    parts = [(file, load_preference_split("local", files=(file,), files_key="--input")) for file in files]
    kinds = {file: input_kind(raw.column_names, args.format) for file, raw in parts}
    if len(set(kinds.values())) > 1:  # one output, one kind of record: pairs and single texts are scored apart
        described = "; ".join(f"{file}: {kinds[file]} (columns {', '.join(raw.column_names)})" for file, raw in parts)
        raise DataError(f"--input mixes pairs and single texts or conversations, which are scored differently (pairs get "
                        f"reward_chosen/reward_rejected and an accuracy, the others a reward): {described}. "
                        "Score each kind in a run of its own")
    kind = next(iter(kinds.values()))
    if sum(len(raw) for _, raw in parts) == 0:
        raise DataError(f"--input {' '.join(args.input)}: no rows to score")
    tokenizer, append_eos = bundle_tokenizer(model_dir)
    model = load_checked_bundle(model_dir)  # its weights as written and verified, and finite
    norm = (lambda r: (r - stats["mean"]) / stats["std"]) if stats else (lambda r: r)  # noqa: E731
    records: List[dict] = []
    if kind in ("texts", "conversations"):
        column = "text" if kind == "texts" else "messages"
        values, texts = [], []
        for file, raw in parts:
            where = f"--input {file}"
            if column not in raw.column_names:  # --format text on a file without one
                raise DataError(f"{where} has no {column!r} column to score (columns {', '.join(raw.column_names)})")
            values += list(raw[column])
            part = list(raw["text"]) if kind == "texts" else conversation_texts(raw["messages"], tokenizer, where)
            bad = [i for i, t in enumerate(part) if not isinstance(t, str) or not t.strip()]
            if bad:
                raise DataError(f"{where} row {bad[0]}: 'text' is empty or not a string ({len(bad)} such rows)")
            texts += part
        lead = leading_special_ids(tokenizer)
        cap = max_chars_for(args.max_length)  # a text far over --max-length is cut to its end before it tokenizes
        capped = [t[-cap:] for t in texts]
        rows = [truncate_left(ids, lead, args.max_length)
                for ids in encode_texts(tokenizer, capped, [kind == "conversations"] * len(texts), append_eos)]
        rewards = [norm(r) for r in score_token_rows(model, tokenizer, rows, args.batch_size)]
        records = [{column: v, "reward": r} for v, r in zip(values, rewards)]
        print(f"scored {len(records)} {kind}: mean reward {sum(rewards) / len(rewards):.4f}")
    else:
        pairs, norm_counts = _normalised_pairs(parts, args, tokenizer)
        try:
            tokenised, counts = tokenize_pairs(pairs, tokenizer, args.max_length, on_malformed=args.on_malformed,
                                               counts=norm_counts, append_eos=append_eos)
        except DataError as err:
            if err.row is None:
                raise
            file, row = locate_row(files, err.row)
            raise DataError(f"--input {file} row {row}: {without_row(str(err), err.row)}", row=err.row) from None
        print(counts.format())
        if len(tokenised) == 0:
            raise DataError(f"--input {' '.join(files)}: no usable pairs ({counts.format()})")
        chosen = [norm(r) for r in score_token_rows(model, tokenizer, tokenised["chosen_input_ids"], args.batch_size)]
        rejected = [norm(r) for r in score_token_rows(model, tokenizer, tokenised["rejected_input_ids"], args.batch_size)]
        correct = sum(c > r for c, r in zip(chosen, rejected))
        records = [
            {"chosen": p["chosen"], "rejected": p["rejected"], "reward_chosen": c, "reward_rejected": r}
            for p, c, r in zip(pairs, chosen, rejected)
        ]
        print(f"pairwise accuracy {correct / max(len(records), 1):.4f} over {len(records)} pairs")
    return records


def _normalised_pairs(parts, args, tokenizer):
    """The pairs of every ``(file, rows)`` part, each file normalised as its own layout (under ``--format auto``, the
    layout of its own rows) and the parts joined in order, as rm.train joins a split's files
    (:func:`rm.data.build.join_normalised`). A refused file is named, a refused row by its file and its row there."""
    from rm.data.build import join_normalised, without_row
    from rm.data.normalise import max_chars_for, normalise_pairs

    def normalise(raw):
        return normalise_pairs(raw, args.format, tokenizer, on_malformed=args.on_malformed, row_index=True,
                               max_chars=max_chars_for(args.max_length))

    def where(file, err, first_row):  # one file too: the message names it, as rm.train's do
        named = f" row {err.row}: {without_row(str(err), err.row)}" if err.row is not None else f": {err}"
        return DataError(f"--input {file}{named}", row=None if err.row is None else err.row + first_row)

    return join_normalised(parts, normalise, where)


if __name__ == "__main__":
    with boundary(), stop_on_signals():  # SIGTERM as Ctrl-C: exit 128 + N
        sys.exit(main())
