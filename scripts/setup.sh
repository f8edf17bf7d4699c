#!/usr/bin/env bash
# bash scripts/setup.sh [extras]      e.g. bash scripts/setup.sh dev
# Installs torch first, then rm in editable mode with its dependencies.
# torch comes first because a bare `torch` requirement resolved by pip on a
# CPU-only Linux machine pulls the multi-GB CUDA build. Choose the build with
# TORCH_SPEC / TORCH_INDEX_URL:
#   CPU-only machine (default):  TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
#   CUDA machine:                TORCH_INDEX_URL= (empty: PyPI's default CUDA build)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PIP="${PIP:-python -m pip}"

if python -c "import torch" 2>/dev/null; then
  echo "torch $(python -c 'import torch; print(torch.__version__)') already installed: keeping it"
elif [ -n "${TORCH_INDEX_URL+x}" ] && [ -z "${TORCH_INDEX_URL}" ]; then
  $PIP install "$TORCH_SPEC"
else
  index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
  echo "installing $TORCH_SPEC from $index (one try, 5 s timeout)"
  # One try: pip's default 5 retries took about 9 s, silently, where the index is unreachable.
  if ! $PIP install --retries 0 --timeout 5 --index-url "$index" "$TORCH_SPEC" 2>/dev/null; then
    # Machines without the PyTorch index (e.g. a mirror-only network) may carry a local CPU wheel
    # that pip finds for the exact pinned version.
    echo "$index failed (unreachable, or it has no $TORCH_SPEC): installing $TORCH_SPEC from pip's configured index"
    $PIP install "$TORCH_SPEC"
  fi
fi
$PIP install -e ".[${extras}]"
# rm first: importing it quiets the bitsandbytes "kernels" and DeepSpeed accelerator lines (rm/foundations/quiet.py).
python -c "import rm, torch, transformers, peft, accelerate, datasets, hydra; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__, '| datasets', datasets.__version__, '| hydra', hydra.__version__)"
