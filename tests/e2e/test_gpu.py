"""Every CUDA code path once, on a real GPU: skipped without one (the ``gpu`` marker, tests/conftest.py).

    python -m pytest -m gpu tests/e2e/test_gpu.py        # on a CUDA machine; about a minute on one H100

Each test is a short real run of the tiny model through ``rm.train.train`` with ``hardware=auto``, so the
device, the precision default and the optimizer are the ones a GPU user gets. What the CPU suite cannot
reach: bf16 autocast and fp16 loss scaling on CUDA, bitsandbytes' paged 8-bit AdamW and 4-bit matmuls,
DeepSpeed's CPU Adam beside a GPU, sdpa's and flex-attention's CUDA kernels under a prefix-shared mask,
and the allocator's own counts in ``memory.json``. The varlen flash path of packed rows has its own file,
``tests/e2e/test_gpu_varlen.py`` (the ``varlen`` stage of scripts/gpu_session.sh).
"""

import json
import logging
import math
import os

import pytest
import torch
from accelerate.utils import set_seed

import rm.train as rm_train
from rm.foundations.config import to_run_config
from tests.conftest import FAST_TINY, compose_run
from tests.modelling.test_prefix_sharing import FEATURES, PAIRS

pytestmark = pytest.mark.gpu

GPU_TINY = [o for o in FAST_TINY if not o.startswith("hardware=")] + [
    "hardware=auto", "train.precision=auto", "model.tokenizer=words", "train.max_steps=4", "train.logging.eval_steps=0",
    "train.logging.track_memory=true",
]


def run(tmp_path, *overrides, name="run", caplog=None):
    """Train the tiny model on the GPU; return the result, memory.json, the run's log lines and its directory."""
    from accelerate.state import AcceleratorState

    if caplog is not None:
        caplog.set_level(logging.INFO, logger="rm")

    AcceleratorState._reset_state(reset_partial_state=True)  # each run picks its own mixed precision
    cfg = to_run_config(compose_run(GPU_TINY + list(overrides)))
    run_dir = tmp_path / name
    environ = dict(os.environ)
    try:
        result = rm_train.train(cfg, run_dir)
    finally:
        # DeepSpeed's one-process rendezvous (RANK, WORLD_SIZE, ...) and its process group would make the next
        # run in this process wait for peers: each user run is its own process, so undo both.
        os.environ.clear()
        os.environ.update(environ)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    memory = json.loads((run_dir / "memory.json").read_text())
    return result, memory, caplog.text if caplog is not None else "", run_dir


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["event"] == "train"]


def assert_trained_on_cuda(result, memory, run_dir):
    assert result["status"] == "ok", result
    assert (run_dir / "final").is_dir()
    measured = memory["measured"]
    assert measured["method"].startswith("torch.cuda"), measured
    # The allocator saw the run: more than the weights, and the device's own count holds the allocator's reserve.
    assert measured["peak_allocated_bytes"] > memory["estimate"]["weights"]
    assert measured["device_used_bytes"] >= measured["peak_reserved_bytes"] >= measured["peak_allocated_bytes"]
    assert all(math.isfinite(loss) for loss in losses(run_dir))


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """The tiny model's random init saved as a pretrained directory: what memory_profile=qlora quantises."""
    from rm.modelling.model import build_model
    from rm.data.tokenizer import build_tokenizer

    cfg = to_run_config(compose_run(GPU_TINY))
    tokenizer = build_tokenizer(cfg.model)
    set_seed(0)
    path = tmp_path_factory.mktemp("tiny_pretrained")
    build_model(cfg.model, tokenizer.pad_token_id, "float32", gradient_checkpointing=False).save_pretrained(path)
    tokenizer.save_pretrained(path)  # a pretrained directory brings its tokenizer (model.tokenizer=null reads it)
    return path


@pytest.mark.parametrize("profile", ["full", "lora", "8bit", "offload", "qlora"])
def test_every_memory_profile_trains_on_cuda(tmp_path, profile, saved_tiny, caplog):
    extra = [f"model.pretrained={saved_tiny}", "model.tokenizer=null"] if profile == "qlora" else []
    result, memory, log, run_dir = run(tmp_path, f"memory_profile={profile}", *extra, caplog=caplog)
    assert_trained_on_cuda(result, memory, run_dir)
    if profile == "8bit":
        assert "PagedAdamW8bit" in log  # paged on CUDA: state pages can spill to host RAM
    if profile == "qlora":
        assert "frozen base 4-bit NF4" in log, log[-2000:]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-mixed", "32-true"])
