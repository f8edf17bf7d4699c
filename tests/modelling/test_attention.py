"""SDPA one packed segment at a time (rm.modelling.attention): the rewards and gradients of the whole-row masked SDPA.

The tiny model has 4 query heads on 2 key-value heads, so the grouped-query path is the one checked.
Speed is measured by ``benchmarks/bench_vs_trl.py`` (benchmarks/results/throughput.md), not here.
"""

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from accelerate.utils import set_seed

from rm.modelling.attention import PackedRow, segment_bounds, segmented_sdpa
from rm.data.collator import PackedPairCollator, PrefixSharedCollator
from rm.modelling.model import build_model, host_hints, pair_rewards

# Sequences of different lengths, one of a single token, a shared prompt on most pairs (ids < 512, the tiny vocabulary).
PROMPT = [2, 30, 31, 32, 33, 34, 35]
FEATURES = [
    {"chosen_input_ids": PROMPT + [50, 51, 3], "rejected_input_ids": PROMPT + [60, 61, 62, 63, 3]},
    {"chosen_input_ids": [70, 71, 72, 3], "rejected_input_ids": [80]},
    {"chosen_input_ids": PROMPT, "rejected_input_ids": PROMPT + [90, 3]},
    {"chosen_input_ids": PROMPT[:3] + [40] * 9, "rejected_input_ids": PROMPT[:3] + [41] * 2},
]


@pytest.fixture(scope="module")
def model():
    from tests.conftest import FAST_TINY, compose_run
    from rm.foundations.config import to_run_config

    cfg = to_run_config(compose_run(FAST_TINY + ["model.attn_implementation=sdpa"]))
    set_seed(0)
    return build_model(cfg.model, pad_token_id=0, dtype="float32", gradient_checkpointing=False)


def rewards_and_grads(model, batch, split: bool):
    """Rewards and the gradients of a loss that weighs every reward differently, with or without splitting."""
    model.zero_grad(set_to_none=True)
    if split:
        chosen, rejected = pair_rewards(model, batch["input_ids"], position_ids=batch["position_ids"], ends=batch["ends"],
                                        pair_ids=batch.get("pair_ids"), roles=batch.get("roles"))
    else:  # the whole row in one SDPA call: what rm computed before rm.modelling.attention
        with mock.patch("rm.modelling.attention.segmented_inputs", return_value=None):
            chosen, rejected = pair_rewards(model, batch["input_ids"], position_ids=batch["position_ids"],
                                            ends=batch["ends"], pair_ids=batch.get("pair_ids"), roles=batch.get("roles"))
    rewards = torch.cat([chosen, rejected])
    (rewards * torch.linspace(-1, 2, rewards.numel())).sum().backward()
    return rewards.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@contextmanager
def counted_sdpa_calls():
    """Every SDPA call made inside: ``(query length, whether cuDNN's kernel was allowed)`` each."""
    calls, original = [], torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append((args[0].shape[2], torch.backends.cuda.cudnn_sdp_enabled()))
        return original(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        yield calls
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


@pytest.mark.parametrize("collator", [PackedPairCollator(), PrefixSharedCollator(packed=True)], ids=["packed", "packed+shared"])
def test_one_sdpa_call_per_segment_gives_the_whole_rows_rewards_and_gradients(model, collator):
    batch = collator(FEATURES)
    expected, expected_grads = rewards_and_grads(model, batch, split=False)
    with counted_sdpa_calls() as called:
        got, grads = rewards_and_grads(model, batch, split=True)
    calls = [length for length, _ in called]
    segments = 2 * len(FEATURES) if isinstance(collator, PackedPairCollator) else len(FEATURES)
    layers = model.config.num_hidden_layers
    # It did split: one call per segment and layer, each over that segment's tokens only.
    assert len(calls) == segments * layers and sum(calls) == batch["input_ids"].shape[1] * layers
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _autograd_nodes(tensor) -> list:
    """The names of the autograd graph's nodes behind ``tensor``."""
    seen, stack, names = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


@pytest.mark.parametrize("causal", [True, False], ids=["packed", "packed+shared"])
def test_one_more_segment_adds_its_sdpa_call_and_no_slice_of_the_row(causal):
    """Each segment adds one SDPA node to the graph; q, k and v are split once whatever the segments. A slice per
    segment would add three nodes a segment whose backward each fills a zero tensor of the whole row (on a GPU, a
    few more kernels a segment and layer: rm.plan.steptime.SEGMENT_KERNELS)."""
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2

    def nodes(segments: int) -> list:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, heads, 8 * segments, 4, requires_grad=True) for heads in (4, 2, 2))
        masks = None if causal else [torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()] * segments
        row = PackedRow(list(range(0, 8 * segments + 1, 8)), causal=causal, masks=masks)
        out, _ = segmented_sdpa(module, q, k, v, None, packed_row=row)
        return _autograd_nodes(out)

    four, eight = nodes(4), nodes(8)
    added = [name for name in set(eight) for _ in range(eight.count(name) - four.count(name))]
    assert len(added) == 4 and all("Attention" in name for name in added), added
    assert not any("Slice" in name for name in eight)


