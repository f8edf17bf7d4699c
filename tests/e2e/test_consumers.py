"""An exported bundle gives the same rewards in every tool that consumes it, within 1e-4 in fp32.

Each client's own code is run, not a re-implementation: plain transformers (the model and
``pipeline``), PEFT's ``AutoPeftModelForSequenceClassification``, TRL's GRPO reward path
(``GRPOTrainer(...)._calculate_rewards``, plain-text and conversational prompts, with the README's
``rm.score.reward_function`` and with the bundle's path), and, in the slow suite, RewardBench 0.1.4's
``rewardbench`` command (its own environment: it pins transformers 4.51) and OpenRLHF 0.11's ``RewardModel``
and reward server (installed without its CUDA-only dependencies). The reference is ``python -m rm.score``.
The texts mix lengths (padding is exercised) and each client that lets its caller choose is run with both
padding sides; TRL always pads on the right.

The convention under test (docs/export.md, "Use your reward model"): training read the reward at the EOS
appended to a plain text (after the tokenizer's BOS) and at the final EOS a conversation's chat template
writes; the bundle's tokenizer gives a plain text those ids under ``tokenizer(text)``. The README's snippets
are run here too (``readme_snippet``).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

import rm.train as rm_train
from rm.data.synthetic import generate_pairs
from rm.foundations.errors import DataError
from rm.modelling.bundle import ADAPTER_BASE_FORMAT
from rm.score import main as score_main
from tests.conftest import CONF_DIR, FAST_TINY, compose_run

TOL = 1e-4  # fp32; measured differences are below 1e-6 (same weights, same kernels, other batch shapes)
REPO = CONF_DIR.parent
README = REPO / "README.md"
# A rope base other than transformers 4's default (10000), as Llama 3's 5e5: a bundle whose base only
# transformers 5 finds would load under transformers 4 (RewardBench) with the wrong one.
STEPS = ["train.max_steps=6", "train.logging.eval_steps=6", "train.logging.logging_steps=3", "model.rope_theta=500000.0"]
PLACEHOLDER = "outputs/<date>/<time>/final"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A full run and a LoRA run (adapter in final/, merged copy in final/merged) of the tiny model."""
    from rm.foundations.config import to_run_config

    out = {}
    for name, extra in (("full", []), ("lora", ["memory_profile=lora", "lora=r8", "lora.merge_on_save=true",
                                                "train.optim.learning_rate=5e-3"])):
        run_dir = tmp_path_factory.mktemp(name)
        rm_train.train(to_run_config(compose_run(FAST_TINY + STEPS + extra)), run_dir)
        out[name] = run_dir / "final"
    return {"full": out["full"], "adapter": out["lora"], "merged": out["lora"] / "merged"}


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """A QLoRA run of the tiny model on the CPU: its random init saved, loaded in 4-bit NF4, adapters and head
    trained; final/ holds the 4-bit base with the adapter, final/merged the adapter folded into the dequantised base."""
    pytest.importorskip("bitsandbytes")
    from rm.foundations.config import to_run_config

    run_dir, cache = tmp_path_factory.mktemp("qlora"), tmp_path_factory.mktemp("rm_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RM_CACHE", str(cache))
        rm_train.train(to_run_config(compose_run(FAST_TINY + STEPS + [
            "memory_profile=qlora", "lora=r8", "lora.merge_on_save=true", "train.optim.learning_rate=5e-3"])), run_dir)
    return run_dir / "final"


def rewards_of(model, tokenizer, texts):
    with torch.no_grad():
        return model(**tokenizer(texts, padding=True, return_tensors="pt")).logits[:, 0]


def four_bit_as_trained(monkeypatch):
    """Every bitsandbytes ``Linear4bit`` built from here on computes through its dequantised weight, as training did:
    what a consumer of a QLoRA adapter bundle gets on a GPU, on a CPU without AVX512-BF16, or after setting
    ``support_avx512bf16_for_cpu = False`` on each 4-bit layer (docs/export.md, "Use your reward model"). A CPU with
    AVX512-BF16 otherwise scores in bf16, about 5e-3 away (test_qlora_adapter_and_merged_bundles_match_rm_score)."""
    import bitsandbytes.nn.modules

    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: False)


