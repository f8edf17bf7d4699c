"""rm's own tokenizers, for models built from a config (``model.pretrained`` unset).

A random-init model has no pretrained tokenizer to download, so rm makes one offline
with the ``tokenizers`` library:

* ``model.tokenizer=bpe`` (the default for a random-init model, and the demo's):
  a byte-level BPE trained on the run's own training texts (:func:`train_bpe_tokenizer`).
  Byte level means it has a token for each of the 256 bytes, so any text, in any
  language or script, becomes ids without an unknown token; the merges learnt from the
  data make its frequent words single tokens. Its size is ``model.vocab_size`` (fewer
  when the texts have fewer distinct merges to learn). Training is deterministic: the
  same texts and size give the same vocabulary and merges in every process.
* ``model.tokenizer=words``: the word-level tokenizer of the synthetic data's closed
  vocabulary (:func:`build_word_level_tokenizer`). Any other word becomes ``<unk>``
  (the ``unknown_tokens`` alarm says so); it is kept for measurements that must stay
  comparable with those made with it (docs/memory_calibration.md, docs/throughput.md).

Both add no special token to text (:func:`text_only`), pad on the right with
``<pad>`` (id 0, never produced from text by the byte-level one unless the text
spells ``<pad>`` itself, which the data pipeline drops), and carry the HH chat template.
They round-trip through ``save_pretrained`` and ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from rm.data.synthetic import VOCABULARY

__all__ = [
    "SPECIAL_TOKENS", "HH_CHAT_TEMPLATE", "MIN_BPE_VOCAB", "train_bpe_tokenizer", "train_byte_level_bpe",
    "build_word_level_tokenizer", "text_only",
]

# Order fixes the ids: pad=0, unk=1, bos=2, eos=3, in both tokenizers (config.json
# records them; the byte-level one never emits <unk> but keeps its id for the same layout).
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")
# The smallest byte-level BPE: the special tokens and one token per byte, no merge.
MIN_BPE_VOCAB = len(SPECIAL_TOKENS) + 256

# Renders messages as an HH-RLHF transcript. A system message becomes its own
# "\n\nSystem: ..." turn in place ("System" is in the word-level
# vocabulary). It emits no special token: rm reads the reward at the last
# token of the text (see ``text_only``), and TRL renders conversations with
# this template before tokenizing them without special tokens.
HH_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '\n\nHuman: ' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '\n\nAssistant: ' + message['content'] }}"
    "{% elif message['role'] == 'system' %}"
    "{{ '\n\nSystem: ' + message['content'] }}"
    "{% else %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\n\nAssistant:' }}{% endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE tokenizer on ``texts`` (``model.tokenizer=bpe``).

    GPT-2's byte-level scheme: the text is split into words (a word keeps the space
    before it) and each word's UTF-8 bytes are merged by the learnt merges, so every
    string encodes without an unknown token and decodes back exactly. The special tokens
    take ids 0-3 (:data:`SPECIAL_TOKENS`), the 256 bytes the next ids, merges the rest.
    A merge is learnt only from a pair seen at least twice, so small data gives fewer
    than ``vocab_size`` tokens. The trainer has no randomness and breaks ties between
    equally frequent pairs by their ids, which depend only on the texts: the same texts
    (in any process) give the same tokenizer.

    Args:
        texts: the training texts (the run's train split, chosen and rejected sides).
        vocab_size: at most this many tokens, special tokens included (``model.vocab_size``);
            at least :data:`MIN_BPE_VOCAB` are always kept.
        model_max_length: Maximum sequence length recorded on the tokenizer.

    Returns:
        A ``PreTrainedTokenizerFast`` like :func:`build_word_level_tokenizer`'s: pad/unk/bos/eos,
        right padding, the HH chat template, nothing added to text.

    Example:
        >>> tok = train_bpe_tokenizer(["\\n\\nHuman: hello there\\n\\nAssistant: hello"] * 3, vocab_size=300)
        >>> tok.decode(tok("Grüße, 東京 🙂")["input_ids"])
        'Grüße, 東京 🙂'
        >>> tok.unk_token_id in tok("Grüße, 東京 🙂")["input_ids"], tok.convert_ids_to_tokens(tok(" hello")["input_ids"])
        (False, ['Ġhello'])
    """
    return _wrap(train_byte_level_bpe(texts, vocab_size), model_max_length)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """The ``tokenizers`` model of :func:`train_bpe_tokenizer`, before transformers wraps it (this module imports
    transformers only to wrap, so that this runs without it)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, MIN_BPE_VOCAB), min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_word_level_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Builds the word-level tokenizer of the synthetic data (``model.tokenizer=words``).

    Ids are ``<pad>``=0, ``<unk>``=1, ``<s>``=2, ``</s>``=3, then
    :data:`~rm.data.synthetic.VOCABULARY` in order. Text is split into words
    and punctuation runs (``Whitespace`` pre-tokenizer); any other word becomes
    ``<unk>``. No special token is ever added (:func:`text_only`).

    Args:
        model_max_length: Maximum sequence length recorded on the tokenizer.

    Returns:
        A ``PreTrainedTokenizerFast`` with pad/unk/bos/eos tokens, right padding
        and an HH-style chat template. It round-trips through
        ``save_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(VOCABULARY))}
    if len(vocab) != len(SPECIAL_TOKENS) + len(VOCABULARY):
        raise ValueError("VOCABULARY overlaps the special tokens or has duplicates")

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[1]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # Word-level has no subword markers, so joining with spaces is a faithful
    # enough inverse (punctuation comes back space-separated).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return _wrap(tok, model_max_length)


def _wrap(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a ``tokenizers`` one: special tokens, right padding, chat template."""
    from transformers import PreTrainedTokenizerFast

    pad, unk, bos, eos = SPECIAL_TOKENS
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, unk_token=unk, bos_token=bos, eos_token=eos,
        model_max_length=model_max_length, padding_side="right",
    )
    hf_tok.chat_template = HH_CHAT_TEMPLATE
    return text_only(hf_tok)


