"""Pairwise preference data: load, normalise, tokenise, audit, batch.

The pipeline has three steps, a module each, each usable on its own:

1. :func:`rm.data.load.load_preference_split` reads one split from the Hugging Face Hub
   (optionally several ``data_dir`` subsets, concatenated) or from local
   jsonl / json / parquet files.
2. :func:`rm.data.normalise.normalise_pairs` turns any accepted layout (``hh``, ``prompt``,
   ``messages``, or ``auto``-detected) into exactly three columns:
   ``chosen`` and ``rejected`` (the full text to score) and ``margin``.
   Bad rows are skipped and counted, or raise, per ``on_malformed``.
3. :func:`rm.data.tokenise.tokenize_pairs` turns those texts into token ids the reward model
   scores, applying the truncation policy below.

Both steps count what they drop, and why, in one :class:`rm.data.counts.PairCounts`;
:mod:`rm.data.build` runs the steps for a config's splits, :mod:`rm.data.audit` reports them, and
:mod:`rm.data.batching` picks each optimizer step's pairs.

Accepted layouts (``format``):

* ``hh``: ``chosen`` and ``rejected`` are complete transcripts, as in
  Anthropic HH-RLHF (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``).
* ``prompt``: ``prompt``, ``chosen`` and ``rejected`` strings; each scored text
  is ``prompt + chosen`` / ``prompt + rejected`` (plain concatenation, so put
  any separator you want in the data itself).
* ``messages``: ``chosen`` and ``rejected`` are lists of
  ``{"role": ..., "content": ...}`` messages, optionally with a ``prompt`` list
  of messages prepended to both (row by row: a row without one, or with
  ``null``, has none); rendered with the tokenizer's chat template
  (``tokenizer.apply_chat_template(messages, tokenize=False)``). Each side's
  conversation must end on an ``assistant`` message, the answer being judged.
* ``auto``: picked from the column names and types (the dataset schema).

Each local file of a split is read, and its layout picked, on its own: files of different
layouts (an ``hh`` file and a ``prompt`` file) can share a split, their pairs joined in order.

Policies: truncation, identical pairs, duplicates
-------------------------------------------------
Each side is tokenised by the reward convention of TRL's ``RewardTrainer``
(:func:`rm.data.tokenizer.encode_sides`): a plain-text side (``hh``, ``prompt``) gets the
tokenizer's EOS appended unless it already ends with it (``data.append_eos``) and the
tokenizer's own special tokens (BOS where it adds one); a conversation (``messages``) is
tokenised as its chat template renders it, special tokens included. The reward is read at
the last token, the EOS. The exported bundle's tokenizer gives these ids to ``tokenizer(text)``
(docs/export.md, "Use your reward model").

A side longer than ``max_length`` tokens is handled per ``truncation``
(``data.truncation``):

* ``"truncate"`` (default): keep the special tokens the tokenizer prepends
  (e.g. BOS) and cut tokens from the *left* of the body, i.e. from the
  start of the prompt, until the side is exactly ``max_length`` tokens.
  The end of the response (where the reward is read) always survives;
  what is lost is the oldest context.
* ``"drop"``: drop the whole pair.
* ``"error"``: stop at the first such pair, naming its file and its 0-based row
  in that file, the side and its length.

Chosen and rejected are truncated independently (the shared prompt may lose
a different number of tokens on each side); both keep their own ending.

A side of more than ``64 x max_length`` characters is longer than ``max_length``
whatever tokenizes it (no real token covers 64 characters): it is cut to its last
``64 x max_length`` characters before it is tokenized (the ids truncation keeps
are the same; a row of tens of megabytes no longer costs gigabytes to tokenize),
counted in ``data_audit.json`` (``capped_before_tokenizing``) and logged with its
file and row; under ``"drop"`` such a pair is dropped as too long, under
``"error"`` it stops the run naming the row.

Identical pairs (``identical_pairs``, ``data.identical_pairs``): a pair whose
chosen and rejected token ids are equal *after truncation* trains nothing
(the loss sits at ln 2 with zero gradient). ``"drop"`` (default) removes it
(pairs with equal texts as soon as they are read, in :func:`~rm.data.normalise.normalise_pairs`);
``"keep"`` leaves it in. Three counts describe them: equal texts
(``identical_text``), equal ids before truncation (texts that tokenise alike,
e.g. words unknown to a word-level tokenizer) and equal ids after truncation
(responses that differ only in the part that was cut).

Duplicates (``duplicates``, ``data.duplicates``): a pair whose chosen and
rejected ids (after truncation) both equal those of an earlier pair of the
same split is a duplicate. ``"keep"`` (default) keeps and counts it;
``"drop"`` keeps only the first occurrence.

Other rows dropped and counted, never silently altered:

* malformed rows and rows with an empty ``chosen`` or ``rejected``, per
  ``on_malformed`` (``"skip"`` counts them, ``"error"`` raises), see
  :func:`~rm.data.normalise.normalise_pairs`;
* ``messages`` rows whose side has no final ``assistant`` message (``no_answer``:
  a system prompt alone, a user turn waiting for an answer), per ``on_malformed``;
* valid rows of another layout than their split's (``other_format``), per
  ``on_malformed``: with ``data.format=auto`` a file whose rows mix layouts is an
  error naming each layout's count and first row under ``"error"``; under
  ``"skip"`` the layout of most rows is the file's (a tie is still an error). Each
  row's own layout decides: in a file of ``hh`` transcripts, a row that carries a
  ``prompt`` is a prompt row, dropped as ``other_format``, never trained as a
  transcript without its prompt;
* a side containing the pad id anywhere (``pad_in_text``): at the end it moves
  the token the reward is read from, and collators that derive the attention
  mask from pad ids would mask it anywhere. With ``on_malformed="error"``
  this raises instead.

The checks run in this order, each on the pairs the previous ones kept:
malformed/empty, length, pad id, identical, duplicate. Every row read is
accounted for in the counts (``rm.data.audit`` checks that they add up and
``rm.training.run_setup`` writes them to ``data_audit.json``).
"""
