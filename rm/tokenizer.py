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

__all__ = ["SPECIAL_TOKENS", "HH_CHAT_TEMPLATE", "build_builtin_tokenizer"]

# Order fixes the ids: pad=0, unk=1, bos=2, eos=3 (the tiny model config relies
# on these).
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")

# Renders messages as an HH-RLHF transcript. A system message becomes its own
# "\n\nSystem: ..." turn in place (word-level, so "System" is in the
# vocabulary). The template emits no BOS: the tokenizer's post-processor adds
# <s> when text is encoded with add_special_tokens=True, and a BOS in the
# template too would double it.
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
    and punctuation runs (``Whitespace`` pre-tokenizer); ``<s>`` is prepended
    when ``add_special_tokens=True``; ``</s>`` is never appended automatically
    because the training pipeline appends EOS itself.

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
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A $B",
        special_tokens=[(bos, vocab[bos])],
    )
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
    return hf_tok
