"""RewardBench 0.1.4's own ``rewardbench`` command, run on the CPU (run by tests/e2e/test_consumers.py).

    cd WORKDIR && <rewardbench venv>/bin/python tests/e2e/consumers/rewardbench_cli.py --model ... [the command's flags]

The arguments are the command line, as docs/export.md gives it; ``rewardbench.rewardbench.main`` parses
and runs them (model loading, its chat-template rendering, its pipeline, its output file). One thing is
changed: its ``RewardBenchPipeline`` moves each batch to "cuda" unconditionally, so ``BatchEncoding.to``
is redirected to the CPU. The last line printed is JSON with the transformers version and the rope
base that version reads from the bundle's config, for the caller to check the transformers-4 path.
"""

import json
import sys

import transformers
from transformers import AutoConfig
from transformers.tokenization_utils_base import BatchEncoding

_to = BatchEncoding.to
BatchEncoding.to = lambda self, device, **kw: _to(self, "cpu" if str(device).startswith("cuda") else device, **kw)


def main(argv):
    from rewardbench.rewardbench import main as rewardbench_main

    sys.argv = ["rewardbench", *argv]
    rewardbench_main()
    model = argv[argv.index("--model") + 1]
    print(json.dumps({"transformers": transformers.__version__, "rope_theta": AutoConfig.from_pretrained(model).rope_theta}))


if __name__ == "__main__":
    main(sys.argv[1:])
