#!/usr/bin/env bash
# bash scripts/compare_estimates.sh REV
#
# The pre-flight estimate (`python -m rm.estimate estimate.json=true`) of the working tree against that of git
# revision REV (checked out in a temporary worktree), on seven configurations across profiles, layouts and
# precisions: "same" where the JSON is identical (fields only one side has are named and left out), "DIFFER"
# with the diff otherwise. For refactors that must not change a number. Exit 1 if any differs.
set -euo pipefail
[ $# -eq 1 ] || { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
rev="$1"
root=$(cd "$(dirname "$0")/.." && pwd)
old=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$old" >/dev/null 2>&1 || true' EXIT
git -C "$root" worktree add --detach -q "$old" "$rev"
configs=(
  "experiment=tiny"
  "memory_profile=lora hardware=h100_80g"
  "memory_profile=qlora hardware=h100_80g"
  "model=mistral_7b memory_profile=full distributed=zero3 distributed.num_processes=8 hardware=h100_80g"
  "model=llama3_8b memory_profile=offload hardware=a100_40g train.gradient_checkpointing=true"
  "experiment=tiny train.packing=true train.max_tokens_per_micro_batch=1024 train.precision=bf16-mixed hardware.bf16=true"
  "model=qwen2_7b memory_profile=8bit distributed=ddp distributed.num_processes=4 hardware=h100_80g train.share_prefix=true"
)
status=0
for c in "${configs[@]}"; do
  # shellcheck disable=SC2086  # each configuration is a list of overrides
  (cd "$old" && PYTHONPATH="$old" python -m rm.estimate estimate.json=true $c 2>/dev/null) > "$old/.a.json" || true
  # shellcheck disable=SC2086
  (cd "$root" && PYTHONPATH="$root" python -m rm.estimate estimate.json=true $c 2>/dev/null) > "$old/.b.json" || true
  verdict=$(python - "$old/.a.json" "$old/.b.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
def flat(d, prefix=""):
    return {k2: v2 for k, v in d.items() for k2, v2 in (flat(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(f"{prefix}{k}", v)])}
fa, fb = flat(a), flat(b)
only = sorted(set(fa) ^ set(fb))
differ = sorted(k for k in set(fa) & set(fb) if fa[k] != fb[k])
print(("DIFFER " + "; ".join(f"{k}: {fa[k]!r} -> {fb[k]!r}" for k in differ)) if differ else "same",
      f"(only one side has: {', '.join(only)})" if only else "")
PY
)
  echo "$verdict  <- $c"
  [[ "$verdict" == same* ]] || status=1
done
exit $status
