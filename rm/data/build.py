"""Turn the ``data`` group into tokenised train and eval sets.

A split tokenised once is kept on disk under ``$RM_CACHE/data`` (:mod:`rm.foundations.cache`) with its counts and the lines
its loading logged, keyed by its rows' content (a local file's bytes, the synthetic generator's settings), every
``data`` setting, the tokenizer as it tokenises (:func:`rm.data.tokenizer.tokenizer_identity`), the rm source that does
the work (:data:`DATA_SOURCES`) and the libraries' versions: a later run of the same data reads the same token ids
and counts instead of loading, normalising and tokenising again. ``datasets``' own cache of ``map`` results cannot
stand in: the normalise and tokenise maps count what they drop while they run (``rm.data.load.map_counting``), and a
hit there would skip the counting. Hub data is read again each time (its revision is not known before it loads).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import datasets

from rm.foundations import cache
from rm.foundations.config import DataConfig, TrainConfig
from rm.data.audit import audit_split
from rm.data.counts import PairCounts
from rm.data.load import check_files_exist, expand_files, load_preference_split, locate_row
from rm.data.normalise import CHARS_PER_TOKEN_BOUND, max_chars_for, normalise_pairs
from rm.data.synthetic import generate_pairs
from rm.data.tokenise import pair_lengths, tokenize_pairs
from rm.foundations.errors import DataError
from rm.foundations.cli import DETAIL
from rm.data.tokenizer import tokenizer_identity

log = logging.getLogger(__name__)

# The rm modules that load, normalise and tokenise a split: this one and every module it imports at any depth
# (tests/foundations/test_startup_cache.py holds the list to the import graph). An edit to any of them is a cache miss.
DATA_SOURCES = ("rm.data.build", "rm.data.audit", "rm.data.counts", "rm.data.load", "rm.data.normalise",
                "rm.data.synthetic", "rm.data.tokenise", "rm.data.tokenizer", "rm.foundations.config", "rm.foundations.errors", "rm.foundations.cli",
                "rm.foundations.launch_env", "rm.foundations.cache")
# The libraries whose code reads, renders (chat templates) and tokenises the rows.
DATA_LIBRARIES = ("datasets", "pyarrow", "tokenizers", "transformers", "jinja2")
# Settings that name where the rows are, not what they hold: their content digest stands in for them.
_LOCATION_KEYS = ("name", "train_files", "eval_files", "extra_eval_files")


def _raw_parts(data_cfg: DataConfig, split: str) -> List[Tuple[Optional[str], datasets.Dataset]]:
    """The split's raw rows as ``(file, rows)`` parts: one per local file, each read on its own so that files of
    different layouts (or columns) can share a split, every file's rows read as their own layout; one part (file
    None) for hub and synthetic data. ``max_train_samples`` / ``max_eval_samples`` keep the first rows of the parts
    in order."""
    train = split == "train"
    limit = data_cfg.max_train_samples if train else data_cfg.max_eval_samples
    if data_cfg.source == "synthetic":
        size = data_cfg.synthetic_train_size if train else data_cfg.synthetic_test_size
        ds = datasets.Dataset.from_list(generate_pairs(size, seed=data_cfg.synthetic_seed, split="train" if train else "test",
                                                         multi_turn=data_cfg.synthetic_multi_turn))
        return [(None, ds.select(range(min(limit, len(ds)))) if limit is not None else ds)]
    key = "data.train_files" if train else "data.eval_files"
    kwargs = dict(path=data_cfg.path, subsets=tuple(data_cfg.subsets), split=data_cfg.train_split if train else data_cfg.eval_split,
                  files_key=key)
    if data_cfg.source != "local":
        return [(None, load_preference_split(data_cfg.source, max_samples=limit, **kwargs))]
    parts = []
    for file in expand_files(data_cfg.train_files if train else data_cfg.eval_files, key):
        if limit is not None and limit <= 0:
            break
        ds = load_preference_split("local", files=(file,), max_samples=limit, **kwargs)
        parts.append((file, ds))
        limit = None if limit is None else limit - len(ds)
    return parts


def _normalised_split(data_cfg: DataConfig, tokenizer, split: str):
    """The split's raw rows as ``chosen``/``rejected`` texts (:func:`normalise_pairs`) and their counts, each file
    normalised on its own (its layout detected from its own rows under ``data.format=auto``) and the parts joined
    in order; the ``row`` column and the counts name rows of the split. A refused row is reported with the data,
    split and file it is in, and its row in that file."""
    def normalise(raw):
        return normalise_pairs(raw, data_cfg.format, tokenizer, margin_column=data_cfg.margin_column,
                               on_malformed=data_cfg.on_malformed, identical=data_cfg.identical_pairs, row_index=True,
                               max_chars=max_chars_for(data_cfg.max_length), truncation=data_cfg.truncation)

    def where(file, err, first_row):
        row = None if err.row is None else err.row + first_row
        return DataError(f"data {data_cfg.name} [{split}]{_in_file(data_cfg, split, file, err)}", row=row)

    return join_normalised(_raw_parts(data_cfg, split), normalise, where)


def join_normalised(parts, normalise: Callable, where: Callable):
    """Each ``(file, raw rows)`` part normalised on its own (``normalise(raw)``: pairs and :class:`PairCounts`) and
    the parts joined in order, as a split's files are (``rm.train``) and ``rm.score``'s inputs; the ``row`` column and
    the counts number the rows of all parts in order. A part's :class:`DataError` is raised as ``where(file, err,
    first_row)`` gives it (the same error: unchanged), ``first_row`` being the part's first row among all."""
    joined, counts, first_row = [], PairCounts(), 0
    for file, raw in parts:
        try:
            pairs, part_counts = normalise(raw)
        except DataError as err:
            named = where(file, err, first_row)
            if named is err:
                raise
            raise named from err
        if first_row:
            pairs = pairs.map(lambda batch: {"row": [r + first_row for r in batch["row"]]}, batched=True,
                              load_from_cache_file=False, desc="numbering rows")
        joined.append(pairs)
        counts.absorb(part_counts, first_row)
        first_row += len(raw)
    return (joined[0] if len(joined) == 1 else datasets.concatenate_datasets(joined)), counts


