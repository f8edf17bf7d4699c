"""One varlen flash call a layer for a packed row (rm.modelling.attention, issue 48), checked on the CPU.

The real kernel needs CUDA (tests/e2e/test_gpu_varlen.py runs it). Here :func:`varlen_reference` stands in for it:
per varlen sequence, CPU SDPA under flash's bottom-right aligned causal (and windowed) mask on the sequence's
gathered keys, fed the layout exactly as the kernel would be. Fed a wrong layout it gives other outputs, so the
oracle tests below (reference against today's segmented SDPA, fp32) check the layout, the gather and the window
rule; the layout tests check :func:`rm.modelling.attention.varlen_layout` on hand-worked rows.
"""

from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from rm.data.collator import CHOSEN, PREFIX, REJECTED, PackedPairCollator, PrefixSharedCollator
from rm.modelling.attention import PackedRow, segmented_sdpa, takes_varlen, varlen_layout
from rm.modelling.prefix_sharing import pair_mask
from tests.modelling.test_attention import FEATURES, model, rewards_and_grads  # noqa: F401  (model: a fixture)


def varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
    """``torch.nn.attention.varlen.varlen_attn`` on a CPU, one SDPA call per sequence: query ``i`` of a sequence of
    ``n_q`` queries and ``n_k`` keys sees key ``j`` when ``j <= i + n_k - n_q + right`` and
    ``j >= i + n_k - n_q - left`` (flash-attention's rule, a negative side unbounded). Checks what the kernel relies
    on: int32 offsets over all the tokens, and maxima that bound every sequence."""
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and cu_seq_q.shape == cu_seq_k.shape
    q_bounds, k_bounds = cu_seq_q.tolist(), cu_seq_k.tolist()
    assert q_bounds[0] == k_bounds[0] == 0 and q_bounds[-1] == query.shape[0] and k_bounds[-1] == key.shape[0]
    q_sizes = [b - a for a, b in zip(q_bounds[:-1], q_bounds[1:])]
    k_sizes = [b - a for a, b in zip(k_bounds[:-1], k_bounds[1:])]
    assert max_q == max(q_sizes) and max_k == max(k_sizes) and min(q_sizes) > 0
    assert enable_gqa or query.shape[1] == key.shape[1]
    left, right = window_size
    outputs = []
    for (qa, qb), (ka, kb) in zip(zip(q_bounds[:-1], q_bounds[1:]), zip(k_bounds[:-1], k_bounds[1:])):
        n_q, n_k = qb - qa, kb - ka
        i = torch.arange(n_q)[:, None] + (n_k - n_q)
        j = torch.arange(n_k)[None, :]
        mask = torch.ones(n_q, n_k, dtype=torch.bool)
        if right >= 0:
            mask &= j <= i + right
        if left >= 0:
            mask &= j >= i - left
        q, k, v = (t.transpose(0, 1) for t in (query[qa:qb], key[ka:kb], value[ka:kb]))
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(outputs)


@contextmanager
def varlen_on_cpu(calls=None):
    """rm's attention takes the varlen path on the CPU, with :func:`varlen_reference` as its kernel; each call's
    number of sequences is appended to ``calls``."""

    def kernel(*args, **kwargs):
        if calls is not None:
            calls.append(args[3].numel() - 1)
        return varlen_reference(*args, **kwargs)

    with mock.patch("rm.modelling.attention.varlen_available", return_value=True), \
            mock.patch("rm.modelling.attention.takes_varlen", return_value=True), \
            mock.patch("rm.modelling.attention.varlen_attn", kernel):
        yield


def roles_of(pairs):
    """A packed prefix-shared row's roles and segment bounds from its pairs' ``(prompt, chosen, rejected)`` lengths."""
    roles, bounds = [], [0]
    for p, c, r in pairs:
        roles += [PREFIX] * p + [CHOSEN] * c + [REJECTED] * r
        bounds.append(len(roles))
    return roles, bounds


# ---------------------------------------------------------------- the layout, by hand

def test_plain_packing_is_one_sequence_a_segment_over_the_row_itself():
    layout = varlen_layout([0, 3, 5, 6])
    assert layout.cu_seq_q.tolist() == layout.cu_seq_k.tolist() == [0, 3, 5, 6]
    assert layout.cu_seq_q.dtype == torch.int32 and layout.key_index is None
    assert (layout.max_q, layout.max_k) == (3, 3)


