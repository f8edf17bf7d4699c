"""Each memory profile trains the right parameters and saves a model that gives back its rewards."""

import json
import subprocess
import sys

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import rm.train as rm_train
from rm.modelling.bundle import bundle_tokenizer
from rm.data.build import build_split
from rm.data.collator import PairCollator
from rm.modelling.loss import bradley_terry_loss
from rm.data.build import train_pairs
from rm.data.tokenizer import run_tokenizer
from rm.modelling.model import build_model, pair_rewards
from tests.conftest import CONF_DIR, FAST_TINY

STEPS = ["train.max_steps=30", "train.checkpoint.save_steps=15", "train.logging.eval_steps=0", "train.logging.logging_steps=5"]


def eval_loss_of(model, tokenizer, data_cfg):
    eval_set, _ = build_split(data_cfg, tokenizer, "eval")
    batch = PairCollator(tokenizer.pad_token_id)(eval_set)
    with torch.no_grad():
        chosen, rejected = pair_rewards(model.eval(), batch["input_ids"], batch["attention_mask"])
    return bradley_terry_loss(chosen, rejected).item()


def losses(run_dir):
    return [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in l]


def initial_weights(cfg):
    tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data))
    set_seed(cfg.train.seed)  # train() seeds the same way before building: the same initial weights
    return build_model(cfg.model, tokenizer.pad_token_id, "float32", False).state_dict()


@pytest.mark.parametrize("profile", ["full", "8bit"])
def test_all_weights_train_and_reload(tiny_cfg, tmp_path, profile):
    if profile == "8bit":
        pytest.importorskip("bitsandbytes")
    cfg = tiny_cfg(f"memory_profile={profile}", *STEPS)
    result = rm_train.train(cfg, tmp_path)
    assert result["status"] == "ok"
    trace = losses(tmp_path)
    assert trace[-1] < trace[0], trace
    initial = initial_weights(cfg)
    final = load_file(tmp_path / "final" / "model.safetensors")
    assert all(not torch.equal(v, initial[k]) for k, v in final.items())
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final")
    tokenizer, _ = bundle_tokenizer(tmp_path / "final")  # as trained (the top-level one adds the EOS itself)
    assert eval_loss_of(model, tokenizer, cfg.data) == pytest.approx(result["eval_loss"], rel=1e-5)


def test_lora_trains_adapters_and_head_and_reloads_as_adapter_and_merged(tiny_cfg, tmp_path):
    from peft import PeftModel

    cfg = tiny_cfg("memory_profile=lora", "lora=r8", "lora.merge_on_save=true", "train.optim.learning_rate=5e-3", *STEPS)
    result = rm_train.train(cfg, tmp_path)
    trace = losses(tmp_path)
    assert trace[-1] < trace[0], trace

    base = initial_weights(cfg)
    saved = load_file(tmp_path / "checkpoints" / "checkpoint-15" / "model.safetensors")
    plain = {k: k.replace("base_model.model.", "").replace(".base_layer", "") for k in saved}
    frozen = [k for k in saved if "lora_" not in k and "score" not in k and plain[k] in base]
    assert len(frozen) >= 20 and all(torch.equal(saved[k], base[plain[k]]) for k in frozen)
    assert all(saved[k].abs().sum() > 0 for k in saved if "lora_B" in k)  # peft starts lora_B at zero
    head = [k for k in saved if "score" in k and "modules_to_save" in k]
    assert head and not torch.equal(saved[head[0]], base["score.weight"])

    tokenizer, _ = bundle_tokenizer(tmp_path / "final")
    set_seed(cfg.train.seed)
    fresh = build_model(cfg.model, tokenizer.pad_token_id, "float32", False)
    adapter = PeftModel.from_pretrained(fresh, tmp_path / "final")
    assert eval_loss_of(adapter, tokenizer, cfg.data) == pytest.approx(result["eval_loss"], rel=1e-5)
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final" / "merged")
    assert eval_loss_of(merged, tokenizer, cfg.data) == pytest.approx(result["eval_loss"], rel=1e-4)
    # final/README.md is rm's model card, not PEFT's empty template ("More Information Needed" in every field)
    card = (tmp_path / "final" / "README.md").read_text()
    assert "More Information Needed" not in card
    assert "| base model | random init of the tiny shape" in card and "| memory profile | lora |" in card
    assert f"{result['eval_accuracy']:.4f} pairwise accuracy on {result['eval_pairs']} held-out pairs" in card
    assert "LoRA adapter" in card and "merged/" in card and "from_pretrained" in card


