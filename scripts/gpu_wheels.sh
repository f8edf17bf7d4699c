#!/usr/bin/env bash
# bash scripts/gpu_wheels.sh        (here, with PyPI) then, on an offline GPU machine that has torch and transformers:
#   pip install --no-index --no-deps --no-build-isolation --target /tmp/site .whl/*
#   export PYTHONPATH=/tmp/site:$PWD
#   python benchmarks/memory_calibration.py --device cuda
# Fetches what such a machine lacks (Hydra, datasets, bitsandbytes, DeepSpeed and their small
# dependencies) as CPython 3.12 manylinux wheels, plus the two sdists that have none, into .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p "$(git rev-parse --git-dir)/info"
grep -qx '/.whl/' "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-dir)/info/exclude"
platform=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)
python -m pip download -q --no-deps --only-binary=:all: "${platform[@]}" -d .whl \
  hydra-core==1.3.2 omegaconf==2.3.0 datasets dill multiprocess "bitsandbytes>=0.45" hjson pydantic annotated-types typing-inspection
core=$(unzip -p .whl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
python -m pip download -q --no-deps --only-binary=:all: "${platform[@]}" -d .whl "pydantic-core==$core"
python -m pip download -q --no-deps --no-binary=:all: -d .whl antlr4-python3-runtime==4.9.3 deepspeed
du -sh .whl
