"""The tokenizer: which one a run uses, building it, and the checks that it fits the model and its consumers.

One module for everything about the tokenizer, so that data, validation, setup and export call it and it calls
none of them (it imports nothing of ``rm.data``):

* choosing: :func:`tokenizer_kind` reads ``model.tokenizer``, :func:`config_errors` refuses the names that cannot
  work (``validate`` reports them with the other settings);
* the run's tokenizer: :func:`run_tokenizer` builds it (:func:`build_tokenizer`) from the train split's texts
  (:func:`training_texts`), or loads the one a resumed run saved;
* the checks once it exists: :func:`check_tokenizer_fits` (its ids index the embedding) and
  :func:`check_consumers_tokenize_alike` (the exported model's readers load it as training used it, on the run's
  texts and :data:`TOKENIZER_PROBES`);
* the reward convention: :func:`encode_sides` (the ids a side trains on: one home for every caller) and
  :func:`consumer_tokenizer` (the exported tokenizer whose ``tokenizer(text)`` gives those ids);
* the bundle: :func:`write_tokenizer_compat_fields`, the tokenizer half of :func:`rm.modelling.bundle.write_compat_fields`.

The reward convention is TRL's ``RewardTrainer``'s (``add_eos`` in ``trl/trainer/reward_trainer.py``), which
OpenRLHF's reward dataset shares in spirit: a plain-text side (an HH transcript, prompt + answer) gets the
tokenizer's own special tokens (BOS where it adds one) and the EOS string appended when the text does not already end
with it, so the reward is read at a fixed token that can learn to summarise the sequence; a conversation is rendered
by the chat template and tokenised as rendered (the template writes its own BOS and EOS). ``data.append_eos=false``
leaves plain text without the EOS. rm reads the reward at the last real token of each side (the EOS).

A random-init model (``model.pretrained`` unset) has no pretrained tokenizer to download, so rm makes one offline
with the ``tokenizers`` library:

* ``model.tokenizer=bpe`` (the default for a random-init model, and the demo's):
  a byte-level BPE trained on the run's own training texts (:func:`train_bpe_tokenizer`).
  Byte level means it has a token for each of the 256 bytes, so any text, in any
  language or script, becomes ids without an unknown token; the merges learnt from the
  data make its frequent words single tokens. Its size is ``model.vocab_size`` (fewer
  when the texts have fewer distinct merges to learn). Training is deterministic: the
  same texts and size give the same vocabulary and merges in every process.
* ``model.tokenizer=words``: the word-level tokenizer of the synthetic data's closed
  vocabulary (:data:`VOCABULARY`, :func:`build_word_level_tokenizer`). Any other word becomes ``<unk>``
  (the ``unknown_tokens`` alarm says so); it is kept for measurements that must stay
  comparable with those made with it (benchmarks/results/memory_calibration.md, benchmarks/results/throughput.md).

Both add a BOS to text, as Llama's and Mistral's tokenizers do (:data:`BOS_ONLY`), pad on the right with
``<pad>`` (id 0, never produced from text by the byte-level one unless the text spells ``<pad>`` itself, which the
data pipeline drops), and carry the HH chat template (:data:`HH_CHAT_TEMPLATE`, which writes BOS and a final EOS as
Mistral's does). They round-trip through ``save_pretrained`` and ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from rm.foundations import cache
from rm.foundations.errors import ConfigError, StorageError, is_storage_failure, named_hub_source
from rm.foundations.cli import DETAIL

if TYPE_CHECKING:  # transformers and the config schema are imported where used: training a BPE needs neither
    from transformers import PreTrainedTokenizerFast

    from rm.foundations.config import ModelConfig

__all__ = [
    "SPECIAL_TOKENS", "HH_CHAT_TEMPLATE", "MIN_BPE_VOCAB", "VOCABULARY", "TOKENIZER_PROBES", "tokenizer_kind",
    "config_errors", "run_tokenizer", "training_texts", "save_tokenizer", "build_tokenizer", "train_bpe_tokenizer",
    "train_byte_level_bpe", "build_word_level_tokenizer", "encode_sides", "consumer_tokenizer", "BOS_ONLY",
    "check_tokenizer_fits",
    "check_consumers_tokenize_alike", "write_tokenizer_compat_fields", "cached_bpe", "tokenizer_identity",
]

log = logging.getLogger(__name__)

# Order fixes the ids: pad=0, unk=1, bos=2, eos=3, in both tokenizers (config.json
# records them; the byte-level one never emits <unk> but keeps its id for the same layout).
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")
# The smallest byte-level BPE: the special tokens and one token per byte, no merge.
MIN_BPE_VOCAB = len(SPECIAL_TOKENS) + 256

# Written out rather than derived from the generator's templates, because the word-level tokenizer's ids are
# 4 + a word's index here and measurements made with model.tokenizer=words rely on them.
# tests/data/test_synthetic.py holds it equal to what the generator can emit (rm.data.synthetic.emitted_words).
VOCABULARY: Tuple[str, ...] = tuple("""
! ' , . : ? Anna Assistant Ben Berlin Cairo Can Carla David Do Elena Frank Good Got Grace Hello Here Hi How
Hugo Human I It Learning Let Lima London Madrid My Nice Of Okay Paris Please Repeat Rome Sorry Sure System
Thanks That The Tokyo Try What Where Which Yesterday You Your a about after ahead am and answer answering
anything apple are ask at back banana be been best birds black blue boxing break brother but called can cannot
cat cherry chess city cold colour cooking course cousin cricket day do dog doing don else family father
favourite few find football for fox friend fruit go golf good grape green had happy hard has have hear help
here hockey home hope horse house in inside is it kind know learn lemon like likes live lives long lovely luck
mango many me month morning most mother my name near new next nice not noted now of orange owl painting park
parrot patient peach pet planning play plays please plum purple question questions quite rabbit rainy red
remember repeat rugby s saw say sister small so someone something sorry sounds sport stayed sure t take takes
tell telling tennis that the there these things this time tired to today told trip trying turtle walk weather
week well went when white will with words work year yellow you yourself
""".split())
"""The word-level tokenizer's words (``model.tokenizer=words``): every token the synthetic data's generator can
emit, sorted, as the ``Whitespace`` pre-tokenizer splits text. Includes the role words ``Human``, ``Assistant``
and ``System`` (the latter only used by the chat template of rm's tokenizers)."""

# Renders messages as an HH-RLHF transcript. A system message becomes its own
# "\n\nSystem: ..." turn in place ("System" is in the word-level vocabulary).
# Like Mistral's and Llama's templates it writes the BOS, and an EOS after the
# conversation's final answer: a conversation is tokenised as rendered, without
# the tokenizer's own special tokens (TRL's RewardTrainer and GRPO, OpenRLHF,
# ``apply_chat_template(tokenize=True)``), so the reward is read at that EOS, and
# a conversation gets the ids of its HH transcript as a plain-text side.
HH_CHAT_TEMPLATE = (
    "{{ bos_token }}"
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
    "{% if loop.last and message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\n\nAssistant:' }}{% endif %}"
)

# Texts on which pre-tokenizers disagree: digit runs, contractions, runs of spaces, tabs and newlines, accents,
# CJK, emoji, code. Fixed, so the check needs no data and says the same thing in every process.
TOKENIZER_PROBES = (
    "\n\nHuman: What's 12345 + 678? Don't   guess.\n\nAssistant: It's 13023 -- I've checked twice!",
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \U0001f642 tabs\tand  double  spaces\r\n",
    "def f(x):\n    return x**2  # squared, 3.14159\n",
)


def tokenizer_kind(model_cfg: ModelConfig) -> str:
    """``bpe`` | ``words`` | ``pretrained`` (a hub id or directory): what :func:`build_tokenizer` makes.

    ``model.tokenizer`` null means the pretrained model's tokenizer, or for a model built
    from its shape (``model.pretrained`` null too) a byte-level BPE trained on the run's texts.
    """
    if model_cfg.tokenizer in ("bpe", "words"):
        return model_cfg.tokenizer
    if model_cfg.tokenizer is None and model_cfg.pretrained is None:
        return "bpe"
    return "pretrained"


def config_errors(model_cfg: ModelConfig) -> List[str]:
    """What is wrong with ``model.tokenizer`` before anything loads, one message per problem naming the keys
    (:func:`rm.settings.validate.validate` reports them with the other settings)."""
    errors = []
    if model_cfg.tokenizer == "builtin":  # the name before the byte-level BPE became the default
        errors.append("model.tokenizer=builtin is now model.tokenizer=bpe (a byte-level BPE trained on your texts, the "
                      "default) or model.tokenizer=words (the word-level tokenizer of the synthetic data)")
    if model_cfg.pretrained and model_cfg.tokenizer in ("bpe", "words"):
        errors.append(f"model.tokenizer={model_cfg.tokenizer} makes a new tokenizer, whose ids model.pretrained="
                      f"{model_cfg.pretrained} never learnt: leave model.tokenizer null (the model's own tokenizer) or "
                      f"set model.pretrained=null")
    return errors


# The train split's chosen and rejected texts, given the tokenizer whose chat template renders its conversations.
TrainPairs = Callable[[Any], Mapping[str, Sequence[str]]]


def run_tokenizer(model_cfg: ModelConfig, train_pairs: TrainPairs, saved: Optional[Path] = None,
                  texts_identity: Optional[Mapping[str, Any]] = None):
    """The tokenizer a run of these settings uses: :func:`build_tokenizer`, given the train split's texts
    (:func:`training_texts`), which only ``model.tokenizer=bpe`` reads, and the directory a resumed run saved it in.

    Args:
        model_cfg: the ``model`` group.
        train_pairs: the train split after normalisation (:func:`rm.data.build.train_pairs`), read only where a
            BPE is trained.
        saved: the run directory's tokenizer (a resumed run), read back instead of trained again.
        texts_identity: what the train split's texts depend on (:func:`rm.data.build.split_identity`): a BPE
            trained on the same texts before is read from ``$RM_CACHE/tokenizer`` instead of trained again
            (:func:`cached_bpe`); None: trained.
    """
    return build_tokenizer(model_cfg, texts=lambda: training_texts(train_pairs), saved=saved, texts_identity=texts_identity)


def training_texts(train_pairs: TrainPairs) -> List[str]:
    """The texts ``model.tokenizer=bpe`` is trained on: both sides of every pair the train split keeps after
    normalisation, rendered as training renders them. The run's tokenizer does not exist yet, so conversations
    are rendered with the word-level one's chat template (:data:`HH_CHAT_TEMPLATE`, which every rm tokenizer
    carries). A refused row raises here what building the split would raise."""
    pairs = train_pairs(build_word_level_tokenizer())
    return list(pairs["chosen"]) + list(pairs["rejected"])


def save_tokenizer(tokenizer, directory: Path) -> None:
    """Save the run's tokenizer; a failed write (a full disk) leaves no partial ``tokenizer.json`` and names the
    directory (exit 5)."""
    try:
        tokenizer.save_pretrained(directory)
    except Exception as err:  # noqa: BLE001  (re-raised unless a file could not be written)
        if not is_storage_failure(err):
            raise
        shutil.rmtree(directory, ignore_errors=True)
        raise StorageError(f"could not save the run's tokenizer to {directory} ({err}); nothing was trained yet: "
                           "free space, then run again") from err


def build_tokenizer(model_cfg: ModelConfig, texts: Optional[Callable[[], Iterable[str]]] = None,
                    saved: Optional[Path] = None, texts_identity: Optional[Mapping[str, Any]] = None):
    """Load or make the tokenizer, and give it a pad token that is not a real token.

    ``model.tokenizer=bpe`` (:func:`tokenizer_kind`) trains a byte-level BPE of at most
    ``model.vocab_size`` tokens on ``texts()`` (:func:`train_bpe_tokenizer`;
    :func:`run_tokenizer` passes the train split's texts), or loads it from
    ``saved`` when that directory exists: a resumed run keeps the tokenizer its checkpoints
    were trained with, whatever the data files hold now. A pretrained tokenizer is used as its
    model was pretrained with it: its own special tokens (BOS) stay (the reward convention, module doc).

    Mistral and Llama ship without a pad token. Plain transformers reads the reward at the last token
    that is not the pad id, and every side ends in the EOS, so the pad must be neither a token of any text
    nor the EOS (TRL's fallback, which makes transformers read the reward one token early): ``unk`` first
    (byte-fallback tokenizers never emit it), else a spare special token (:func:`_spare_special_token`).
    The data pipeline drops a side that contains the pad id (``rm.data``).

    Raises:
        ValueError: ``model.tokenizer=bpe`` without ``texts`` (nor a saved tokenizer).
        ConfigError: a tokenizer without EOS, or with no token that can pad.
    """
    from transformers import AutoTokenizer

    kind = tokenizer_kind(model_cfg)
    if kind == "bpe" and saved is not None and Path(saved).is_dir():
        tokenizer = AutoTokenizer.from_pretrained(saved)
        log.info("tokenizer: the run's byte-level BPE, loaded from %s (%d tokens)", saved, len(tokenizer), extra=DETAIL)
    elif kind == "bpe":
        if texts is None:
            raise ValueError("model.tokenizer=bpe is trained on the run's texts: pass texts (rm.data.tokenizer.run_tokenizer does)")
        tokenizer, entry = cached_bpe(texts, model_cfg.vocab_size, texts_identity)
        log.info("tokenizer: byte-level BPE trained on the training texts%s: %d tokens (model.vocab_size=%d)",
                 f" (read from the cache {entry})" if entry else "", len(tokenizer), model_cfg.vocab_size, extra=DETAIL)
    elif kind == "words":
        tokenizer = build_word_level_tokenizer()
    else:
        source = ("model.tokenizer", model_cfg.tokenizer) if model_cfg.tokenizer else ("model.pretrained", model_cfg.pretrained)
        with named_hub_source(*source):
            tokenizer = AutoTokenizer.from_pretrained(source[1], trust_remote_code=model_cfg.trust_remote_code)
    name = model_cfg.tokenizer or model_cfg.pretrained or kind
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer of {name} has no EOS token: rm reads the reward at the EOS that ends each "
                          "side (as TRL and OpenRLHF do); use a tokenizer with one")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        pad = tokenizer.unk_token if tokenizer.unk_token is not None else _spare_special_token(tokenizer)
        if pad is None:
            raise ConfigError(
                f"the tokenizer of {name} has no pad token, no unk token and no spare special token to pad with; its "
                f"EOS ({tokenizer.eos_token!r}) cannot pad, since every side ends with it: add a pad token to the "
                "tokenizer (tokenizer.add_special_tokens({'pad_token': '<pad>'}), then save it and the resized model)")
        was = tokenizer.pad_token
        tokenizer.pad_token = pad
        log.info("tokenizer %s: using %r (id %d) as the pad token", "has no pad token" if was is None else
                 f"pads with its EOS {was!r}, which ends every side", tokenizer.pad_token, tokenizer.pad_token_id)
    tokenizer.padding_side = "right"
    return tokenizer