@pytest.fixture
def bundle(request, kind, monkeypatch):
    """The exported directory of ``kind``: ``full``, ``adapter``, ``merged`` (LoRA), ``qlora-adapter`` (the adapter on
    its 4-bit base), ``qlora-merged`` (folded into the dequantised base). The QLoRA run starts only when asked for."""
    if not kind.startswith("qlora"):
        return request.getfixturevalue("runs")[kind]
    final = request.getfixturevalue("qlora")
    if kind == "qlora-adapter":
        four_bit_as_trained(monkeypatch)
    return final / "merged" if kind == "qlora-merged" else final


BUNDLES = ["full", "merged", "adapter", "qlora-merged", "qlora-adapter"]


@pytest.fixture(scope="module")
def pairs():
    """Synthetic HH pairs of spread lengths, split into prompt and completion at the last assistant turn."""
    rows = generate_pairs(40, seed=3, split="test")
    rows = sorted(rows, key=lambda r: len(r["chosen"]))[::5]  # 8 pairs, shortest to longest
    out = []
    for row in rows:
        cut = row["chosen"].rindex("\n\nAssistant:") + len("\n\nAssistant:")
        assert row["rejected"][:cut] == row["chosen"][:cut]
        out.append({"prompt": row["chosen"][:cut], "chosen": row["chosen"][cut:], "rejected": row["rejected"][cut:],
                    "chosen_text": row["chosen"], "rejected_text": row["rejected"]})
    return out


def texts_of(pairs):
    return [p["chosen_text"] for p in pairs] + [p["rejected_text"] for p in pairs]


