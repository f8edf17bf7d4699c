"""Builtin word-level tokenizer for the tiny demo reward model.

The tiny model is built from a config, offline, so it has no pretrained
tokenizer to download. This module builds one locally from
:data:`rm.data.synthetic.VOCABULARY` with the ``tokenizers`` library.

It is word level: any word outside the vocabulary becomes ``<unk>``. That is
fine for the synthetic data (which it covers completely) and for smoke tests on
other text, but real models should use their own tokenizer.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rm.data.synthetic import VOCABULARY

__all__ = ["SPECIAL_TOKENS", "HH_CHAT_TEMPLATE", "build_builtin_tokenizer", "text_only"]

# Order fixes the ids: pad=0, unk=1, bos=2, eos=3 (the tiny model config relies
# on these).
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")

# Renders messages as an HH-RLHF transcript. A system message becomes its own
# "\n\nSystem: ..." turn in place (word-level, so "System" is in the
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


def build_builtin_tokenizer(model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """Builds the word-level tokenizer used by the tiny demo model.

    Ids are ``<pad>``=0, ``<unk>``=1, ``<s>``=2, ``</s>``=3, then
    :data:`~rm.data.synthetic.VOCABULARY` in order. Text is split into words
    and punctuation runs (``Whitespace`` pre-tokenizer); no special token is
    ever added (:func:`text_only`).

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
    pad, unk, bos, eos = SPECIAL_TOKENS

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # Word-level has no subword markers, so joining with spaces is a faithful
    # enough inverse (punctuation comes back space-separated).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=pad,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        model_max_length=model_max_length,
        padding_side="right",
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
        >>> tok = build_builtin_tokenizer()
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
