"""Rewards of an rm bundle through OpenRLHF 0.11's own RewardModel, printed as JSON (run by tests/e2e/test_consumers.py).

    PYTHONPATH=<openrlhf install> python tests/e2e/consumers/openrlhf_rewards.py BUNDLE INPUT.json

OpenRLHF cannot be installed with its dependencies on a CPU machine (it pins flash-attn, a
CUDA build, and another transformers), so it is installed with ``--no-deps`` and the two
flash-attn modules its model file imports are stubbed: they are used only for packed
samples and ring attention, which this does not use. The model is built by OpenRLHF's
``get_llm_for_sequence_regression(path, "reward", ...)``, which is what ``--reward_pretrain
PATH --value_head_prefix score --normalize_reward`` does in its PPO trainer, and called as the
PPO loop calls it: ``model(input_ids, attention_mask)``, the reward read at the last 1 of the
mask. With ``"texts"`` instead of ``"rows"``, the texts go through OpenRLHF's reward server
instead (``openrlhf.cli.serve_rm.RewardModelProxy.get_reward``, what ``--reward.remote_url``
calls), which tokenises them with ``add_special_tokens=False``. OpenRLHF accepts only bf16 and fp16 weights, where no two implementations agree to 1e-4,
so its dtype helper is given fp32 too (the server's dtype is ``"param_dtype"``, default fp32: bf16 is its own
default); the model code is OpenRLHF's, unchanged. INPUT holds ``{"rows": [[ids...]],
"padding_side": ..., "normalize_reward": bool, "four_bit_as_trained": bool}``; the last turns off bitsandbytes' bf16
CPU inference kernel in 4-bit layers (a QLoRA adapter bundle's base), so that they compute as training did.
"""

import importlib.machinery
import json
import sys
import types


def _stub(name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    sys.modules[name] = module


_stub("flash_attn")
_stub("flash_attn.bert_padding", index_first_axis=None, pad_input=None, rearrange=None, unpad_input=None)
_stub("flash_attn.utils")
_stub("flash_attn.utils.distributed", all_gather=None)

import torch  # noqa: E402
import openrlhf.utils.utils as openrlhf_utils  # noqa: E402
from openrlhf.models.model import get_llm_for_sequence_regression  # noqa: E402

_dtype = openrlhf_utils.convert_to_torch_dtype
openrlhf_utils.convert_to_torch_dtype = lambda name: torch.float32 if name == "fp32" else _dtype(name)


def serve_rm_rewards(bundle: str, spec: dict) -> list:
    from types import SimpleNamespace as NS

    from openrlhf.cli.serve_rm import RewardModelProxy

    args = NS(  # serve_rm's command-line defaults, fp32 and eager attention (CPU)
        reward=NS(model_name_or_path=bundle, normalize_enable=spec["normalize_reward"]),
        ds=NS(attn_implementation="eager", experts_implementation=None, param_dtype=spec.get("param_dtype", "fp32"),
              load_in_4bit=False,
              value_head_prefix="score", packing_samples=False),
        data=NS(disable_fast_tokenizer=False, max_len=2048), batch_size=None,
    )
    proxy = RewardModelProxy(args)
    proxy.tokenizer.padding_side = spec["padding_side"]
    return proxy.get_reward(spec["texts"])


def main(bundle: str, input_path: str) -> None:
    spec = json.loads(open(input_path).read())
    if spec.get("four_bit_as_trained"):
        import bitsandbytes.nn.modules

        bitsandbytes.nn.modules.has_avx512bf16 = lambda: False  # read by each Linear4bit as it is built
    if "texts" in spec:
        print(json.dumps({"rewards": serve_rm_rewards(bundle, spec)}))
        return
    model = get_llm_for_sequence_regression(
        bundle, "reward", param_dtype="fp32", attn_implementation="eager", value_head_prefix="score",
        normalize_reward=spec["normalize_reward"],
    ).eval()
    rows, width = spec["rows"], max(len(r) for r in spec["rows"])
    ids = torch.full((len(rows), width), spec["pad_token_id"])
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if spec["padding_side"] == "right" else slice(width - len(row), width)
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    with torch.no_grad():
        rewards = model(ids, attention_mask=mask)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(bundle)  # what get_llm_for_sequence_regression hands RewardModel.__init__
    print(json.dumps({"rewards": rewards.float().tolist(), "mean": model.mean.item(), "std": model.std.item(),
                      "config_mean": getattr(config, "mean", None), "config_std": getattr(config, "std", None)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