def _in_file(data_cfg: DataConfig, split: str, file: Optional[str], err: DataError) -> str:
    """`` in <file>: <message>`` where the split is that one file (its rows are the split's), `` in <file> row <n>:
    <message without its split row>`` for a row of one of several files, ``: <message>`` elsewhere."""
    if file is None:
        return f": {err}"
    several = len(expand_files(data_cfg.train_files if split == "train" else data_cfg.eval_files, f"data.{split}_files")) > 1
    if err.row is None or not several:
        return f" in {file}: {err}"
    return f" in {file} row {err.row}: {without_row(str(err), err.row)}"


def without_row(message: str, row: int) -> str:
    """A row-level message (``row 4: 'chosen' is empty``) without its leading row number, which the file's own row replaces."""
    prefix = f"row {row}: "
    return message[len(prefix):] if message.startswith(prefix) else message


def build_split(data_cfg: DataConfig, tokenizer, split: str) -> Tuple[datasets.Dataset, PairCounts]:
    """Load, normalise and tokenise one split, or read it from the disk cache (module doc); log what was dropped
    and why.

    Returns:
        The tokenised dataset (``chosen_input_ids``, ``rejected_input_ids``,
        ``margin``) and the split's counts.

    Raises:
        ValueError: A row the policies refuse (``data.on_malformed=error``,
            ``data.truncation=error``; the message starts with the data and split
            and names the row), or no usable pair left.
    """
    entry = split_cache_entry(data_cfg, tokenizer, split)
    cached = _read_split(entry) if entry is not None else None
    if cached is None:
        log.info("data %s [%s]: reading, normalising and tokenising the pairs", data_cfg.name, split)
        with _logged() as lines:
            tokenised, counts = _tokenised_split(data_cfg, tokenizer, split)
        if entry is not None:
            if _write_split(entry, tokenised, counts, lines):
                log.info("data %s [%s]: kept in the cache for the next run (%s)", data_cfg.name, split, entry, extra=DETAIL)
            else:
                log.warning("data %s [%s]: not kept for the next run, which tokenises again: the cache %s cannot be "
                            "written (RM_CACHE names another directory)", data_cfg.name, split, cache.cache_root())
    else:
        tokenised, counts, lines = cached
        for name, level, message in lines:  # what loading the split logged (its format, a column it ignores)
            logging.getLogger(name).log(level, "%s", message)
        log.info("data %s [%s]: tokenised pairs read from the cache %s", data_cfg.name, split, entry, extra=DETAIL)
    log.info("data %s [%s]: %s", data_cfg.name, split, counts.format(), extra=DETAIL)  # dropped rows: a warning below
    if counts.capped:
        log.warning("data %s [%s]: %d pair(s) with a side over %s characters (data.max_length=%d x %d), cut to their last "
                    "%s characters before tokenizing, as truncation would cut them; the longest is %s characters (first: "
                    "%s)", data_cfg.name, split, counts.capped, f"{max_chars_for(data_cfg.max_length):,}",
                    data_cfg.max_length, CHARS_PER_TOKEN_BOUND, f"{max_chars_for(data_cfg.max_length):,}",
                    f"{counts.capped_longest:,}", _row_at(data_cfg, split, counts.capped_first_row))
    reasons = "".join(f"; {r['count']} x {why} (first: {_row_at(data_cfg, split, r['first_row'])})"
                      for why, r in sorted(counts.drop_reasons.items(), key=lambda kv: -kv[1]["count"])[:3])
    if reasons:
        log.warning("data %s [%s]: rows dropped%s", data_cfg.name, split, reasons)
    if len(tokenised) == 0:
        raise DataError(f"data {data_cfg.name} [{split}]: no usable pairs left ({counts.format()}{reasons})")
    return tokenised, counts