def test_a_pair_with_an_empty_chosen_answer():
    """Pair 0: prompt 2, chosen 0, rejected 2 (tokens 0-3); pair 1: prompt 1, chosen 1, rejected 1 (tokens 4-6).
    A0 = queries 0, 1 on keys 0, 1; B0 = queries 2, 3 on keys 0, 1, 2, 3 (the prompt, then itself);
    A1 = queries 4, 5 on keys 4, 5; B1 = query 6 on keys 4 (the prompt) and 6, not 5 (the chosen answer)."""
    roles, bounds = roles_of([(2, 0, 2), (1, 1, 1)])
    assert roles == [0, 0, 2, 2, 0, 1, 2] and bounds == [0, 4, 7]
    layout = varlen_layout(bounds, roles)
    assert layout.cu_seq_q.tolist() == [0, 2, 4, 6, 7]
    assert layout.cu_seq_k.tolist() == [0, 2, 6, 8, 10]
    assert layout.key_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 4, 6]
    assert (layout.max_q, layout.max_k) == (2, 4)


def test_a_pair_with_an_empty_rejected_answer_has_no_second_sequence():
    """Pair 0: prompt 3, chosen 1, rejected 0: A0 only (queries and keys 0-3), no B0 (no queries). Pair 1: prompt
    1, chosen 0, rejected 1: A1 = query 4 on key 4; B1 = query 5 on keys 4, 5."""
    layout = varlen_layout(*reversed(roles_of([(3, 1, 0), (1, 0, 1)])))
    assert layout.cu_seq_q.tolist() == [0, 4, 5, 6]
    assert layout.cu_seq_k.tolist() == [0, 4, 5, 7]
    assert layout.key_index.tolist() == [0, 1, 2, 3, 4, 4, 5]
    assert (layout.max_q, layout.max_k) == (4, 4)


def test_pairs_without_a_prompt_gather_nothing():
    """Prompt 0: A is the chosen answer, B the rejected one, each causal over itself: the keys are the row (no
    gather), and the row is split between the answers (the rejected one does not see the chosen)."""
    layout = varlen_layout(*reversed(roles_of([(0, 2, 1), (0, 1, 2), (0, 0, 3)])))
    assert layout.key_index is None
    assert layout.cu_seq_q.tolist() == layout.cu_seq_k.tolist() == [0, 2, 3, 4, 6, 9]
    assert (layout.max_q, layout.max_k) == (3, 3)
    identical = varlen_layout([0, 3, 5], [PREFIX] * 3 + [PREFIX, CHOSEN])  # both answers empty, then r == 0
    assert identical.key_index is None and identical.cu_seq_q.tolist() == [0, 3, 5]


def test_a_row_of_pairs_with_and_without_a_prompt_gathers_only_the_prompts():
    """Pair 0 (tokens 0, 1): no prompt, A0 = query 0, B0 = query 1, each on itself. Pair 1 (tokens 2-5): prompt 2,
    chosen 1, rejected 1: A1 = queries 2-4 on keys 2-4, B1 = query 5 on keys 2, 3 (the prompt) and 5."""
    layout = varlen_layout(*reversed(roles_of([(0, 1, 1), (2, 1, 1)])))
    assert layout.cu_seq_q.tolist() == [0, 1, 2, 5, 6]
    assert layout.cu_seq_k.tolist() == [0, 1, 2, 5, 8]
    assert layout.key_index.tolist() == [0, 1, 2, 3, 4, 2, 3, 5]


def test_roles_out_of_pair_order_leave_the_row_to_the_segmented_loop():
    assert varlen_layout([0, 3], [PREFIX, REJECTED, CHOSEN]) is None
    assert varlen_layout([0, 2, 4], [PREFIX, CHOSEN, -1, -1]) is None  # padding


def test_the_switch():
    """Half precision on a device that runs flash, no dropout, a head size flash has; a CPU never."""
    q = torch.zeros(1, 4, 6, 16, dtype=torch.bfloat16)
    assert not takes_varlen(q, 0.0)  # a CPU
    with mock.patch("rm.modelling.attention.varlen_available", return_value=True):
        assert takes_varlen(q, 0.0) and takes_varlen(q.half(), 0.0)
        assert not takes_varlen(q.float(), 0.0)
        assert not takes_varlen(q, 0.1)
        assert not takes_varlen(torch.zeros(1, 4, 6, 12, dtype=torch.bfloat16), 0.0)
        assert not takes_varlen(torch.zeros(1, 4, 6, 264, dtype=torch.bfloat16), 0.0)
        # Under autocast (bf16-mixed) RoPE leaves the query in fp32, and SDPA would cast it down: so does varlen.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert takes_varlen(q.float(), 0.0)