def run_cli(args, tmp_path, nproc=1, timeout=900):
    """Run training in a fresh process (DeepSpeed keeps a process group for the life of a process)."""
    overrides = [*FAST_TINY, *args, f"hydra.run.dir={tmp_path}"]
    if nproc == 1:
        cmd = [sys.executable, "-m", "rm.train", *overrides]
    else:
        cmd = ["bash", "train_rm_distributed.sh", "synthetic", str(nproc), *overrides]
    proc = subprocess.run(cmd, cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "RUN_DIR": str(tmp_path), "MASTER_PORT": "29517"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()], proc


def reload_eval_loss(tmp_path, cfg):
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final")
    tokenizer, _ = bundle_tokenizer(tmp_path / "final")
    return eval_loss_of(model, tokenizer, cfg.data)


@pytest.mark.slow
def test_offload_profile_trains_on_deepspeed_cpu_adam(tiny_cfg, tmp_path):
    pytest.importorskip("deepspeed")
    events, proc = run_cli(["memory_profile=offload", "train.logging.track_memory=true", *STEPS], tmp_path)
    assert "DeepSpeedCPUAdam under DeepSpeed ZeRO-2, optimizer states on CPU" in proc.stdout + proc.stderr
    trace = [e["loss"] for e in events if e["event"] == "train"]
    assert trace[-1] < trace[0], trace
    final_eval = [e for e in events if e["event"] == "eval"][-1]
    assert reload_eval_loss(tmp_path, tiny_cfg()) == pytest.approx(final_eval["eval_loss"], rel=1e-5)
    memory = json.loads((tmp_path / "memory.json").read_text())
    # Counted live tensor bytes: the tiny model's states and buckets, not 2 GB default buckets.
    assert memory["measured"]["peak_allocated_bytes"] < 100 * 2**20
    # ZeRO-Offload's host buffers are modelled: within 1% (measured -0.001%).
    assert memory["estimate"]["peak_bytes"] == pytest.approx(memory["measured"]["peak_allocated_bytes"], rel=0.01)
    ds = json.loads((tmp_path / "deepspeed_config.json").read_text())
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and ds["train_batch_size"] == 16


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_zero2_matches_one_process(tiny_cfg, tmp_path):
    """Same pairs per step (rm's batching is a function of seed and step), so the same trajectory.

    Tolerance: 1e-4 relative on the final eval loss after 10 steps, for the different order of
    floating-point sums (all-reduce over 2 ranks vs accumulation over 2 micro-batches).
    """
    pytest.importorskip("deepspeed")
    steps = ["train.max_steps=10", "train.logging.eval_steps=0", "train.logging.logging_steps=5"]
    one, _ = run_cli(steps, tmp_path / "one")
    two, proc = run_cli(["distributed=zero2", *steps], tmp_path / "two", nproc=2)
    assert "DeepSpeed ZeRO-2, 2 process(es)" in proc.stdout + proc.stderr
    assert "8 pairs/micro-batch x 1 accumulation x 2 processes = 16 pairs/step" in proc.stdout + proc.stderr
    a = [e for e in one if e["event"] == "eval"][-1]
    b = [e for e in two if e["event"] == "eval"][-1]
    assert a["eval_pairs"] == b["eval_pairs"] == 128
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-4)
    assert [e["step"] for e in two if e["event"] == "train"] == [5, 10]  # rank 0 alone writes metrics


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_ddp_matches_one_process_and_its_schedule(tiny_cfg, tmp_path):
    """DDP through accelerate: the same trajectory as one process, and the learning-rate schedule
    advances once per optimizer step (accelerate's prepared scheduler would step once per process)."""
    steps = ["train.max_steps=10", "train.logging.eval_steps=0", "train.logging.logging_steps=1", "train.optim.warmup_ratio=0.3"]
    one, _ = run_cli(steps, tmp_path / "one")
    two, proc = run_cli(["distributed=ddp", *steps], tmp_path / "two", nproc=2)
    assert "DDP, 2 process(es)" in proc.stdout + proc.stderr
    lr_one = [e["lr"] for e in one if e["event"] == "train"]
    lr_two = [e["lr"] for e in two if e["event"] == "train"]
    assert len(lr_one) == 10 and lr_two == pytest.approx(lr_one, rel=1e-9)
    a = [e for e in one if e["event"] == "eval"][-1]
    b = [e for e in two if e["event"] == "eval"][-1]
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_zero3_offload_saves_a_loadable_model(tiny_cfg, tmp_path):
    pytest.importorskip("deepspeed")
    events, proc = run_cli(
        ["memory_profile=offload", "distributed=zero3_offload", "train.max_steps=6", "train.logging.eval_steps=0"], tmp_path, nproc=2
    )
    final_eval = [e for e in events if e["event"] == "eval"][-1]
    # The saved weights are the gathered ZeRO-3 shards: the full model, giving the run's own rewards.
    assert reload_eval_loss(tmp_path, tiny_cfg()) == pytest.approx(final_eval["eval_loss"], rel=1e-5)
    # rm.modelling.bundle checked it inside the run: both ranks scored the probe, rank 0 reloaded and compared.
    # (verified in the temporary directory that then became final/: a partial final/ never exists)
    assert f"export verified: {tmp_path / '.tmp-final'} reloads" in proc.stdout + proc.stderr
    from rm.modelling.bundle import verify_bundle

    assert verify_bundle(tmp_path / "final") <= 1e-6


