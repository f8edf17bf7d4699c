#!/usr/bin/env bash
# bash scripts/compare_demo_metrics.sh REV [OVERRIDE...]
#
# The demo (`python -m rm.train experiment=tiny`, plus any OVERRIDE) of the working tree against that of git
# revision REV (checked out in a temporary worktree), at the same seed: "same" where metrics.jsonl has the same
# records with the same values apart from timings (`time` and the `*_s` fields: tokens_per_s, step_time_s, ...),
# "DIFFER" with the first differences otherwise. For refactors that must not change a number. Exit 1 if any differs.
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
rev="$1"
shift
root=$(cd "$(dirname "$0")/.." && pwd)
old=$(mktemp -d)
runs=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$old" >/dev/null 2>&1 || true; rm -rf "$runs"' EXIT
git -C "$root" worktree add --detach -q "$old" "$rev"
for side in old root; do
  dir=${!side}
  (cd "$dir" && PYTHONPATH="$dir" python -m rm.train experiment=tiny "$@" hydra.run.dir="$runs/$side" \
     > "$runs/$side.log" 2>&1) || { echo "the demo of $side ($dir) failed: $runs/$side.log" >&2; tail -5 "$runs/$side.log" >&2; exit 1; }
done
python - "$runs/old/metrics.jsonl" "$runs/root/metrics.jsonl" <<'PY'
import json, sys

def values(path):
    # Timings differ from run to run; everything else is a function of the code, the data and the seed.
    return [{k: v for k, v in json.loads(line).items() if k != "time" and not k.endswith("_s")} for line in open(path)]

a, b = (values(p) for p in sys.argv[1:])
differ = [f"record {i} ({ra.get('event')} step {ra.get('step')}): {k}: {ra.get(k)!r} -> {rb.get(k)!r}"
          for i, (ra, rb) in enumerate(zip(a, b)) for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k)]
if len(a) != len(b):
    differ.insert(0, f"{len(a)} records -> {len(b)}")
print(f"same: {len(a)} records" if not differ else "DIFFER " + "; ".join(differ[:10]))
sys.exit(1 if differ else 0)
PY