def text_only(tokenizer):
    """Make ``tokenizer(text)`` add no special token (no BOS, no EOS), in place; returns it.

    This is rm's reward convention: a text's reward is read at the last token the text
    itself tokenises to. Every client then sees the same ids: TRL's GRPO/RLOO reward path
    tokenises with ``add_special_tokens=False``, OpenRLHF tokenises prompts that way,
    while plain transformers, ``pipeline`` and RewardBench call ``tokenizer(text)``, which
    with this tokenizer (saved in the bundle) is the same thing. A chat template that
    writes its own BOS (Llama 3, Mistral) keeps it: it is part of the text.

    ``add_bos_token``/``add_eos_token`` are set to False, which rewrites the post-processor
    of a transformers 5 tokenizer and is what transformers 4's Llama-style tokenizers read
    from ``tokenizer_config.json``; any other post-processor is replaced by one that adds
    nothing.

    Raises:
        ValueError: the tokenizer still adds tokens (e.g. a slow, Python-only tokenizer).

    Example:
        >>> tok = build_word_level_tokenizer()
        >>> tok("Human: hello")["input_ids"] == tok("Human: hello", add_special_tokens=False)["input_ids"]
        True
    """
    for attr in ("add_bos_token", "add_eos_token"):
        try:
            setattr(tokenizer, attr, False)
        except AttributeError:  # a tokenizer class without the attribute
            pass
    probe = "Human: a b\n\nAssistant: c"
    if tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
        if tokenizer(probe)["input_ids"] != tokenizer(probe, add_special_tokens=False)["input_ids"]:
            raise ValueError(
                f"{type(tokenizer).__name__} adds special tokens that rm cannot switch off: rm reads the reward at the "
                "last token of the text, so `tokenizer(text)` must add nothing (use a fast tokenizer)"
            )
    return tokenizer
