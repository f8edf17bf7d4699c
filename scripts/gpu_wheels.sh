#!/usr/bin/env bash
# bash scripts/gpu_wheels.sh        (here, with PyPI and torch installed) then, on an offline GPU machine that has
# torch, transformers, peft and accelerate:   bash scripts/gpu_session.sh OUT_DIR
# Fetches what such a machine lacks (Hydra, datasets, bitsandbytes, DeepSpeed, TRL for the benchmark, optimi,
# pytest-timeout for gpu_session.sh's --timeout, and their small dependencies) as CPython 3.12 manylinux wheels
# into .whl/. The two that ship only as sdists (antlr4-python3-runtime, DeepSpeed) are built into pure-Python wheels
# here, so the offline machine installs without building anything (DeepSpeed compiles its ops just in time, on the
# machine that runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p "$(git rev-parse --git-dir)/info"
grep -qx '/.whl/' "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-dir)/info/exclude"
platform=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)
python -m pip download -q --no-deps --only-binary=:all: "${platform[@]}" -d .whl \
  hydra-core==1.3.2 omegaconf==2.3.0 datasets dill multiprocess "bitsandbytes>=0.45" hjson pydantic annotated-types typing-inspection \
  "trl>=1.16" "torch-optimi>=0.3" "pytest-timeout>=2.3"
core=$(unzip -p .whl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
python -m pip download -q --no-deps --only-binary=:all: "${platform[@]}" -d .whl "pydantic-core==$core"
sdists=$(mktemp -d)
python -m pip download -q --no-deps --no-binary=:all: -d "$sdists" antlr4-python3-runtime==4.9.3 deepspeed
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w .whl "$sdists"/*
rm -rf "$sdists"
du -sh .whl