def _tokenised_split(data_cfg: DataConfig, tokenizer, split: str) -> Tuple[datasets.Dataset, PairCounts]:
    pairs, norm_counts = _normalised_split(data_cfg, tokenizer, split)
    try:
        return tokenize_pairs(
            pairs, tokenizer, data_cfg.max_length, truncation=data_cfg.truncation, on_malformed=data_cfg.on_malformed,
            identical=data_cfg.identical_pairs, duplicates=data_cfg.duplicates, counts=norm_counts,
            append_eos=data_cfg.append_eos,
        )
    except DataError as err:
        where = _where(data_cfg, split, err.row)
        message = without_row(str(err), err.row) if " row " in where else str(err)
        raise DataError(f"data {data_cfg.name} [{split}]{where}: {message}", row=err.row) from err


def split_identity(data_cfg: DataConfig, split: str) -> Optional[Dict[str, Any]]:
    """What a split's normalised pairs depend on: its rows' content, every ``data`` setting, the rm source and the
    libraries that read them; None where the content is not known before loading (hub data), or a file cannot be
    read (the build then reports it as it always does). What :func:`split_cache_entry` and the cache of the
    tokenizer trained on the train split's texts (:func:`rm.data.tokenizer.run_tokenizer`) are keyed by."""
    settings = {k: v for k, v in asdict(data_cfg).items() if k not in _LOCATION_KEYS}
    if data_cfg.source == "synthetic":  # the generator's settings are among the settings, its code among the sources
        content: Any = "synthetic"
    elif data_cfg.source == "local":
        try:
            files = expand_files(data_cfg.train_files if split == "train" else data_cfg.eval_files, f"data.{split}_files")
            content = [cache.file_digest(Path(f)) for f in files]
        except Exception:  # noqa: BLE001  (no cache; loading the split says what is wrong with its files)
            return None
    else:
        return None
    return {"split": split, "content": content, "settings": settings, "rm": cache.source_digest(DATA_SOURCES),
            "libraries": cache.versions(*DATA_LIBRARIES)}


def split_cache_entry(data_cfg: DataConfig, tokenizer, split: str) -> Optional[Path]:
    """Where the tokenised split is cached: keyed by :func:`split_identity` and the tokenizer; None: not cached."""
    identity, tokens = split_identity(data_cfg, split), tokenizer_identity(tokenizer)
    if identity is None or tokens is None:
        return None
    return cache.cache_root() / "data" / cache.key({**identity, "tokenizer": tokens})