def test_under_autocast_the_varlen_call_gets_autocasts_dtype(model):  # noqa: F811
    """bf16-mixed, the GPU default: fp32 weights under autocast. The call is taken, in bf16 (the kernel takes no fp32),
    and the rewards are those of the segmented loop under the same autocast, to bf16's precision."""
    batch = PrefixSharedCollator(packed=True)(FEATURES)
    dtypes = []

    def kernel(q, k, v, *args, **kwargs):
        dtypes.append((q.dtype, k.dtype, v.dtype))
        return varlen_reference(q, k, v, *args, **kwargs)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = rewards_and_grads(model, batch, split=True)
        with mock.patch("rm.modelling.attention.varlen_available", return_value=True), \
                mock.patch("rm.modelling.attention.varlen_attn", kernel):
            got, _ = rewards_and_grads(model, batch, split=True)
    assert dtypes == [(torch.bfloat16,) * 3] * model.config.num_hidden_layers
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-2)


def test_a_cpu_row_carries_no_layout():
    """On the CPU the inputs are today's: no layout is built (nor copied), the segmented loop runs as before."""
    from rm.modelling.attention import segmented_inputs

    for collator in (PackedPairCollator(), PrefixSharedCollator(packed=True)):
        batch = collator(FEATURES)
        inputs = segmented_inputs(batch["input_ids"], batch["position_ids"], batch.get("pair_ids"), batch.get("roles"))
        assert inputs["packed_row"].varlen is None
        with mock.patch("rm.modelling.attention.varlen_available", return_value=True):
            inputs = segmented_inputs(batch["input_ids"], batch["position_ids"], batch.get("pair_ids"),
                                      batch.get("roles"))
        assert inputs["packed_row"].varlen.cu_seq_q[-1] == batch["input_ids"].shape[1]


# ---------------------------------------------------------------- the oracle: reference kernel against segmented SDPA

def _qkv(length, seed=0):
    """Random fp32 query (4 heads) and key, value (2 heads, grouped-query), head size 16, with gradients."""
    torch.manual_seed(seed)
    return [torch.randn(1, heads, length, 16, requires_grad=True) for heads in (4, 2, 2)]


def _module():
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    return module


def _output_and_grads(attention, q, k, v):
    for t in (q, k, v):
        t.grad = None
    out, _ = attention(q, k, v)
    weights = torch.linspace(-1, 2, out.numel()).reshape(out.shape)  # every output weighs differently
    (out * weights).sum().backward()
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


def _assert_same(got, expected):
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)
    for name, g, e in zip("qkv", got[1], expected[1]):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5, msg=f"d{name}")


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window-3"])
def test_plain_packing_equals_the_segmented_loop(window):
    """Segments of 5, 1, 7 and 9 tokens; with a window of 3, shorter than three of them."""
    bounds = [0, 5, 6, 13, 22]
    q, k, v = _qkv(bounds[-1])
    extra = {"sliding_window": window} if window else {}
    kwargs = dict(scaling=0.3, **extra)
    expected = _output_and_grads(lambda *t: segmented_sdpa(_module(), *t, None, packed_row=PackedRow(bounds), **kwargs),
                                 q, k, v)
    row = PackedRow(bounds, varlen=varlen_layout(bounds))
    with varlen_on_cpu(calls := []):
        got = _output_and_grads(lambda *t: segmented_sdpa(_module(), *t, None, packed_row=row, **kwargs), q, k, v)
    assert calls == [4]  # one call, four sequences
    _assert_same(got, expected)
    if window:  # the window bound: without it, other outputs
        unwindowed = _output_and_grads(lambda *t: segmented_sdpa(_module(), *t, None, packed_row=PackedRow(bounds),
                                                                 scaling=0.3), q, k, v)
        assert not torch.allclose(unwindowed[0], got[0], atol=1e-3)


# (prompt, chosen, rejected) lengths: every case of a pair, p == 0 included.
SHARED = [(4, 2, 3), (0, 3, 2), (5, 0, 3), (3, 2, 0), (2, 0, 0), (1, 1, 1), (6, 3, 4)]


