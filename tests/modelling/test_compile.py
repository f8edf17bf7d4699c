"""``train.compile`` (rm.modelling.model.compile_decoder_layers): what a compiled layer computes, what it keeps for
backward, and that a new packing does not recompile it. Compiled on the CPU through inductor (a C++ compiler);
the first compile of the module takes about 40 s, the rest reuse its graphs (one model shape throughout).

Speed is measured by ``benchmarks/bench_vs_trl.py`` (its compiled rows), not here.
"""

import copy
import random
import shutil

import pytest
import torch
from accelerate.utils import set_seed

from rm.data.collator import PackedPairCollator, PairCollator, PrefixSharedCollator
from rm.foundations.config import to_run_config
from rm.modelling.model import apply_memory_profile, build_model, compile_decoder_layers, pair_rewards
from rm.settings.validate import ConfigError, validate
from tests.conftest import FAST_TINY, compose_run
from tests.modelling.test_attention import FEATURES

pytestmark = pytest.mark.skipif(not shutil.which("g++"), reason="inductor compiles its CPU kernels with a C++ compiler")

COLLATORS = {"padded": PairCollator(pad_token_id=0), "packed": PackedPairCollator(), "packed+shared": PrefixSharedCollator(packed=True),
             "shared rows": PrefixSharedCollator()}


def _models(profile: str):
    cfg = to_run_config(compose_run(FAST_TINY + [f"memory_profile={profile}"]))
    set_seed(0)
    eager = apply_memory_profile(build_model(cfg.model, pad_token_id=0, dtype="float32", gradient_checkpointing=False),
                                 cfg.memory_profile, cfg.lora)
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled) == cfg.model.num_hidden_layers
    return eager, compiled


@pytest.fixture(scope="module")
def full():
    return _models("full")


@pytest.fixture(scope="module")
def lora():
    return _models("lora")


def _inputs(batch):
    keys = ("input_ids", "attention_mask", "position_ids", "ends", "pair_ids", "roles")
    return {k: batch[k] for k in keys if k in batch}


def rewards_grads_saved(model, batch):
    """Rewards, the gradients of a loss that weighs each reward differently, and the bytes of the distinct storages
    autograd keeps for backward (what the activations term of the memory estimate sizes)."""
    model.zero_grad(set_to_none=True)
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chosen, rejected = pair_rewards(model, **_inputs(batch))
    rewards = torch.cat([chosen, rejected])
    (rewards * torch.linspace(-1, 2, rewards.numel())).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return rewards.detach(), grads, sum(kept.values())


@pytest.mark.parametrize("layout", list(COLLATORS))
def test_compiled_layers_give_the_eager_rewards_and_gradients(full, layout):
    eager, compiled = full
    batch = COLLATORS[layout](FEATURES)
    expected, expected_grads, _ = rewards_grads_saved(eager, batch)
    got, grads, _ = rewards_grads_saved(compiled, batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():  # fused kernels round differently: fp32, a few ulps
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("profile", ["full", pytest.param("lora", marks=pytest.mark.slow)])  # LoRA: 2 more compiles, 2.5 min
@pytest.mark.parametrize("layout", ["padded", "packed+shared"])
def test_a_compiled_model_keeps_no_more_for_backward_than_the_eager_one_the_estimate_traces(profile, layout, request):
    """The memory estimate traces the eager model (rm.memory.trace): it bounds a compiled run only while compiling
    keeps no more for backward (inductor's partitioner recomputes cheap elementwise results instead of saving them)."""
    eager, compiled = request.getfixturevalue(profile)
    batch = COLLATORS[layout](FEATURES)
    *_, eager_bytes = rewards_grads_saved(eager, batch)
    *_, compiled_bytes = rewards_grads_saved(compiled, batch)
    assert 0 < compiled_bytes <= eager_bytes


@pytest.mark.parametrize("layout", ["packed", "packed+shared"])
def test_compiled_layers_hand_a_packed_row_to_one_varlen_call_a_layer(full, layout):
    """On a GPU a packed row's attention is one varlen call a layer (rm.modelling.attention); here the CPU reference
    kernel of tests/modelling/test_varlen.py stands in for it, inside the compiled layers."""
    from tests.modelling.test_varlen import varlen_on_cpu

    eager, compiled = full
    batch = COLLATORS[layout](FEATURES)
    expected, expected_grads, _ = rewards_grads_saved(eager, batch)
    with varlen_on_cpu(calls := []):
        got, grads, _ = rewards_grads_saved(compiled, batch)
    assert len(calls) == compiled.config.num_hidden_layers
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_new_packing_reuses_the_compiled_graphs(full):
    """The row's segments reach the (eager) attention in one object that dynamo passes through unread
    (rm.modelling.attention.PackedRow): with them as lists, each new number of segments recompiled every layer."""
    from torch._dynamo.utils import counters

    _, compiled = full
    rng = random.Random(0)

    def packing(pairs: int):
        features = [{"chosen_input_ids": [rng.randrange(4, 500) for _ in range(rng.randrange(2, 20))],
                     "rejected_input_ids": [rng.randrange(4, 500) for _ in range(rng.randrange(2, 20))]}
                    for _ in range(pairs)]
        return PrefixSharedCollator(packed=True)(features)

    for pairs in (3, 5):  # warm: the first lengths, then any length
        rewards_grads_saved(compiled, packing(pairs))
    graphs = counters["stats"]["unique_graphs"]
    for pairs in (2, 4, 6, 7):
        rewards_grads_saved(compiled, packing(pairs))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.reliability("Configuration", "`train.compile=true` with what it was never measured with: attention other "
                         "than sdpa, `memory_profile=qlora` (bitsandbytes layers), DeepSpeed (`offload`), the CPU's "
                         "tensor count (`train.logging.track_memory=true`)",
                         "refused before anything loads, naming both keys and why; exit 2")
@pytest.mark.parametrize("overrides, named", [
    (["model.attn_implementation=eager"], "model.attn_implementation=eager"),
    (["memory_profile=qlora"], "memory_profile=qlora"),
    (["memory_profile=offload"], "distributed.strategy=deepspeed"),
    (["train.logging.track_memory=true"], "train.logging.track_memory=true"),
])
def test_compile_is_refused_where_it_was_never_measured(overrides, named):
    cfg = to_run_config(compose_run(FAST_TINY + ["train.compile=true", *overrides]))
    with pytest.raises(ConfigError) as refused:
        validate(cfg, world_size=1)
    assert "train.compile=true" in str(refused.value) and named in str(refused.value)
    validate(to_run_config(compose_run(FAST_TINY + ["train.compile=true"])), world_size=1)  # alone, it is valid