def _read_split(entry: Path) -> Optional[Tuple[datasets.Dataset, PairCounts, List]]:
    """The tokenised split, its counts and log lines kept in ``entry``, or None (absent, or its files are not the
    ones written: computed again)."""
    meta = cache.read_json(entry / "entry.json")
    try:
        if meta is None or any(cache.file_digest(entry / name) != digest for name, digest in meta["files"].items()):
            return None
        # In memory, as the freshly tokenised split is: the run does not depend on the entry staying on disk.
        tokenised = datasets.load_from_disk(str(entry), keep_in_memory=True)
        return tokenised, PairCounts.from_json(meta["counts"]), [tuple(line) for line in meta["logs"]]
    except Exception as err:  # noqa: BLE001  (an unreadable entry is computed again)
        log.debug("cache entry %s unreadable (%s): tokenised again", entry, err)
        return None


def _write_split(entry: Path, tokenised: datasets.Dataset, counts: PairCounts, lines: List) -> bool:
    """Store the tokenised split under ``entry``; whether it was (a cache that cannot be written fails nothing)."""
    def fill(tmp: Path) -> None:
        tokenised.save_to_disk(str(tmp))
        files = {p.name: cache.file_digest(p) for p in sorted(tmp.iterdir())}
        if not cache.write_json(tmp / "entry.json", {"files": files, "counts": counts.to_json(), "logs": lines}):
            raise OSError("entry.json not written")

    return cache.write_dir(entry, fill)


@contextlib.contextmanager
def _logged() -> Iterator[List]:
    """The lines ``rm.data``'s loggers emit inside, as ``(logger, level, message)``: a cache hit logs them again."""
    lines: List = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append((record.name, record.levelno, record.getMessage()))

    handler, logger = Keep(), logging.getLogger("rm.data")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def train_pairs(data_cfg: DataConfig) -> Callable[[Any], datasets.Dataset]:
    """The train split's ``chosen``/``rejected`` texts after normalisation, given the tokenizer that renders its
    conversations: what :func:`rm.data.tokenizer.run_tokenizer` trains ``model.tokenizer=bpe`` on. Reading it raises for
    a refused row what :func:`build_split` would raise."""
    return lambda renderer: _normalised_split(data_cfg, renderer, "train")[0]


def _row_at(data_cfg: DataConfig, split: str, row: int) -> str:
    """``<file> row <n>`` (its row in its own file) for a row of several local files, else ``row <n>[ in <file>]``."""
    where = _where(data_cfg, split, row)
    return where[len(" in "):] if " row " in where else f"row {row}{where}"


def _where(data_cfg: DataConfig, split: str, row) -> str:
    """`` in <file> row <n>`` for a row of several local files (the file and its own 0-based row), `` in <file(s)>``
    for one file or without a row, ``""`` for other sources."""
    if data_cfg.source != "local":
        return ""
    files = expand_files(data_cfg.train_files if split == "train" else data_cfg.eval_files, f"data.{split}_files")
    if row is None or len(files) == 1:  # one file: the row of the split is its row
        return f" in {', '.join(files)}"
    file, row_in_file = locate_row(files, row)
    return f" in {file} row {row_in_file}"


def build_datasets(data_cfg: DataConfig, tokenizer):
    """The train set, the eval set when one is configured (else ``None``), and the pair audit.

    Returns:
        ``(train, eval, audit)``; ``audit`` is ``{"data": name, "policies": {...},
        "splits": {"train": ..., "eval": ...}}`` with one
        :func:`rm.data.audit.audit_split` per split, what ``data_audit.json`` holds.
    """
    has_eval = data_cfg.source in ("hub", "synthetic") or bool(data_cfg.eval_files)
    sets, audits = {}, {}
    for split in ("train", "eval") if has_eval else ("train",):
        sets[split], counts = build_split(data_cfg, tokenizer, split)
        audits[split] = audit_split(counts, *pair_lengths(sets[split]))
    policies = {
        "max_length": data_cfg.max_length,
        "truncation": data_cfg.truncation,
        "identical_pairs": data_cfg.identical_pairs,
        "duplicates": data_cfg.duplicates,
        "on_malformed": data_cfg.on_malformed,
        "append_eos": data_cfg.append_eos,
    }
    audit = {"data": data_cfg.name, "policies": policies, "splits": audits}
    return sets["train"], sets.get("eval"), audit


