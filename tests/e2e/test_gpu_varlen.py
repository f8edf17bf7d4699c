"""A packed row's attention in one varlen flash call a layer on CUDA (rm.modelling.attention, issue 48): skipped without
a GPU (the ``gpu`` marker, tests/conftest.py).

    python -m pytest -m gpu tests/e2e/test_gpu_varlen.py        # the varlen stage of scripts/gpu_session.sh

tests/modelling/test_varlen.py checks the layout on the CPU with a reference kernel; here the real kernel runs, on
a tiny random Llama (no window) and a tiny random Mistral whose sliding window (4 tokens) is shorter than most
sequences, both with 4 query heads on 2 key-value heads. Each packed batch (plain, and prefix-shared) is scored
against the padded batch of the same pairs (transformers' own masks, SDPA), rewards and gradients, in bf16 (weights
in bf16; fp32 weights under bf16 autocast; with activation checkpointing; with LoRA).

Tolerance, bf16 against bf16 (8 significant bits; the two layouts round at different places): rewards within
``REWARD_ATOL`` and each gradient within ``GRAD_RTOL`` of the padded one's norm (relative Frobenius error).
Calibrated on the CPU, these tests' bodies run with tests/modelling/test_varlen.py's reference kernel in place of
flash (bf16, the same models and batches): rewards differed from the padded ones by at most 0.0032 and gradients by
at most 1.8% there, and the Mistral's window moves its rewards by 0.197. Unmeasured on a GPU so far.
"""

from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from rm.data.collator import PackedPairCollator, PairCollator, PrefixSharedCollator
from rm.modelling.model import enable_activation_checkpointing, pair_rewards
from tests.modelling.test_attention import FEATURES, counted_sdpa_calls

pytestmark = pytest.mark.gpu

REWARD_ATOL = 2e-2
GRAD_RTOL = 0.05
WINDOW = 4


def tiny(kind: str, device="cuda", dtype=torch.bfloat16):
    """A random tiny decoder from its config (nothing downloaded), with rm's reward head, in ``dtype``."""
    from transformers import LlamaConfig, LlamaForSequenceClassification, MistralConfig, MistralForSequenceClassification

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_labels=1, pad_token_id=0)
    if kind == "llama":
        config, cls = LlamaConfig(**shape), LlamaForSequenceClassification
    else:
        config, cls = MistralConfig(**shape, sliding_window=WINDOW), MistralForSequenceClassification
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation="sdpa").to(device=device, dtype=dtype)


def with_lora(model):
    """LoRA on the attention and MLP projections, both factors random (PEFT's default B = 0 would leave A without
    gradient): the base frozen, the adapters and the reward head trained."""
    from peft import LoraConfig, TaskType, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    return get_peft_model(model, config)


@contextmanager
def counted_varlen_calls():
    """Every call of the varlen kernel made inside, the real one run."""
    import rm.modelling.attention as attention

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[3].numel() - 1)  # its number of sequences
        return real(*args, **kwargs)

    real = attention.varlen_attn
    with mock.patch.object(attention, "varlen_attn", counting):
        yield calls


def rewards_and_grads(model, batch, autocast=False):
    """Rewards, and the gradients of a loss that weighs every reward differently (fp32), of the trained parameters."""
    model.zero_grad(set_to_none=True)
    inputs = {k: batch[k].to("cuda" if torch.cuda.is_available() else "cpu") for k in
              ("input_ids", "attention_mask", "position_ids", "ends", "pair_ids", "roles") if k in batch}
    device = inputs["input_ids"].device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        chosen, rejected = pair_rewards(model, **inputs)
    rewards = torch.cat([chosen, rejected]).float()
    (rewards * torch.linspace(-1, 2, rewards.numel(), device=device)).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return rewards.detach().cpu(), grads


