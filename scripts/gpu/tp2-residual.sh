#!/usr/bin/env bash
# On a two-GPU machine with the `trainer` overlay installed (/tmp/envs/trainer) and the controller's wheels
# (/tmp/ctl): Megatron TP 2's GPU memory left after offload (issue 15: at most 1 GB a rank while the engine runs),
# python -m hybridrl.tools.megatron_bench on its 1 B random Qwen3, one process group per variant:
#   before   hybridrl's source at REV (.gpu/src-REV, scripts/gpu/snapshot-src.sh)
#   tree     the tree's source
#   release  the tree's source with the run key release_comms (the groups destroyed at offload, made at onload)
#   NAME=VAR=VALUE[,VAR=VALUE...]   (further arguments) the tree's source with those environment variables
# Each variant's JSON and log go to OUT/tp2-residual.tar.gz (a call returns few files: one archive); the JSON also
# holds rank 0's memory before the model and any collective, and with the model loaded (megatron.at_start).
#
#   bash scripts/gpu/tp2-residual.sh OUT REV|- [NAME=VAR=VALUE,...]...
set -euo pipefail
out=${1:?usage: tp2-residual.sh OUT REV [NAME=VAR=VALUE,...]...}
rev=${2:?usage: tp2-residual.sh OUT REV [NAME=VAR=VALUE,...]...}
shift 2
repo=$(cd "$(dirname "$0")/../.." && pwd)
before=$repo/.gpu/src-$rev/src  # REV "-": no `before` row (a lease too short for it)
[ "$rev" = - ] || [ -d "$before" ] || { echo "tp2-residual: no snapshot at $before (scripts/gpu/snapshot-src.sh $rev)" >&2; exit 2; }
work=${HYBRIDRL_TP2_WORK:-/tmp/tp2-residual}
mkdir -p "$work/res"
bench() {  # NAME SRC FLAGS [VAR=VALUE...]: one benchmark process group on GPUs 0,1
  local name=$1 src=$2 flags=$3
  shift 3
  echo "tp2-residual: $name ($(date -u +%T))"
  # shellcheck disable=SC2086  # FLAGS: words to pass on, or none
  env "$@" CUDA_VISIBLE_DEVICES=0,1 PYTHONPATH="/tmp/envs/trainer:/tmp/ctl:$src" \
    python3 -m hybridrl.tools.megatron_bench "$work/$name" --tp 2 --skip-hf --model "$work/model" $flags \
    > "$work/res/$name.json" 2> "$work/res/$name.log" || echo "tp2-residual: $name failed (rc $?)"
  grep -o '"mem/trainer_residual_gb": [0-9.]*' "$work/res/$name.json" | head -1 || true
}
if [ ! -f "$work/model/config.json" ]; then  # the benchmark's own model, made once by its first run
  PYTHONPATH="/tmp/ctl:$repo/src" python3 -c "
import sys
from pathlib import Path
from hybridrl.tools.megatron_bench import QWEN3_1B
from hybridrl.tools.trainer_bench import random_model
random_model(Path(sys.argv[1]), QWEN3_1B, 'bfloat16')" "$work/model"
fi
[ "$rev" = - ] || bench before "$before" ""
bench tree "$repo/src" ""
bench release "$repo/src" --release-comms
for variant in "$@"; do
  IFS=, read -r -a vars <<< "${variant#*=}"
  bench "${variant%%=*}" "$repo/src" "" "${vars[@]}"
done
nvidia-smi --query-gpu=index,name,memory.used --format=csv > "$work/res/nvidia-smi.csv" 2>&1 || true
tar czf "$out/tp2-residual.tar.gz" -C "$work" res