def check_enough_pairs(data_cfg: DataConfig, train_cfg: TrainConfig, num_pairs: int, world_size: int = 1) -> None:
    """A :class:`DataError` where the train split holds fewer usable pairs than one optimizer step takes.

    A step trains on ``train.global_batch_size`` different pairs; with fewer, no step can be cut from the split
    (:func:`rm.data.batching.micro_batches_for_step`), which would fail as a bug deep inside the layout's timing
    (``rm.train``'s ``train.layout=auto``, ``rm.plan``). The message names sizes that fit (:func:`sizes_that_fit`).
    """
    if num_pairs >= train_cfg.global_batch_size:
        return
    raise DataError(
        f"data {data_cfg.name} [train]: {num_pairs} usable pair(s), fewer than one optimizer step takes "
        f"(train.global_batch_size={train_cfg.global_batch_size}). Give more training pairs, or "
        + sizes_that_fit(train_cfg.micro_batch_size, num_pairs, world_size))


def sizes_that_fit(micro_batch_size: int, num_pairs: int, world_size: int) -> str:
    """The largest step that ``num_pairs`` pairs hold, in override words: a global batch is a multiple of the micro-batch
    x the processes, so the micro-batch shrinks too where even one micro-batch a process is more than there is.

    >>> sizes_that_fit(8, 20, 2)
    'set train.global_batch_size=16 (a multiple of train.micro_batch_size=8 x 2 process(es))'
    >>> sizes_that_fit(8, 5, 1)
    'set train.micro_batch_size=5 train.global_batch_size=5 (one micro-batch on each of 1 process(es))'
    >>> sizes_that_fit(8, 3, 4)
    'run on at most 3 process(es): each takes at least one pair a step'
    """
    unit = micro_batch_size * world_size
    if num_pairs >= unit:
        return (f"set train.global_batch_size={num_pairs // unit * unit} (a multiple of "
                f"train.micro_batch_size={micro_batch_size} x {world_size} process(es))")
    micro = num_pairs // world_size
    if micro:
        return (f"set train.micro_batch_size={micro} train.global_batch_size={micro * world_size} "
                f"(one micro-batch on each of {world_size} process(es))")
    return f"run on at most {num_pairs} process(es): each takes at least one pair a step"


def build_extra_eval_sets(data_cfg: DataConfig, tokenizer) -> Dict[str, datasets.Dataset]:
    """The named eval sets of ``data.extra_eval_files``, each built exactly like the main eval split.

    Each set goes through :func:`build_split` as the eval split of a local source, so ``format``,
    ``max_length``, ``truncation``, ``on_malformed``, ``max_eval_samples`` and every other policy of
    the main eval split apply to it unchanged.

    Returns:
        ``{name: tokenised dataset}`` in config order; empty when none are configured.

    Raises:
        FileNotFoundError: a pattern matches no file; the message names ``data.extra_eval_files.<name>``.
    """
    sets = {}
    for name, files in data_cfg.extra_eval_files.items():
        # Resolved here so that a missing file is reported under its own key, not data.eval_files.
        resolved = expand_files(files, f"data.extra_eval_files.{name}")
        own = replace(data_cfg, name=f"{data_cfg.name}:extra_eval_files.{name}", source="local", eval_files=resolved)
        sets[name], _ = build_split(own, tokenizer, "eval")
    return sets


def check_data_files(data_cfg: DataConfig) -> None:
    """Every local file the run will read exists: checked before the memory estimate prints, one error naming each
    missing file under its key (``data.train_files``, ``data.eval_files``, ``data.extra_eval_files.<name>``).

    Raises:
        DataFileNotFound: an entry (path or glob) matches no file.
    """
    keys = {"data.train_files": data_cfg.train_files, "data.eval_files": data_cfg.eval_files} if data_cfg.source == "local" else {}
    keys.update({f"data.extra_eval_files.{name}": files for name, files in data_cfg.extra_eval_files.items()})
    check_files_exist(keys)
    # An eval set read from a training file scores pairs the model trained on: its accuracy looks like generalisation
    # and is not. Allowed (a check that the model can fit its data), but never in silence.
    trained = {os.path.realpath(f) for f in expand_files(keys.get("data.train_files", []), "data.train_files")}
    for key, files in keys.items():
        shared = [f for f in expand_files(files, key) if os.path.realpath(f) in trained]
        if shared and key != "data.train_files":
            log.warning("%s reads %s, also in data.train_files: its metrics score pairs the model trained on, not held-out "
                        "ones; give it files of its own", key, ", ".join(shared))