def rm_score(bundle, rows, tmp_path, *extra):
    """Rewards from ``python -m rm.score`` (in process): ``reward`` of text rows, or (chosen, rejected) of pairs."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert score_main(["--model", str(bundle), "--input", str(src), "--output", str(dst), *extra]) == 0
    scored = [json.loads(line) for line in dst.read_text().splitlines()]
    if "chosen" not in rows[0]:  # texts, or single conversations
        return torch.tensor([r["reward"] for r in scored])
    return torch.tensor([r["reward_chosen"] for r in scored] + [r["reward_rejected"] for r in scored])


def messages(text):
    """An HH transcript as a list of chat messages."""
    turns = re.split(r"\n\n(Human|Assistant): ", text)[1:]
    return [{"role": "user" if role == "Human" else "assistant", "content": content}
            for role, content in zip(turns[::2], turns[1::2])]


def readme_snippet(name):
    """The code block after ``<!-- consumers: NAME -->`` in the README or a guide (docs/export.md); where both show
    it, the copies must be the same, so the one tested is the one every reader copies."""
    copies = {page.relative_to(REPO).as_posix(): match.group(1) for page in [README, *sorted((REPO / "docs").glob("*.md"))]
              for match in re.finditer(rf"<!-- consumers: {name} -->\s*```\w*\n(.*?)```", page.read_text(), re.S)}
    assert copies, f"no page has a snippet marked <!-- consumers: {name} -->"
    assert len(set(copies.values())) == 1, f"the snippet marked <!-- consumers: {name} --> differs between {sorted(copies)}"
    return next(iter(copies.values()))


def close(got, want):
    return torch.allclose(torch.as_tensor(got, dtype=torch.float32), want, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", BUNDLES)
@pytest.mark.parametrize("side", ["right", "left"])
def test_plain_transformers_and_pipeline_match_rm_score(bundle, pairs, tmp_path, kind, side):
    """The README's transformers snippet as written (the adapter loads through transformers' PEFT
    integration, onto the base its adapter_config.json names), and ``pipeline(function_to_apply="none")``."""
    texts = texts_of(pairs)
    want = rm_score(bundle, [{"text": t} for t in texts], tmp_path)
    scope = {"texts": texts}
    snippet = readme_snippet("transformers").replace(PLACEHOLDER, str(bundle))
    exec(snippet.replace('padding=True', f'padding=True, padding_side="{side}"'), scope)
    assert close(scope["rewards"], want), (scope["rewards"], want)
    pipe = pipeline("text-classification", model=str(bundle), function_to_apply="none", device="cpu")
    pipe.tokenizer.padding_side = side
    got = [out["score"] for out in pipe(texts, batch_size=5)]  # batches of mixed lengths
    assert close(got, want), (got, want)
    # Without function_to_apply="none" the pipeline returns sigmoid(reward), as the README says.
    default = [out["score"] for out in pipeline("text-classification", model=str(bundle), device="cpu")(texts[:3])]
    assert close(default, torch.sigmoid(want[:3]))


@pytest.mark.parametrize("kind", ["adapter", "qlora-adapter"])
def test_peft_auto_class_loads_the_adapter_offline(bundle, pairs, tmp_path, kind):
    from peft import AutoPeftModelForSequenceClassification

    texts = texts_of(pairs)
    assert Path(json.loads((bundle / "adapter_config.json").read_text())["base_model_name_or_path"]).is_dir()
    model = AutoPeftModelForSequenceClassification.from_pretrained(bundle).eval()
    tokenizer = AutoTokenizer.from_pretrained(bundle)
    with torch.no_grad():
        got = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits[:, 0]
    assert close(got, rm_score(bundle, [{"text": t} for t in texts], tmp_path))


@pytest.mark.parametrize("kind", ["adapter", "qlora-adapter"])
def test_a_moved_lora_bundle_loads_in_transformers_pipeline_and_peft(bundle, pairs, tmp_path, kind):
    """The whole run directory moved elsewhere: the adapter bundle holds its random-init base, so transformers'
    Auto class and ``pipeline`` load it from its new place as they do in place, and so does rm.score; PEFT's
    ``AutoPeftModel*`` follow adapter_config.json's path as written, which ``python -m rm.export`` points at
    the new place."""
    import shutil

    from peft import AutoPeftModelForSequenceClassification

    from rm.modelling.bundle import rehome
    from rm.export import main as export_main

    run_dir, texts = bundle.parent, texts_of(pairs)
    want = rm_score(bundle, [{"text": t} for t in texts], tmp_path)
    moved = tmp_path / "moved" / "run"
    shutil.move(run_dir, moved)
    try:
        bundle = moved / "final"
        tokenizer = AutoTokenizer.from_pretrained(bundle)
        model = AutoModelForSequenceClassification.from_pretrained(bundle).eval()
        with torch.no_grad():
            got = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits[:, 0]
        assert close(got, want), (got, want)
        pipe = pipeline("text-classification", model=str(bundle), function_to_apply="none", device="cpu")
        assert close([out["score"] for out in pipe(texts, batch_size=5)], want)
        assert close(rm_score(bundle, [{"text": t} for t in texts], tmp_path), want)
        assert export_main([str(moved)]) == 0  # verifies, and names the base where it now is
        model = AutoPeftModelForSequenceClassification.from_pretrained(bundle).eval()
        with torch.no_grad():
            got = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits[:, 0]
        assert close(got, want), (got, want)
    finally:
        shutil.move(moved, run_dir)
        rehome(run_dir / "final")


def test_qlora_adapter_and_merged_bundles_match_rm_score(qlora, pairs, tmp_path):
    """Both exports of a QLoRA run, loaded by plain transformers, give rm.score's rewards: the adapter on its
    4-bit base (bitsandbytes needed) computed through the dequantised weights, as it trained and as rm scores it
    (rm.modelling.model.evaluate_4bit_as_trained), and the merged bundle (no quantisation left: plain transformers alone),
    which is the same model up to fp32 rounding. bitsandbytes' own CPU inference kernel (AVX512-BF16 machines)
    computes in bf16 instead: a consumer that keeps it differs by up to about 2e-2 (the README's merge-error table)."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import has_avx512bf16

    merged, texts = qlora / "merged", texts_of(pairs)
    assert "quantization_config" in json.loads((qlora / "config.json").read_text())  # the base trained on
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(qlora)
    want = rm_score(qlora, [{"text": t} for t in texts], tmp_path)
    adapter = AutoModelForSequenceClassification.from_pretrained(qlora).eval()
    layers = [m for m in adapter.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers
    for layer in layers:  # the dequantising path training took, instead of the bf16 inference kernel
        layer.support_avx512bf16_for_cpu = False
    assert close(rewards_of(adapter, tokenizer, texts), want)
    plain = AutoModelForSequenceClassification.from_pretrained(merged).eval()
    merged_rewards = rm_score(merged, [{"text": t} for t in texts], tmp_path)
    assert close(rewards_of(plain, tokenizer, texts), merged_rewards)
    assert close(merged_rewards, want)  # the merge: exact up to fp32 rounding
    if has_avx512bf16():  # a fresh load keeps the kernel: bf16 rewards, near but not equal
        fresh = AutoModelForSequenceClassification.from_pretrained(qlora).eval()
        kernel = torch.as_tensor(rewards_of(fresh, tokenizer, texts), dtype=torch.float32)
        assert 0 < float((kernel - want).abs().max()) < 2e-2


def test_a_merge_that_cannot_dequantise_says_why(qlora, tmp_path):
    from rm.foundations.errors import ConfigError
    from rm.modelling.bundle import adapter_base_model, merge_adapter

    base = adapter_base_model(qlora)
    assert base.is_quantized

    def no_dequantize(dtype=None):
        raise NotImplementedError("this quantisation cannot be undone")

    base.dequantize = no_dequantize
    with pytest.raises(ConfigError, match=r"cannot merge .*quantised \(bitsandbytes\).*cannot be undone"):
        merge_adapter(qlora, tmp_path / "merged", base_model=base)
    assert not (tmp_path / "merged").exists()


@pytest.fixture(scope="module")
def policy(tmp_path_factory, runs):
    """A tiny random causal LM with the bundle's tokenizer: GRPOTrainer needs a policy to be built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("policy")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(runs["full"])
    config = AutoConfig.for_model("mistral", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def grpo_rewards(trainer, pairs, conversational: bool):
    """Rewards from GRPOTrainer's own ``_calculate_rewards`` for each pair's chosen then rejected completion."""
    if conversational:
        convs = [(messages(p["chosen_text"]), messages(p["rejected_text"])) for p in pairs]
        prompts = [c[:-1] for c, _ in convs] * 2
        completions = [c[-1:] for c, _ in convs] + [r[-1:] for _, r in convs]
    else:
        prompts = [p["prompt"] for p in pairs] * 2
        completions = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    return trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions, [[0]] * len(prompts))[:, 0]


def grpo_trainer(snippet, bundle, policy, tmp_path):
    import datasets

    scope = {"dataset": datasets.Dataset.from_list([{"prompt": "hi"}] * 4)}
    snippet = snippet.replace(PLACEHOLDER, str(bundle)).replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(policy)))
    snippet = snippet.replace('output_dir="grpo"', f'output_dir={str(tmp_path / "grpo")!r}')
    exec(snippet.replace("bf16=True", "bf16=False, use_cpu=True, per_device_train_batch_size=4, num_generations=2, "
                                      "report_to=[]"), scope)
    return scope["trainer"]


@pytest.mark.parametrize("kind", BUNDLES)
def test_trl_grpo_with_the_readme_reward_function_matches_rm_score(bundle, pairs, policy, tmp_path, kind):
    """TRL's GRPOTrainer built by the README's snippet (``reward_funcs=reward_function(<bundle>)``), rewards from its
    own ``_calculate_rewards``: plain-text prompts (prompt + completion) and conversational ones."""
    trainer = grpo_trainer(readme_snippet("trl"), bundle, policy, tmp_path)
    assert close(grpo_rewards(trainer, pairs, False), rm_score(bundle, [{"text": t} for t in texts_of(pairs)], tmp_path))
    convs = [(messages(p["chosen_text"]), messages(p["rejected_text"])) for p in pairs]
    want = rm_score(bundle, [{"chosen": c, "rejected": r} for c, r in convs], tmp_path, "--format", "messages")
    got = grpo_rewards(trainer, pairs, True)
    assert close(got, want), (got, want)


@pytest.mark.parametrize("kind", ["full"])
def test_trl_grpo_given_the_bundle_path_scores_conversations_right_and_plain_text_not(bundle, pairs, policy, tmp_path, kind):
    """``reward_funcs=<path>``: TRL renders a conversation with the bundle's chat template (which writes BOS and the final
    EOS) and tokenises it without special tokens: the trained ids. A plain prompt + completion gets neither: another
    token, another reward. The README says so and gives ``reward_function`` for both."""
    snippet = readme_snippet("trl").replace('reward_function("outputs/<date>/<time>/final")', '"outputs/<date>/<time>/final"')
    trainer = grpo_trainer(snippet, bundle, policy, tmp_path)
    convs = [(messages(p["chosen_text"]), messages(p["rejected_text"])) for p in pairs]
    want = rm_score(bundle, [{"chosen": c, "rejected": r} for c, r in convs], tmp_path, "--format", "messages")
    assert close(grpo_rewards(trainer, pairs, True), want)
    assert not close(grpo_rewards(trainer, pairs, False), rm_score(bundle, [{"text": t} for t in texts_of(pairs)], tmp_path))


def test_rm_score_scores_single_conversations_as_the_chosen_side_of_a_pair(runs, pairs, tmp_path):
    """Chat rollouts (``{"messages": [...]}``, no chosen/rejected) get the reward their conversation gets as a pair's side."""
    bundle = runs["adapter"]
    convs = [(messages(p["chosen_text"]), messages(p["rejected_text"])) for p in pairs]
    single = rm_score(bundle, [{"messages": c} for c, _ in convs], tmp_path)
    paired = rm_score(bundle, [{"chosen": c, "rejected": r} for c, r in convs], tmp_path, "--format", "messages")
    assert close(single, paired[: len(convs)]), (single, paired)
    assert not close(single, paired[len(convs):])  # the rejected sides score otherwise: the comparison can fail
    with pytest.raises(DataError, match="row 1: .*assistant"):
        rm_score(bundle, [{"messages": convs[0][0]}, {"messages": convs[1][0][:-1]}], tmp_path)


def test_rm_score_normalize_uses_the_bundle_stats(runs, pairs, tmp_path):
    bundle, rows = runs["full"], [{"text": t} for t in texts_of(pairs)]
    stats = json.loads((bundle / "reward_stats.json").read_text())
    raw, normalised = rm_score(bundle, rows, tmp_path), rm_score(bundle, rows, tmp_path, "--normalize")
    assert stats["std"] > 0 and close(normalised, (raw - stats["mean"]) / stats["std"])
    assert not close(normalised, raw)


# --------------------------------------------------------------------------- #
# Slow: clients that need their own environment, built once under ~/.cache/rm-consumers
# --------------------------------------------------------------------------- #

CACHE = Path(os.environ.get("RM_CONSUMERS_CACHE", Path.home() / ".cache" / "rm-consumers"))


def _rewardbench_python():
    """A venv with RewardBench 0.1.4 (transformers 4.51, trl 0.19) and this machine's torch version."""
    venv = CACHE / "rewardbench-0.1.4"
    python = venv / "bin" / "python"
    if not (venv / ".complete").is_file():
        torch_version = torch.__version__.split("+")[0]
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # setuptools<80: rewardbench imports pkg_resources.
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch_version}", "setuptools<80",
                        "rewardbench==0.1.4"], check=True)
        (venv / ".complete").touch()
    return python


