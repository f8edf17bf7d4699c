#!/usr/bin/env bash
# bash train_rm_distributed.sh SUBSET NUM_GPUS [hydra overrides...]
#
#   SUBSET    helpful | harmless | synthetic | PATH (a jsonl/json/parquet file, or a directory
#             holding train.* and test.* files)
#   NUM_GPUS  processes on this node (on a machine without CUDA: CPU processes over gloo)
#
# Several nodes: set NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT on every node, and RUN_DIR to a
# directory every node sees (all ranks must write to one run directory).
#
#   bash train_rm_distributed.sh helpful 8
#   bash train_rm_distributed.sh synthetic 2 experiment=tiny
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 RUN_DIR=/shared/rm/run1 bash train_rm_distributed.sh helpful 8
set -euo pipefail

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
die() { echo "train_rm_distributed.sh: $*" >&2; exit 2; }

[ $# -ge 2 ] || usage
subset="$1"; nproc="$2"; shift 2
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "NUM_GPUS must be a positive integer, got '$nproc'"

case "$subset" in
  helpful)   data=(data=hh_helpful) ;;
  harmless)  data=(data=hh_harmless) ;;
  synthetic) data=(data=synthetic) ;;
  *)
    if [ -d "$subset" ]; then
      train=$(ls "$subset"/train.{jsonl,json,parquet} 2>/dev/null | head -1 || true)
      test=$(ls "$subset"/test.{jsonl,json,parquet} 2>/dev/null | head -1 || true)
      [ -n "$train" ] || die "directory '$subset' has no train.jsonl, train.json or train.parquet"
      data=(data=local "data.train_files=[$train]")
      [ -z "$test" ] || data+=("data.eval_files=[$test]")
    elif [ -f "$subset" ]; then
      data=(data=local "data.train_files=[$subset]")
    else
      die "SUBSET must be helpful, harmless, synthetic, or an existing file or directory; got '$subset'"
    fi ;;
esac

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] && [ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK must be in [0, NNODES), got '$NODE_RANK'"
if [ "$NNODES" -gt 1 ] && [ -z "${RUN_DIR:-}" ]; then
  die "with NNODES > 1 set RUN_DIR to a directory every node can write to"
fi
# One directory for every rank: Hydra's ${now:...} can differ by a second between processes.
RUN_DIR="${RUN_DIR:-outputs/$(date +%Y-%m-%d)/$(date +%H-%M-%S)-dist}"

cmd=(torchrun --nnodes "$NNODES" --nproc_per_node "$nproc" --node_rank "$NODE_RANK"
     --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
     -m rm.train "${data[@]}" "hydra.run.dir=$RUN_DIR" "$@")
echo "+ ${cmd[*]}"
# torchrun exits 1 with a traceback of its own whenever a rank fails: the ranks leave their exit codes and messages
# in RM_EXIT_DIR, and the script exits with theirs (2 config, 3 refused, 4 non-finite, 5 storage, 6 lost a peer; a rank
# killed without a word, 128+N, named from torchrun's own report; rm/training/launch.py).
export RM_EXIT_DIR
RM_EXIT_DIR=$(mktemp -d)
trap 'rm -rf "$RM_EXIT_DIR"' EXIT
"${cmd[@]}" 2> >(python -m rm.training.launch filter >&2) &
pid=$!
# SIGTERM or SIGINT to this script (SLURM, Ctrl-C) goes on to torchrun, which passes it to the ranks.
trap 'kill -TERM "$pid" 2>/dev/null' TERM
trap 'kill -INT "$pid" 2>/dev/null' INT
status=0
wait "$pid" || status=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid" || status=$?; done  # a trapped signal interrupts the first wait
wait  # the stderr filter: its last lines before ours
set +e
python -m rm.training.launch summarize "$RM_EXIT_DIR" "$status"
exit $?