def test_every_precision_trains_on_cuda(tmp_path, precision):
    result, memory, log, run_dir = run(tmp_path, f"train.precision={precision}")
    assert_trained_on_cuda(result, memory, run_dir)
    assert memory["estimate"]["precision"] == precision


def test_bf16_mixed_is_the_default_on_a_bf16_gpu(tmp_path):
    result, memory, _, run_dir = run(tmp_path)
    assert_trained_on_cuda(result, memory, run_dir)
    assert memory["estimate"]["precision"] == "bf16-mixed"
    assert memory["estimate"]["numerics"]["weights"] == "float32"


# Mistral's default window (4096) binds on no pair here; 5 binds on most (the windowed flex block mask runs only here:
# inductor's CPU code for it does not compile, tests/modelling/test_prefix_sharing.py)
SHARED_CASES = [*((attn, packed, 4096) for attn in ("sdpa", "flex_attention") for packed in (True, False)),
                ("sdpa", True, 5), ("sdpa", False, 5), ("flex_attention", True, 5)]


@pytest.mark.parametrize("attn, packed, window", SHARED_CASES,
                         ids=[f"{a}-{'packed' if p else 'row-per-pair'}-window-{w}" for a, p, w in SHARED_CASES])
def test_prefix_shared_rewards_equal_unshared_on_cuda(tiny_cfg, attn, packed, window):
    """The CUDA kernels under the prefix-shared mask give the unshared rewards (fp32, every case)."""
    from rm.data.collator import PairCollator, PrefixSharedCollator
    from rm.modelling.model import build_model, pair_rewards

    cfg = tiny_cfg(f"model.attn_implementation={attn}")
    set_seed(0)
    model = build_model(cfg.model, pad_token_id=0, dtype="float32", gradient_checkpointing=False).cuda().eval()
    model.config.sliding_window = window
    cuda = lambda batch: {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}  # noqa: E731
    plain, rows = cuda(PairCollator(pad_token_id=0)(FEATURES)), cuda(PrefixSharedCollator(packed=packed, pad_token_id=0)(FEATURES))
    with torch.no_grad():
        want = pair_rewards(model, plain["input_ids"], plain["attention_mask"])
        got = pair_rewards(model, rows["input_ids"], position_ids=rows["position_ids"], ends=rows["ends"],
                           pair_ids=rows["pair_ids"], roles=rows["roles"])
    for name, w, g in zip(PAIRS, zip(*want), zip(*got)):
        torch.testing.assert_close(torch.stack(g).cpu(), torch.stack(w).cpu(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("packing", [False, True], ids=["row-per-pair", "packed"])
def test_prefix_shared_training_on_cuda(tmp_path, attn, packing):
    result, memory, _, run_dir = run(tmp_path, "train.share_prefix=true", f"model.attn_implementation={attn}",
                                     f"train.packing={str(packing).lower()}")
    assert_trained_on_cuda(result, memory, run_dir)


@pytest.mark.parametrize("profile", ["full", "lora"])
def test_compiled_training_stays_within_the_estimate_on_cuda(tmp_path, profile):
    """``train.compile``: the estimate traces the eager model; on the GPUs measured it was within 0.5% of the eager
    runs' allocated peak (docs/gpu.md), and a compiled layer keeps less for backward (tests/modelling/test_compile.py),
    so the compiled run's peak stays at or under it, within that calibration's 5%."""
    result, memory, _, run_dir = run(tmp_path, f"memory_profile={profile}", "train.compile=true", "train.packing=true",
                                     "train.share_prefix=true")
    assert_trained_on_cuda(result, memory, run_dir)
    assert memory["measured"]["peak_allocated_bytes"] <= 1.05 * memory["estimate"]["allocated_bytes"], memory


def test_packing_on_cuda(tmp_path):
    result, memory, _, run_dir = run(tmp_path, "train.packing=true", "train.max_tokens_per_micro_batch=256")
    assert_trained_on_cuda(result, memory, run_dir)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ddp", "zero2"])
def test_two_processes_over_nccl(tmp_path, layout):
    """DDP and ZeRO-2 over NCCL, one GPU per process, through the launcher users run."""
    import subprocess

    if torch.cuda.device_count() < 2:
        pytest.skip(f"{torch.cuda.device_count()} GPU here: NCCL needs one GPU per process")
    overrides = [o for o in GPU_TINY if not o.startswith("train.logging.track_memory")]
    env = {**os.environ, "RUN_DIR": str(tmp_path / layout)}
    proc = subprocess.run(["bash", "train_rm_distributed.sh", "synthetic", "2", *overrides, f"distributed={layout}"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / layout / "final").is_dir()


@pytest.mark.parametrize("layout", ["padded", "shared"])
def test_masked_rows_keep_off_cudnn_on_cuda_with_checkpointing(layout):
    """A padded batch's and a prefix-shared row-per-pair batch's masked SDPA calls, in bf16 as training runs them,
    never through cuDNN's kernel (a graph build for each new length): checkpointing's recomputation in the backward
    included, which must take the same kernel as the forward (rm.modelling.attention.sdpa_kernels)."""
    from rm.data.collator import PairCollator, PrefixSharedCollator
    from rm.modelling.model import build_model, enable_activation_checkpointing, pair_rewards
    from tests.modelling.test_attention import FEATURES as SEGMENTED, counted_sdpa_calls

    cfg = to_run_config(compose_run(GPU_TINY + ["model.attn_implementation=sdpa"]))
    set_seed(0)
    model = build_model(cfg.model, pad_token_id=0, dtype="bfloat16", gradient_checkpointing=False).cuda()
    enable_activation_checkpointing(model)
    model.train()
    collator = PairCollator(pad_token_id=0) if layout == "padded" else PrefixSharedCollator(packed=False)
    batch = collator(SEGMENTED)
    inputs = {k: batch[k].cuda() for k in ("input_ids", "attention_mask", "position_ids", "ends", "pair_ids", "roles")
              if k in batch}
    with counted_sdpa_calls() as calls:
        chosen, rejected = pair_rewards(model, **inputs)
        (chosen - rejected).float().sum().backward()
    layers = model.config.num_hidden_layers
    assert len(calls) == 2 * layers  # the forward's, then the backward's recomputation
    assert not any(cudnn for _, cudnn in calls)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("packed_kind", ["packed", "packed+shared"])
def test_packed_rows_take_one_sdpa_call_per_segment_on_cuda(packed_kind):
    """On a GPU too, a packed row's SDPA runs a segment at a time (the flash kernel for a plain sequence), with the
    rewards and gradients of the whole-row masked call (fp32), and never through cuDNN's kernel, which builds a
    graph for each new length (rm.modelling.attention.sdpa_kernels)."""
    from rm.data.collator import PackedPairCollator, PrefixSharedCollator
    from rm.modelling.model import build_model
    from tests.modelling.test_attention import FEATURES as SEGMENTED, counted_sdpa_calls, rewards_and_grads

    cfg = to_run_config(compose_run(GPU_TINY + ["model.attn_implementation=sdpa"]))
    set_seed(0)
    model = build_model(cfg.model, pad_token_id=0, dtype="float32", gradient_checkpointing=False).cuda()
    collator = PackedPairCollator() if packed_kind == "packed" else PrefixSharedCollator(packed=True)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in collator(SEGMENTED).items()}
    expected, expected_grads = rewards_and_grads(model, batch, split=False)
    with counted_sdpa_calls() as calls:
        got, grads = rewards_and_grads(model, batch, split=True)
    layers = model.config.num_hidden_layers
    assert len(calls) > layers and sum(length for length, _ in calls) == batch["input_ids"].shape[1] * layers
    assert not any(cudnn for _, cudnn in calls)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", ["packed", "packed+shared"])
def test_compiled_layers_keep_one_varlen_call_a_layer(layout):
    """``train.compile``: the compiled layers hand a packed row to the eager attention, which still makes one varlen
    call a layer, and the rewards and gradients stay the padded batch's."""
    from rm.data.collator import PackedPairCollator, PairCollator, PrefixSharedCollator
    from rm.modelling.model import compile_decoder_layers
    from tests.e2e.test_gpu_varlen import FEATURES, assert_close_in_bf16, counted_varlen_calls, prepared, rewards_and_grads

    collator = PackedPairCollator() if layout == "packed" else PrefixSharedCollator(packed=True)
    model = prepared("mistral-window", "bf16")
    expected = rewards_and_grads(model, PairCollator(pad_token_id=0)(FEATURES))
    compile_decoder_layers(model)
    with counted_varlen_calls() as calls:
        got = rewards_and_grads(model, collator(FEATURES))
    assert len(calls) == model.config.num_hidden_layers, calls
    assert_close_in_bf16(got, expected)

