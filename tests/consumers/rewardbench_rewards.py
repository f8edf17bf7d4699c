"""Rewards of an rm bundle through RewardBench 0.1.4's own code, printed as JSON (run by tests/test_consumers.py).

    <rewardbench venv>/bin/python tests/consumers/rewardbench_rewards.py BUNDLE INPUT.json

RewardBench pins transformers 4.51 and trl 0.19, so this runs in its own environment; it is
also the check that a bundle written by transformers 5 loads under transformers 4. INPUT
holds ``{"pairs": [{"prompt": str, "chosen": str, "rejected": str}], "padding_side": ...}``.
What RewardBench's ``rewardbench`` command does with a sequence-classifier, step by step
(rewardbench/rewardbench.py): ``AutoTokenizer`` + ``AutoModelForSequenceClassification``
(fp32 here: its default fp16 does not hold 1e-4), texts built by
``prepare_dialogue_from_tokenizer`` with the tokenizer's chat template, scored by
``RewardBenchPipeline``. The pipeline moves its inputs to "cuda" unconditionally, so
``BatchEncoding.to`` is redirected to the CPU; nothing else is changed.
"""

import json
import sys

import torch
import transformers
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.tokenization_utils_base import BatchEncoding

from rewardbench.models.pipeline import RewardBenchPipeline
from rewardbench.utils import prepare_dialogue_from_tokenizer

_to = BatchEncoding.to
BatchEncoding.to = lambda self, device, **kw: _to(self, "cpu" if str(device).startswith("cuda") else device, **kw)


def main(bundle: str, input_path: str) -> None:
    spec = json.loads(open(input_path).read())
    tokenizer = AutoTokenizer.from_pretrained(bundle)
    tokenizer.padding_side = spec["padding_side"]
    model = AutoModelForSequenceClassification.from_pretrained(bundle, torch_dtype=torch.float32)
    pipe = RewardBenchPipeline("text-classification", model, tokenizer)
    chosen, rejected = [], []
    for pair in spec["pairs"]:
        example = prepare_dialogue_from_tokenizer(dict(pair), tokenizer)
        chosen.append(example["text_chosen"])
        rejected.append(example["text_rejected"])
    rewards = {side: pipe(texts, batch_size=len(texts)).float()[:, 0].tolist() for side, texts in
               (("chosen", chosen), ("rejected", rejected))}
    print(json.dumps({**rewards, "texts_chosen": chosen, "transformers": transformers.__version__,
                      "rope_theta": model.config.rope_theta}))


if __name__ == "__main__":
    main(*sys.argv[1:])