def test_without_bounds_it_is_transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, :, :, 4:] = False
    for m in (None, mask):
        got, _ = segmented_sdpa(module, q, k, v, m, scaling=0.3)
        expected, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.3)
        assert torch.equal(got, expected)


def test_segment_bounds_of_a_single_segment_is_none():
    assert segment_bounds(torch.tensor([[0, 1, 2, 3]]), starts_at_zero=True) is None
    assert segment_bounds(torch.tensor([[4, 4, 4]]), starts_at_zero=False) is None
    # A pair id that comes back later is a new segment (never the case in rm's collators, but no merge either).
    assert segment_bounds(torch.tensor([[0, 1, 0]]), starts_at_zero=False) == [0, 1, 2, 3]


def test_each_pair_gets_its_block_of_the_per_token_rule_and_no_row_mask_is_built():
    from rm.modelling.attention import segmented_inputs
    from rm.modelling.prefix_sharing import allowed

    batch = PrefixSharedCollator(packed=True)(FEATURES)
    pair_ids, roles = batch["pair_ids"], batch["roles"]
    inputs = segmented_inputs(batch["input_ids"], batch["position_ids"], pair_ids, roles)
    bounds = inputs["packed_row"].bounds
    assert len(bounds) == len(FEATURES) + 1
    rule = allowed(pair_ids, roles)
    for (start, end), block in zip(zip(bounds[:-1], bounds[1:]), inputs["packed_row"].masks):
        assert torch.equal(block, rule[:, :, start:end, start:end])
    length = bounds[-1]
    assert inputs["attention_mask"].shape == (1, 1, length, length)
    assert inputs["attention_mask"].untyped_storage().nbytes() == 1  # a stand-in: the row's T x T never exists


def test_a_pairs_mask_from_its_roles_is_the_per_token_rule():
    from rm.modelling.prefix_sharing import allowed, pair_mask

    for prompt, chosen, rejected in [(0, 1, 1), (5, 1, 1), (3, 4, 2), (7, 0, 6), (1, 9, 0), (12, 3, 3)]:
        roles = [0] * prompt + [1] * chosen + [2] * rejected
        rule = allowed(torch.zeros(1, len(roles), dtype=torch.long), torch.tensor([roles]))
        assert torch.equal(pair_mask(roles, "cpu"), rule), (prompt, chosen, rejected)
    for roles in ([0, 1, 2, 1], [0, 2, 1], [-1, -1], [0, 1, -1], []):
        assert pair_mask(roles, "cpu") is None, roles