def _spare_special_token(tokenizer) -> Optional[str]:
    """A special token no text produces and the chat template does not write: what can pad a tokenizer without
    pad and unk (Llama 3's ``<|reserved_special_token_*|>``/``<|finetune_right_pad_id|>``, Qwen's ``<|fim_pad|>``).
    Tokens named like padding come first."""
    used = {tokenizer.bos_token, tokenizer.eos_token}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    spare = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
             if t.special and t.content not in used and t.content not in template]
    return min(spare, key=lambda t: ("pad" not in t.lower(), len(t), t)) if spare else None


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
        right padding, the HH chat template, a BOS added before each text.

    Example:
        >>> tok = train_bpe_tokenizer(["\\n\\nHuman: hello there\\n\\nAssistant: hello"] * 3, vocab_size=300)
        >>> tok.decode(tok("Grüße, 東京 🙂")["input_ids"], skip_special_tokens=True)
        'Grüße, 東京 🙂'
        >>> tok.unk_token_id in tok("Grüße, 東京 🙂")["input_ids"], tok.convert_ids_to_tokens(tok(" hello")["input_ids"])
        (False, ['<s>', 'Ġhello'])
    """
    return _wrap(train_byte_level_bpe(texts, vocab_size), model_max_length)


# The rm modules that make a BPE from its texts: this one and every module it imports at any depth
# (tests/foundations/test_startup_cache.py holds the list to the import graph). An edit to any of them is a cache miss.
TOKENIZER_SOURCES = ("rm.data.tokenizer", "rm.foundations.config", "rm.foundations.errors", "rm.foundations.cli", "rm.foundations.launch_env", "rm.foundations.cache")


def cached_bpe(texts: Callable[[], Iterable[str]], vocab_size: int, texts_identity: Optional[Mapping[str, Any]],
               model_max_length: int = 2048) -> Tuple["PreTrainedTokenizerFast", Optional[Path]]:
    """:func:`train_bpe_tokenizer` on ``texts()``, or the ``tokenizers`` model trained before on texts of the same
    identity (``$RM_CACHE/tokenizer``, :mod:`rm.foundations.cache`; keyed also by ``vocab_size``, this module's source and the
    ``tokenizers`` version), wrapped as training wraps it. Training is deterministic (:func:`train_bpe_tokenizer`),
    so the cached model is the one training would give.

    Returns:
        The tokenizer, and the cache entry it was read from (None: trained here).
    """
    entry = None
    if texts_identity is not None:
        entry = cache.cache_root() / "tokenizer" / f"{cache.key({'texts': dict(texts_identity), 'vocab_size': vocab_size, 'rm': cache.source_digest(TOKENIZER_SOURCES), 'libraries': cache.versions('tokenizers')})}.json"
        stored = cache.read_json(entry)
        if isinstance(stored, str):
            try:
                return _wrap(Tokenizer.from_str(stored), model_max_length), entry
            except Exception as err:  # noqa: BLE001  (an unreadable entry is trained again)
                log.debug("cache entry %s unreadable (%s): trained again", entry, err)
    trained = train_byte_level_bpe(texts(), vocab_size)
    if entry is not None:
        cache.write_json(entry, trained.to_str())
    return _wrap(trained, model_max_length), None


def tokenizer_identity(tokenizer) -> Optional[str]:
    """sha256 of everything that decides the ids ``tokenizer(text)`` gives and how rm's data checks read them: the
    ``tokenizers`` pipeline (normaliser, pre-tokenizer, vocabulary and merges, post-processor), the special tokens,
    the chat template and the class. None for a tokenizer without a ``tokenizers`` backend (a slow one): its data
    is not cached."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    fields = {"class": type(tokenizer).__name__, "backend": backend.to_str(), "special": tokenizer.special_tokens_map,
              "pad_token_id": tokenizer.pad_token_id, "unk_token_id": tokenizer.unk_token_id,
              "chat_template": tokenizer.chat_template, "padding_side": tokenizer.padding_side,
              "add_bos_token": getattr(tokenizer, "add_bos_token", None), "add_eos_token": getattr(tokenizer, "add_eos_token", None)}
    return cache.key(fields)


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
    :data:`VOCABULARY` in order. Text is split into words
    and punctuation runs (``Whitespace`` pre-tokenizer); any other word becomes
    ``<unk>``. A BOS is added before each text, as Llama's tokenizers do (:data:`BOS_ONLY`).

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