def assert_close_in_bf16(got, expected):
    (rewards, grads), (want_rewards, want_grads) = got, expected
    torch.testing.assert_close(rewards, want_rewards, rtol=0, atol=REWARD_ATOL)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        w = want_grads[name]
        error = (g - w).norm() / w.norm().clamp_min(1e-12)
        assert error <= GRAD_RTOL, f"{name}: relative error {error:.4f} (norm {w.norm():.3g})"


VARIANTS = ["bf16", "bf16-autocast", "checkpointing", "lora"]


def prepared(kind, variant, device="cuda"):
    model = tiny(kind, device, torch.float32 if variant == "bf16-autocast" else torch.bfloat16)
    if variant == "lora":
        model = with_lora(model)
    if variant == "checkpointing":
        enable_activation_checkpointing(model)
        model.train()  # transformers recomputes in training mode only; no dropout in these configs
    return model


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("collator", [PackedPairCollator(), PrefixSharedCollator(packed=True)],
                         ids=["packed", "packed+shared"])
@pytest.mark.parametrize("kind", ["llama", "mistral-window"])
def test_varlen_rows_give_the_padded_rewards_and_gradients(kind, collator, variant):
    """One varlen call a layer and forward (checkpointing's recomputation is a second forward), no SDPA call; the
    rewards and gradients of the padded batch of the same pairs within the bf16 tolerance (module docstring)."""
    model = prepared(kind, variant)
    autocast = variant == "bf16-autocast"
    expected = rewards_and_grads(model, PairCollator(pad_token_id=0)(FEATURES), autocast)
    with counted_varlen_calls() as calls, counted_sdpa_calls() as sdpa:
        got = rewards_and_grads(model, collator(FEATURES), autocast)
    layers = model.config.num_hidden_layers
    assert len(calls) == layers * (2 if variant == "checkpointing" else 1), calls
    assert not sdpa, f"{len(sdpa)} SDPA calls beside the varlen ones"
    if isinstance(collator, PrefixSharedCollator):  # prompt + chosen, and rejected, for each pair with both answers
        assert calls[0] > len(FEATURES)
    assert_close_in_bf16(got, expected)


def test_the_window_binds_here():
    """The Mistral's window changes its padded rewards (so the tests above check that varlen applies it)."""
    model = tiny("mistral-window")
    windowed = rewards_and_grads(model, PairCollator(pad_token_id=0)(FEATURES))[0]
    model.config.sliding_window = None
    assert (rewards_and_grads(model, PairCollator(pad_token_id=0)(FEATURES))[0] - windowed).abs().max() > REWARD_ATOL


@pytest.mark.parametrize("collator", [PackedPairCollator(), PrefixSharedCollator(packed=True)],
                         ids=["packed", "packed+shared"])
def test_fp32_on_cuda_keeps_the_segmented_loop(collator):
    """Flash takes half precision only: an fp32 row runs a segment at a time, as before."""
    model = tiny("llama", dtype=torch.float32)
    with counted_varlen_calls() as calls, counted_sdpa_calls() as sdpa:
        rewards_and_grads(model, collator(FEATURES))
    assert not calls and len(sdpa) > model.config.num_hidden_layers


@pytest.mark.parametrize("collator", [PackedPairCollator(), PrefixSharedCollator(packed=True)],
                         ids=["packed", "packed+shared"])
def test_a_packed_step_with_the_hosts_hints_never_waits_for_the_device(collator):
    """The training step reads a packed row's layout on the host (rm.modelling.model.host_hints), so its forward and
    backward queue every kernel without waiting for the device: CUDA's sync debug mode raises at any wait."""
    from rm.modelling.model import host_hints

    model = prepared("mistral-window", "bf16")
    batch = collator(FEATURES)
    inputs = {k: batch[k].to("cuda") for k in ("input_ids", "position_ids", "ends", "pair_ids", "roles") if k in batch}
    hints = host_hints(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        chosen, rejected = pair_rewards(model, **inputs, **hints)
        (chosen.float().sum() - rejected.float().sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