def test_prefix_shared_pairs_equal_the_segmented_loop():
    roles, bounds = roles_of(SHARED)
    masks = [pair_mask(roles[s:e], "cpu") for s, e in zip(bounds[:-1], bounds[1:])]
    q, k, v = _qkv(bounds[-1], seed=1)
    expected = _output_and_grads(
        lambda *t: segmented_sdpa(_module(), *t, None, packed_row=PackedRow(bounds, causal=False, masks=masks)), q, k, v)
    layout = varlen_layout(bounds, roles)
    assert layout.key_index is not None
    row = PackedRow(bounds, causal=False, masks=masks, varlen=layout)
    with varlen_on_cpu(calls := []):
        got = _output_and_grads(lambda *t: segmented_sdpa(_module(), *t, None, packed_row=row), q, k, v)
    assert calls == [12]  # 7 pairs, 2 sequences each, less the 2 without a rejected answer
    _assert_same(got, expected)


def test_prefix_shared_pairs_keep_the_window_of_their_unshared_sequences():
    """With Mistral's window, each token must see what it sees in its own unshared sequence (prompt + its answer,
    windowed there), on both paths. The oracle is the segmented loop on the unshared sequences (plain causal windows),
    gathered from the same q, k, v, read back at the shared row's tokens."""
    window = 3
    roles, bounds = roles_of(SHARED)
    index, row_of, sequence_bounds = [], [], [0]
    for (p, c, r), start in zip(SHARED, bounds):
        chosen = list(range(start, start + p + c))
        rejected = list(range(start, start + p)) + list(range(start + p + c, start + p + c + r))
        row_of += [len(index) + i for i in range(p + c)] + [len(index) + len(chosen) + p + j for j in range(r)]
        index += chosen + rejected
        sequence_bounds += [sequence_bounds[-1] + len(chosen), sequence_bounds[-1] + len(chosen) + len(rejected)]
    sequence_bounds = sorted(set(sequence_bounds))  # an empty chosen sequence (p + c == 0) adds no segment

    def unshared(q, k, v):
        gathered = [t[:, :, index] for t in (q, k, v)]
        out, _ = segmented_sdpa(_module(), *gathered, None, packed_row=PackedRow(sequence_bounds),
                                sliding_window=window)
        return out[:, row_of], None

    q, k, v = _qkv(bounds[-1], seed=2)
    expected = _output_and_grads(unshared, q, k, v)
    with varlen_on_cpu():
        row = PackedRow(bounds, causal=False, varlen=varlen_layout(bounds, roles))
        got = _output_and_grads(lambda *t: segmented_sdpa(_module(), *t, None, packed_row=row, sliding_window=window),
                                q, k, v)
    _assert_same(got, expected)
    # The loop: each pair's mask, windowed by the collator's (unshared) positions
    positions = torch.tensor([i for p, c, r in SHARED for i in [*range(p + c), *range(p, p + r)]])
    masks = [pair_mask(roles[s:e], "cpu") for s, e in zip(bounds[:-1], bounds[1:])]
    row = PackedRow(bounds, causal=False, masks=masks, positions=positions)
    looped = _output_and_grads(lambda *t: segmented_sdpa(_module(), *t, None, packed_row=row, sliding_window=window),
                               q, k, v)
    _assert_same(looped, expected)
    unwindowed = _output_and_grads(lambda *t: segmented_sdpa(_module(), *t, None, packed_row=row), q, k, v)
    assert not torch.allclose(unwindowed[0], expected[0], atol=1e-3)  # the window binds on these pairs


# ---------------------------------------------------------------- through the model

@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
@pytest.mark.parametrize("collator", [PackedPairCollator(), PrefixSharedCollator(packed=True)],
                         ids=["packed", "packed+shared"])
def test_one_kernel_call_a_layer_gives_the_segmented_rewards_and_gradients(model, collator, checkpointing):  # noqa: F811
    """The tiny model (4 query heads on 2 key-value heads) through transformers: the layout travels as a model
    input to every layer, one call a layer (and one more a layer in checkpointing's recomputation)."""
    batch = collator(FEATURES)
    expected, expected_grads = rewards_and_grads(model, batch, split=True)
    was_training = model.training
    if checkpointing:
        from rm.modelling.model import enable_activation_checkpointing

        enable_activation_checkpointing(model)
        model.train()  # transformers recomputes only in training mode
    try:
        with varlen_on_cpu(calls := []):
            got, grads = rewards_and_grads(model, batch, split=True)
    finally:
        if checkpointing:
            (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
            model.train(was_training)
    layers = model.config.num_hidden_layers
    assert len(calls) == layers * (2 if checkpointing else 1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