@pytest.mark.slow
def test_measured_peaks_follow_what_each_profile_keeps(tiny_cfg, tmp_path):
    """Live tensor bytes: full keeps fp32 weights + grads + two AdamW states (16 bytes/param), 8-bit
    AdamW about 10, LoRA about 4 plus its small adapters. One pair of 32 tokens keeps activations
    (which LoRA makes larger: dropout masks and low-rank intermediates) below the states."""
    pytest.importorskip("bitsandbytes")
    peaks = {}
    for profile in ["full", "8bit", "lora"]:
        cfg = tiny_cfg(f"memory_profile={profile}", "train.max_steps=3", "train.logging.eval_steps=0", "train.logging.track_memory=true",
                       "data.max_length=32", "train.micro_batch_size=1", "train.global_batch_size=2", "train.eval_batch_size=1")
        rm_train.train(cfg, tmp_path / profile)
        measured = json.loads((tmp_path / profile / "memory.json").read_text())["measured"]
        peaks[profile] = measured["peak_allocated_bytes"]
    params = 361_216  # the tiny model (tests/foundations/test_config.py derives the 7B count the same way)
    assert peaks["full"] >= 16 * params
    assert peaks["full"] > peaks["8bit"] > peaks["lora"]
    assert peaks["full"] - peaks["8bit"] >= 5 * params  # 8 bytes of fp32 states became about 2 (+ block scales)


def test_qlora_base_from_a_shape_is_saved_once_and_loaded_in_4bit(tiny_cfg, tmp_path, monkeypatch):
    """memory_profile=qlora without pretrained weights: the shape's random init is saved (keyed by shape and seed)
    and loaded through bitsandbytes' quantising path on the CPU; the same seed loads the same packed weights, and the
    run's own random draws are as if nothing had been drawn."""
    bnb = pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("RM_CACHE", str(tmp_path))
    cfg = tiny_cfg("memory_profile=qlora")

    def built():
        set_seed(cfg.train.seed)
        model = build_model(cfg.model, 0, "float32", False, "nf4")
        return model, torch.rand(3)

    (first, after_first), (second, after_second) = built(), built()
    set_seed(cfg.train.seed)
    assert torch.equal(after_first, torch.rand(3)) and torch.equal(after_first, after_second)
    q_proj = first.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, bnb.nn.Linear4bit) and q_proj.weight.dtype == torch.uint8
    assert torch.equal(q_proj.weight, second.model.layers[0].self_attn.q_proj.weight)
    assert len([p for p in (tmp_path / "random_init").iterdir() if p.is_dir()]) == 1  # saved once
    set_seed(cfg.train.seed + 1)
    build_model(cfg.model, 0, "float32", False, "nf4")
    assert len([p for p in (tmp_path / "random_init").iterdir() if p.is_dir()]) == 2  # another seed, another init