def _openrlhf_path():
    """OpenRLHF 0.11.2 installed without dependencies (they pin flash-attn, CUDA only) plus the two it imports."""
    target = CACHE / "openrlhf-0.11.2"
    if not (target / ".complete").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        "openrlhf==0.11.2"], check=True)
        # What its model and reward-server modules import, beside rm's own packages.
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                        "pylatexenc", "jsonlines", "fastapi", "uvicorn"], check=True)
        (target / ".complete").touch()
    return target


def rewardbench(argv, cwd):
    """RewardBench's own ``main`` in its environment (tests/e2e/consumers/rewardbench_cli.py), offline."""
    return subprocess.run([str(_rewardbench_python()), str(REPO / "tests/e2e/consumers/rewardbench_cli.py"), *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})


def rewardbench_rows(pairs):
    used = [{"prompt": p["prompt"].split("\n\nHuman: ", 1)[1].rsplit("\n\nAssistant:", 1)[0],
             "chosen": p["chosen"].strip(), "rejected": p["rejected"].strip()}
            for p in pairs if p["prompt"].count("\n\nHuman:") == 1]
    assert len(used) >= 4
    return [{side: [{"role": "user", "content": u["prompt"]}, {"role": "assistant", "content": u[side]}]
             for side in ("chosen", "rejected")} for u in used]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["merged", "qlora-merged"])