# What rm's own tokenizers add to a text, as Llama's and Mistral's do: a BOS before it.
BOS_ONLY = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                         special_tokens=[("<s>", SPECIAL_TOKENS.index("<s>"))])


def _wrap(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a ``tokenizers`` one: special tokens, BOS, right padding, chat template."""
    from transformers import PreTrainedTokenizerFast

    pad, unk, bos, eos = SPECIAL_TOKENS
    tok.post_processor = BOS_ONLY
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, unk_token=unk, bos_token=bos, eos_token=eos,
        model_max_length=model_max_length, padding_side="right",
    )
    hf_tok.chat_template = HH_CHAT_TEMPLATE
    return hf_tok


def encode_sides(tokenizer, texts: Sequence[str], *, templated: bool, append_eos: bool = True) -> List[List[int]]:
    """The token ids each side trains on: the reward convention (module doc), the one home of it.

    A plain-text side gets the EOS string appended unless it already ends with it (``append_eos``; TRL's
    ``add_eos``), then ``tokenizer(text)`` with the tokenizer's own special tokens. A side the chat template
    rendered (``templated``) is tokenised as rendered, ``add_special_tokens=False``, as
    ``apply_chat_template(tokenize=True)`` and TRL do: the template wrote its special tokens.

    Example:
        >>> tok = build_word_level_tokenizer()
        >>> encode_sides(tok, ["Hello there", "Hello there</s>"], templated=False)
        [[2, 24, 207, 3], [2, 24, 207, 3]]
        >>> encode_sides(tok, ["Hello there"], templated=False, append_eos=False)
        [[2, 24, 207]]
        >>> encode_sides(tok, [tok.apply_chat_template([{"role": "assistant", "content": "Hi"}], tokenize=False)],
        ...              templated=True)
        [[2, 11, 8, 26, 3]]
    """
    if templated:
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token
    if append_eos:
        texts = [text if text.endswith(eos) else text + eos for text in texts]
    return tokenizer(list(texts))["input_ids"]


def consumer_tokenizer(tokenizer, append_eos: bool = True):
    """A copy of ``tokenizer`` whose ``tokenizer(text)`` gives the ids a plain-text side trained on
    (:func:`encode_sides`) for any text that does not already end with the EOS: its post-processor adds what it
    added, then the EOS. This is the tokenizer the exported bundle carries, for the consumers that call
    ``tokenizer(text)`` (transformers, ``pipeline``, PEFT); ``append_eos=False``: an unchanged copy.

    Example:
        >>> tok = consumer_tokenizer(build_word_level_tokenizer())
        >>> tok("Hello there")["input_ids"], tok("Hello there", add_special_tokens=False)["input_ids"]
        ([2, 24, 207, 3], [24, 207])
    """
    import copy

    out = copy.deepcopy(tokenizer)
    if not append_eos:
        return out
    backend = out.backend_tokenizer
    eos, eos_id = out.eos_token, out.eos_token_id
    state = json.loads(backend.to_str())
    current = state.get("post_processor")
    if current is not None and current.get("type") == "TemplateProcessing":
        # Kept a template (Llama's "<s> $A" becomes "<s> $A </s>"): transformers' add_bos_token/add_eos_token can say
        # what it does (write_tokenizer_compat_fields), which transformers 4's Llama tokenizers rebuild it from.
        current["single"].append({"SpecialToken": {"id": eos, "type_id": 0}})
        current["pair"].append({"SpecialToken": {"id": eos, "type_id": 1}})
        current["special_tokens"][eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
        state["post_processor"] = current
        backend.post_processor = Tokenizer.from_str(json.dumps(state)).post_processor
    else:
        append = processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A $B:1 {eos}:1", special_tokens=[(eos, eos_id)])
        backend.post_processor = append if current is None else processors.Sequence([backend.post_processor, append])
    return out


def check_tokenizer_fits(model_cfg: ModelConfig, tokenizer) -> None:
    """The tokenizer's ids must index the embedding: a vocabulary larger than ``model.vocab_size`` fails in the
    middle of the first forward with an index error.

    Raises:
        ConfigError: naming ``model.vocab_size`` and the tokenizer's size.
    """
    if model_cfg.pretrained is None and len(tokenizer) > model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens "
            f"(model.tokenizer={model_cfg.tokenizer or 'bpe'}): set model.vocab_size >= {len(tokenizer)}"
        )


def check_consumers_tokenize_alike(model_cfg: ModelConfig, tokenizer, texts: Tuple[str, ...] = (),
                                   append_eos: bool = True) -> None:
    """The exported model's tokenizers must tokenise as training did, as its consumers load them.

    Checked on ``texts`` (the run passes some of its own training texts: whether two pre-tokenizers disagree
    depends on the merges learnt from the data) and :data:`TOKENIZER_PROBES`, in both forms the bundle holds
    (``rm.modelling.bundle``): the tokenizer as trained, which must reload unchanged, and :func:`consumer_tokenizer`, whose
    ``tokenizer(text)`` must give the ids the text trained on (:func:`encode_sides`).

    Every consumer (``AutoTokenizer``, ``pipeline``, TRL, RewardBench, ``rm.score``) loads the bundle's tokenizer
    with ``AutoTokenizer.from_pretrained``, which in transformers 5 picks the class from ``config.json``'s
    ``model_type`` for some architectures (Qwen2: ``Qwen2Tokenizer``, which rebuilds the pre-tokenizer) whatever
    ``tokenizer_config.json`` says. A tokenizer that does not survive that trip would give other tokens, and so
    other rewards, than training used: refused here, before any weight loads.

    Raises:
        ConfigError: naming ``model.tokenizer``, ``model.model_type``, the class transformers loads and a probe.
    """
    from transformers import AutoTokenizer

    probes = tuple(t for t in (*texts, *TOKENIZER_PROBES) if not t.endswith(tokenizer.eos_token))
    trained = [encode_sides(tokenizer, [text], templated=False, append_eos=append_eos)[0] for text in probes]
    for form, saved in (("as trained", tokenizer), ("as exported", consumer_tokenizer(tokenizer, append_eos))):
        with tempfile.TemporaryDirectory() as tmp:
            saved.save_pretrained(tmp)
            (Path(tmp) / "config.json").write_text(json.dumps({"model_type": model_cfg.model_type}))
            write_tokenizer_compat_fields(Path(tmp))  # as rm.modelling.bundle writes the bundle
            reloaded = AutoTokenizer.from_pretrained(tmp)
        # rm.score tokenises as training did with the first; transformers, pipeline and PEFT call the second.
        got = ([encode_sides(reloaded, [t], templated=False, append_eos=append_eos)[0] for t in probes]
               if form == "as trained" else [reloaded(t)["input_ids"] for t in probes])
        differ = [i for i, (a, b) in enumerate(zip(got, trained)) if a != b]
        if differ:
            text = probes[differ[0]]
            raise ConfigError(
                f"model.tokenizer={model_cfg.tokenizer or ('bpe' if model_cfg.pretrained is None else model_cfg.pretrained)} "
                f"with model.model_type={model_cfg.model_type}: transformers' AutoTokenizer loads the exported model's "
                f"tokenizer ({form}) as {type(reloaded).__name__}, which tokenises {len(differ)} of {len(probes)} probe "
                f"texts differently (e.g. {text[:40]!r}: {len(trained[differ[0]])} tokens in training, "
                f"{len(got[differ[0]])} reloaded), so every consumer of the model would score other tokens "
                f"than training did. Use the model's own tokenizer (model.pretrained=<dir> with model.tokenizer=null), "
                f"or, for a tokenizer of your own, a model_type whose tokenizer class is generic (llama, mistral)"
            )


def write_tokenizer_compat_fields(directory: Path) -> None:
    """The tokenizer half of :func:`rm.modelling.bundle.write_compat_fields`: make a saved tokenizer read the same under
    transformers 4 and 5.

    transformers 5 names the tokenizer class ``TokenizersBackend``, which transformers 4 does not have, and both
    majors' generic fast tokenizer returns ``token_type_ids``, which Llama/Mistral models reject. So the class
    becomes ``PreTrainedTokenizerFast`` (a tokenizer.json tokenizer in both) and the model inputs are pinned to ids
    and mask. ``add_bos_token``/``add_eos_token`` are what both majors' Llama-style tokenizers rebuild the
    post-processor from (transformers 5's generic one too, whenever they are written): they are written as
    ``tokenizer.json``'s post-processor adds BOS and EOS where its template says only that, and removed otherwise
    (the class then becomes the generic one, which keeps the post-processor as saved). A directory without
    ``tokenizer_config.json`` is left as it is.
    """
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    flags = _template_flags(Path(directory) / "tokenizer.json", config)
    if config.get("tokenizer_class") in (None, "TokenizersBackend") or flags is None:
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_input_names"] = ["input_ids", "attention_mask"]
    if flags is None:
        config.pop("add_bos_token", None)
        config.pop("add_eos_token", None)
    else:
        config["add_bos_token"], config["add_eos_token"] = flags
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _template_flags(tokenizer_json: Path, config: Mapping[str, Any]) -> Optional[Tuple[bool, bool]]:
    """``(add_bos_token, add_eos_token)`` when the saved post-processor adds exactly ``[BOS] $A [EOS]`` (either
    optional) to a text, or adds nothing; None when it does something else (a ``Sequence``, two EOS, other tokens)."""
    if not tokenizer_json.is_file():
        return None
    post = json.loads(tokenizer_json.read_text()).get("post_processor")
    if post is None:
        return False, False
    if post.get("type") != "TemplateProcessing":
        return None
    name = lambda token: token.get("content") if isinstance(token, dict) else token  # noqa: E731  (AddedToken's dict)
    single = [piece.get("SpecialToken", {}).get("id", "$A" if "Sequence" in piece else None) for piece in post["single"]]
    bos, eos = name(config.get("bos_token")), name(config.get("eos_token"))
    has_bos, has_eos = single[:1] == [bos], single[-1:] == [eos] and len(single) > 1
    return (has_bos, has_eos) if single == [bos] * has_bos + ["$A"] + [eos] * has_eos else None