def test_random_init_is_written_where_transformers_would_write_nothing(tiny_cfg, tmp_path, monkeypatch):
    """save_pretrained writes no file on a process whose torch.distributed rank is not 0: when rank 1 of a QLoRA run
    from a shape took the lock first it renamed an empty directory into the cache and failed to load it ("Unrecognized
    model"). rm writes the files itself, byte for byte what save_pretrained writes on rank 0."""
    from transformers import PreTrainedModel

    from rm.modelling.model import _config_from_shape, saved_random_init

    cfg = tiny_cfg("memory_profile=qlora")
    set_seed(cfg.train.seed)
    with torch.random.fork_rng(devices=[]):
        reference = AutoModelForSequenceClassification.from_config(_config_from_shape(cfg.model, 0))
    reference.save_pretrained(tmp_path / "reference")
    monkeypatch.setenv("RM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(PreTrainedModel, "should_save_on_this_rank", lambda self, is_main_process: False)
    path = saved_random_init(cfg.model, 0)
    for name in ("config.json", "model.safetensors"):
        assert (path / name).read_bytes() == (tmp_path / "reference" / name).read_bytes(), name


def test_only_local_rank_0_builds_the_random_init(tiny_cfg, tmp_path, monkeypatch):
    """The other processes of a launch wait for local rank 0's init (the estimate counts the build on that rank
    alone) and load the same one; with none coming they stop, naming where they waited."""
    import rm.modelling.model

    monkeypatch.setenv("RM_CACHE", str(tmp_path))
    monkeypatch.setattr(rm.modelling.model, "RANDOM_INIT_WAIT_S", 0.3)
    cfg = tiny_cfg("memory_profile=qlora")
    set_seed(cfg.train.seed)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(TimeoutError, match="local rank 0 .* at " + str(tmp_path)):
        rm.modelling.model.saved_random_init(cfg.model, 0)
    assert not rm.modelling.model.random_init_saved(cfg.model, 0)  # it built nothing
    monkeypatch.setenv("LOCAL_RANK", "0")
    built = rm.modelling.model.saved_random_init(cfg.model, 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rm.modelling.model.saved_random_init(cfg.model, 0) == built and rm.modelling.model.random_init_saved(cfg.model, 0)


@pytest.mark.slow
def test_qlora_trains_and_exports_on_the_cpu(tiny_cfg, tmp_path, monkeypatch):
    """The whole run on a CPU: 4-bit base, adapters and head train, the export reloads with the same rewards."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("RM_CACHE", str(tmp_path / "cache"))
    cfg = tiny_cfg("memory_profile=qlora", "train.optim.learning_rate=5e-3", *STEPS)
    result = rm_train.train(cfg, tmp_path / "run")
    assert result["status"] == "ok"
    trace = losses(tmp_path / "run")
    assert trace[-1] < trace[0], trace
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()


def test_qlora_trains_as_lora_on_its_dequantised_base(tiny_cfg, tmp_path, monkeypatch):
    """memory_profile=qlora is LoRA on the NF4 round trip of its base and nothing else: the same trainable tensors
    (adapters and the ``score`` head, fp32), the same initial adapters at the same seed, and, in training mode with
    dropout, the same rewards and gradients as memory_profile=lora on a plain fp32 copy of the dequantised weights.
    So an accuracy gap between lora and qlora comes from the 4-bit weights (docs/memory.md, QLoRA), not from how rm wraps,
    casts or computes them (a bf16 compute dtype, a frozen head or bitsandbytes' bf16 kernel would fail this)."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit

    from rm.modelling.model import build_reward_model, saved_random_init
    from rm.foundations.precision import Precision

    monkeypatch.setenv("RM_CACHE", str(tmp_path / "cache"))
    qcfg = tiny_cfg("memory_profile=qlora")
    numerics = Precision.of("32-true").numerics(deepspeed=False)

    def build(cfg):
        set_seed(cfg.train.seed)
        return build_reward_model(cfg.model, cfg.memory_profile, cfg.lora, numerics=numerics, gradient_checkpointing=False,
                                  fp32_head=False, pad_token_id=0)

    qlora = build(qcfg)
    set_seed(qcfg.train.seed)
    plain = AutoModelForSequenceClassification.from_pretrained(saved_random_init(qcfg.model, 0), num_labels=1)
    state = plain.state_dict()
    layers = {name: m for name, m in qlora.get_base_model().named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 14  # every linear layer of the 2 blocks
    for name, layer in layers.items():
        state[name.replace(".base_layer", "") + ".weight"] = dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    plain.load_state_dict(state)
    plain.save_pretrained(tmp_path / "dequantised")
    lora = build(tiny_cfg("memory_profile=lora", f"model.pretrained={tmp_path / 'dequantised'}"))

    trainable = {n: p for n, p in qlora.named_parameters() if p.requires_grad}
    assert trainable.keys() == {n for n, p in lora.named_parameters() if p.requires_grad}
    assert any(n.endswith("score.modules_to_save.default.weight") for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    for name, param in lora.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, trainable[name]), name  # the same initial adapters and head
            if "lora_B" in name:  # B starts at zero: give the adapters an output, the same in both
                with torch.no_grad():
                    param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
                    trainable[name].copy_(param)
    torch.manual_seed(0)
    ids = torch.randint(1, qcfg.model.vocab_size, (8, 24))
    mask = torch.ones_like(ids)
    mask[4:, 17:] = 0
    rewards = {}
    for name, model in (("qlora", qlora), ("lora", lora)):
        model.train()
        torch.manual_seed(1)  # the same dropout masks
        chosen, rejected = pair_rewards(model, ids, mask)
        bradley_terry_loss(chosen, rejected).backward()
        rewards[name] = torch.cat([chosen, rejected]).detach()
    assert torch.allclose(rewards["qlora"], rewards["lora"], rtol=0, atol=1e-6), rewards
    for name, param in lora.named_parameters():
        if param.requires_grad:
            assert torch.allclose(trainable[name].grad, param.grad, rtol=1e-5, atol=1e-7), name