def test_rewardbench_command_matches_rm_score_under_transformers_4(bundle, pairs, tmp_path, kind):
    """The ``rewardbench`` command line of docs/export.md, run by RewardBench's own ``main`` offline on a local JSON
    file (``--dataset FILE --load_json``): it renders the conversations with the chat template, tokenises them with
    the tokenizer's special tokens (removing a doubled BOS) and always pads on the left; rm.score scores the same
    conversations as messages. ``--tokenizer .../trained_tokenizer``: the bundle's own tokenizer would add a second
    EOS after the template's (checked: other rewards). Its environment has transformers 4.51:
    the bundle written by transformers 5 must load there with the right rope base and tokenizer, which is the
    check of both majors. Without ``--not_quantized`` it would load the model in 8-bit (on a CPU it fails)."""
    snippet = readme_snippet("rewardbench")
    command = snippet.replace("\\\n", " ").split("\n")[0].split()
    assert command[:3] == ["rewardbench", "--model", "outputs/<date>/<time>/final/merged"]
    assert command[command.index("--tokenizer") + 1] == "outputs/<date>/<time>/final/merged/trained_tokenizer"
    assert "--not_quantized" in command and command[command.index("--torch_dtype") + 1] == "float32"
    (tmp_path / "merged").symlink_to(bundle)  # relative: RewardBench writes results/<--model>_outputs.jsonl
    rows = rewardbench_rows(pairs)
    (tmp_path / "pairs.json").write_text(json.dumps(rows))
    flags = " ".join(command[3:]).replace("outputs/<date>/<time>/final/merged", "merged").split()
    want = rm_score(bundle, rows, tmp_path, "--format", "messages")
    for tokenizer_flag in (True, False):
        argv = ["--model", "merged", *(flags if tokenizer_flag else flags[2:]), "--dataset", "pairs.json", "--load_json"]
        proc = rewardbench(argv, tmp_path)
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["transformers"].startswith("4.")
        assert out["rope_theta"] == json.loads((bundle / "config.json").read_text())["rope_parameters"]["rope_theta"] == 5e5
        scored = [json.loads(line) for line in (tmp_path / "results" / "merged_outputs.jsonl").read_text().splitlines()]
        got = [r["scores_chosen"] for r in scored] + [r["scores_rejected"] for r in scored]
        assert close(got, want) == tokenizer_flag, (tokenizer_flag, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adapter"])
def test_rewardbench_refuses_an_adapter_bundle_instead_of_scoring_its_base(bundle, pairs, tmp_path, kind):
    """transformers 4.51 without PEFT (RewardBench's environment) ignores adapter_config.json: it used to load the
    random-init base beside the adapter and score the untrained model without a word. The base's weight files are
    marked (rm.modelling.bundle.mark_adapter_base): it now stops with an error."""
    (tmp_path / "final").symlink_to(bundle)
    (tmp_path / "pairs.json").write_text(json.dumps(rewardbench_rows(pairs)))
    proc = rewardbench(["--model", "final", "--tokenizer", "final/trained_tokenizer", "--not_quantized", "--torch_dtype",
                        "float32", "--dataset", "pairs.json", "--load_json"], tmp_path)
    # transformers 4.51: "Incompatible safetensors file. File metadata is not ['pt', 'tf', 'flax', 'mlx'] but <format>"
    assert proc.returncode != 0 and ADAPTER_BASE_FORMAT in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "results" / "final_outputs.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["merged", "adapter", "qlora-merged", "qlora-adapter"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_openrlhf_reward_model_and_server_match_rm_score(bundle, pairs, tmp_path, kind, side):
    """OpenRLHF's PPO as it builds what it scores: the prompt rendered by the chat template (``--apply_chat_template``:
    the bundle's writes the BOS), tokenised with ``add_special_tokens=False``, then the policy's response tokens
    ending in its EOS. The in-process ``RewardModel`` scores those ids; with ``--reward.remote_url`` the agent
    decodes them with ``skip_special_tokens=False`` and its reward server (``serve_rm``) tokenises that text without
    special tokens. Both give rm.score's reward of the conversation. A response cut at the length limit (no EOS)
    is read at its last token: another reward. OpenRLHF builds its own model class with ``from_pretrained``, so an
    adapter bundle loads as in plain transformers (its base with the adapter); in its own process, a 4-bit base
    computes as trained only if told (``four_bit_as_trained``, as in :func:`four_bit_as_trained`)."""
    snippet = readme_snippet("openrlhf")  # the flags the README gives are the ones driven here
    assert "--reward.model_name_or_path outputs/<date>/<time>/final/merged" in snippet
    assert snippet.count("--ds.value_head_prefix score") == 2 and "--reward.remote_url" in snippet
    assert "--apply_chat_template" in snippet
    target = _openrlhf_path()
    tokenizer = AutoTokenizer.from_pretrained(bundle)
    convs = [messages(p[f"{side_}_text"]) for side_ in ("chosen", "rejected") for p in pairs]
    prompts = [tokenizer.apply_chat_template(c[:-1], tokenize=False, add_generation_prompt=True) for c in convs]
    responses = [" " + c[-1]["content"] for c in convs]
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] + tokenizer(r, add_special_tokens=False)["input_ids"]
            + [tokenizer.eos_token_id] for p, r in zip(prompts, responses)]
    queries = [tokenizer.decode(r, skip_special_tokens=False) for r in rows]  # what the agent sends the server

    def openrlhf(spec_fields):
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"padding_side": side, "pad_token_id": tokenizer.pad_token_id,
                                    "four_bit_as_trained": kind == "qlora-adapter", **spec_fields}))
        proc = subprocess.run([sys.executable, str(REPO / "tests/e2e/consumers/openrlhf_rewards.py"), str(bundle), str(spec)],
                              capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(target)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    half = len(pairs)
    want = rm_score(bundle, [{"chosen": c, "rejected": r} for c, r in zip(convs[:half], convs[half:])], tmp_path,
                    "--format", "messages")
    assert close(openrlhf({"rows": rows, "normalize_reward": False})["rewards"], want)
    assert close(openrlhf({"texts": queries, "normalize_reward": False})["rewards"], want)
    cut = openrlhf({"rows": [r[:-1] for r in rows], "normalize_reward": False})["rewards"]  # no EOS: another token
    assert not close(cut, want)
    # --normalize_reward: OpenRLHF's RewardModel.__init__ copies config.mean/std (config.json) into its
    # buffers; rm.score --normalize reads reward_stats.json. The same numbers:
    stats = json.loads((bundle / "reward_stats.json").read_text())
    normalised = openrlhf({"rows": rows, "normalize_reward": True})
    assert (normalised["config_mean"], normalised["config_std"]) == (stats["mean"], stats["std"])
    # ... but OpenRLHF 0.11 registers those buffers non-persistent, and transformers 5 (which OpenRLHF 0.11
    # pins too) builds the model on the meta device and allocates them afresh: they are lost. This asserts
    # that known upstream loss (README); when it is fixed, the rewards must equal rm.score --normalize.
    if normalised["mean"] == pytest.approx(stats["mean"]):
        assert close(normalised["rewards"], (want - stats["mean"]) / stats["std"])