def test_a_segment_longer_than_mistrals_sliding_window_keeps_the_window():
    """Plain packing, sequences of 1 to 12 tokens, a window of 3: each segment's call gets the windowed triangle, so
    every reward and gradient is that of the sequence scored alone with the window. (transformers' own whole-row mask
    does not give that here: a sequence after one longer than the window gets another reward, 0.370 for 0.361.)"""
    from transformers import MistralConfig, MistralForSequenceClassification

    from rm.modelling.model import sequence_rewards

    config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_labels=1, pad_token_id=0,
                           sliding_window=3)
    torch.manual_seed(0)
    model = MistralForSequenceClassification._from_config(config, attn_implementation="sdpa")
    batch = PackedPairCollator()(FEATURES)
    got, grads = rewards_and_grads(model, batch, split=True)

    sequences = [f["chosen_input_ids"] for f in FEATURES] + [f["rejected_input_ids"] for f in FEATURES]
    assert max(map(len, sequences)) > 3 * config.sliding_window  # the window binds
    model.zero_grad(set_to_none=True)
    alone = torch.stack([sequence_rewards(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0]
                         for s in sequences])
    (alone * torch.linspace(-1, 2, alone.numel())).sum().backward()
    torch.testing.assert_close(got, alone.detach(), rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Without the window the same weights give other rewards: the window was applied, not idle.
    model.config.sliding_window = None
    assert not torch.allclose(rewards_and_grads(model, batch, split=True)[0], got, atol=1e-3)


def test_a_gpu_keeps_off_cudnns_kernel_and_a_cpu_keeps_its_choice():
    """cuDNN's SDPA builds a graph for every new shape, and training's lengths change every micro-batch (2.6 ms of
    CPU a call on an H200): on a GPU rm's attention takes flash or memory-efficient attention. Read off the flags
    the context sets (no GPU is needed to set them)."""
    from rm.modelling.attention import sdpa_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_kernels(torch.device("cuda", 0)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with sdpa_kernels(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.parametrize("layout", ["padded", "shared"])
def test_every_row_layout_runs_its_sdpa_calls_under_the_kernel_choice(model, layout):
    """Not only packed segments: a padded batch's and a prefix-shared row-per-pair batch's SDPA calls, made by
    transformers under its own mask, go through rm's attention and enter :func:`rm.modelling.attention.sdpa_kernels` with
    the query's device, one call a layer (on a GPU, no cuDNN; tests/e2e/test_gpu.py checks the flags there)."""
    import rm.modelling.attention
    from rm.data.collator import PairCollator

    collator = PairCollator(pad_token_id=0) if layout == "padded" else PrefixSharedCollator(packed=False)
    batch = collator(FEATURES)
    devices = []
    original = rm.modelling.attention.sdpa_kernels

    def recording(device):
        devices.append(device)
        return original(device)

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "ends", "pair_ids", "roles")
              if k in batch}
    with mock.patch("rm.modelling.attention.sdpa_kernels", recording), counted_sdpa_calls() as calls:
        chosen, rejected = pair_rewards(model, **inputs)
    layers = model.config.num_hidden_layers
    assert devices == [torch.device("cpu")] * layers and len(calls) == layers
    assert chosen.shape == rejected.shape == (len(FEATURES),)


def test_a_padded_batch_registers_rms_attention():
    """rm's attention is registered under transformers' ``sdpa`` when the first rewards are computed, whatever
    the layout: a process that never packs (a padded run, a consumer scoring) gets the GPU kernel choice too. A
    fresh process, as this one has imported it already."""
    import subprocess
    import sys

    code = """
import sys
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from rm.modelling.model import pair_rewards
assert "rm.modelling.attention" not in sys.modules, "imported before any rewards"
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, pad_token_id=0, num_labels=1, attn_implementation="sdpa")
model = LlamaForSequenceClassification(config)
ids = torch.tensor([[5, 6, 7], [5, 6, 0], [8, 9, 10], [8, 0, 0]])
pair_rewards(model, ids, (ids != 0).long())
assert "rm.modelling.attention" in sys.modules, "a padded batch did not register rm's attention"
assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sys.modules["rm.modelling.attention"].segmented_sdpa
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

@pytest.mark.parametrize("collator", [PackedPairCollator(), PrefixSharedCollator(packed=True), PrefixSharedCollator(packed=False)],
                         ids=["packed", "packed+shared", "shared rows"])
def test_with_the_hosts_hints_the_forward_reads_no_value_off_its_inputs(model, collator):
    """The training step reads a packed batch's layout on the host before the copy (rm.modelling.model.host_hints): on
    a GPU a value read off a device tensor waits for every kernel queued before it. Here every such read raises; the
    rewards are those of the forward that reads the layout itself. (Padded batches: transformers reads the mask.)"""
    batch = collator(FEATURES)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "ends", "pair_ids", "roles") if k in batch}
    expected = torch.cat(pair_rewards(model, **inputs))
    hints = host_hints(batch)

    def read(*args, **kwargs):
        raise AssertionError("a value was read off a tensor")

    with mock.patch.object(torch.Tensor, "tolist", read), mock.patch.object(torch.Tensor, "item", read), \
            mock.patch.object(torch.Tensor, "__bool__", read):
        got = torch.cat(pair_rewards(model, **inputs, **hints))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
