#!/usr/bin/env bash
# The GPU reference study (config/gpu-h200.yaml) on one machine with two GPUs and no network.
#
# Run from the repository root on the GPU machine, after shared/gpu/gpu-env has installed the
# SGLang, vLLM and trainer (megatron-core) overlays under /tmp/envs (gpu-env collect ...; gpu-env install):
#
#   scripts/gpu/run_reference.sh setup WHEELS_DIR   # controller wheels, data, random-init model, run configs
#   scripts/gpu/run_reference.sh start [PLAN]       # a plan of the study in the background (own session)
#   scripts/gpu/run_reference.sh status             # progress
#   HYBRIDRL_DRY_RUN=1 scripts/gpu/run_reference.sh all PLAN   # print what a plan runs, in order, runs nothing
#   scripts/gpu/run_reference.sh pack OUT_FILE      # steps, provenance, bench/probe JSON, logs -> tar.gz
#
# After every finished item the driver refreshes $ref/latest.tar.gz. Copy it out with every poll of a
# leased machine (`status; cp /tmp/ref/latest.tar.gz "$OUT"/`): a lease that lapses takes /tmp with it,
# and on 2026-11-22 one did, losing eleven finished runs that had not been copied out.
#
# PLAN is `full` (every run, the default), `rest` (what the first lease did not reach) or `moe` (with
# HYBRIDRL_GPU_CONFIG=config/gpu-2xh200-moe.yaml). A plan has runs that need both GPUs before and after
# two lanes, one per GPU, so that the study fits a short lease; a lane's runs see only its GPU
# (CUDA_VISIBLE_DEVICES) and sample only that GPU with NVML. Order is priority: a lease that ends early
# keeps the runs that matter most. Every process a run starts is in that run's process group.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
ref=${HYBRIDRL_REF_DIR:-/tmp/ref}
config=${HYBRIDRL_GPU_CONFIG:-$repo/config/gpu-h200.yaml}
ctl=/tmp/ctl
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_DEVICE_ORDER=PCI_BUS_ID
# NVLink multicast stays off on these machines (see the device notes); engines inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HYBRIDRL_GIT_COMMIT=${HYBRIDRL_GIT_COMMIT:-$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)}
ctl_path="$ctl:$repo/src"

say() { echo "[$(date +%T)] $*"; }

setup() {
  local wheels=${1:?usage: run_reference.sh setup WHEELS_DIR}
  mkdir -p "$ref"/{cfg,runs,bench}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$ctl" \
    "$wheels"/*.whl
  PYTHONPATH=$ctl_path python3 - "$config" "$ref" <<'EOF'
import json, sys
from pathlib import Path
from hybridrl.config import load_study
study, ref = load_study(sys.argv[1]), Path(sys.argv[2])
(ref / "study.json").write_text(json.dumps({"data": study.data, "models": study.models}))
for rid, run in study.runs.items():
    short = run.get("name") or "-".join([run["engine"], run["placement"]]
                                        + (["megatron"] if run["trainer"] == "megatron" else []))
    cfg = {"run_id": rid, "run": run, "study": study.name, "engine_env": study.engine_envs.get(run["engine"], {})}
    (ref / "cfg" / f"{short}.json").write_text(json.dumps(cfg, sort_keys=True))
    print(short, rid)
EOF
  local data_args name spec
  # the study's synthetic data spec as CLI flags (no network here: GSM8K itself cannot be fetched)
  data_args=$(python3 -c "import json;d=json.load(open('$ref/study.json'))['data'];\
print(f\"--source synthetic --n-train {d.get('n_train',512)} --n-test {d.get('n_test',128)} --seed {d.get('seed',0)}\")")
  say "data: $data_args"
  # shellcheck disable=SC2086
  PYTHONPATH=$ctl_path python3 -m hybridrl data $data_args --out "$ref/data"
  # every model the study defines; each run names its own
  while IFS=$'\t' read -r name spec; do
    PYTHONPATH=$ctl_path python3 -m hybridrl model --spec "$spec" --corpus "$ref/data/train.jsonl" \
      --out "$ref/models/$name"
    python3 -c "import json;c=json.load(open('$ref/models/$name/config.json'));\
print('$name', {k:c.get(k) for k in ('vocab_size','hidden_size','num_hidden_layers')})"
  done < <(python3 -c "import json;[print(k, json.dumps(v), sep='\t') for k, v in \
json.load(open('$ref/study.json'))['models'].items()]")
  touch "$ref/setup.done"
  say "setup done"
}

# the controller's PYTHONPATH: in-process vLLM lives in the controller; Megatron's workers inherit it
controller_path() {
  local p=$ctl_path
  [[ $1 == vllm-inprocess-* ]] && p="/tmp/envs/vllm:$p"
  [[ $1 == *-megatron* ]] && p="/tmp/envs/trainer:$p"
  echo "$p"
}

# train NAME [GPU]: one run; GPU empty = every GPU visible (split)
train() {
  local name=$1 gpu=${2:-} cfg="$ref/cfg/$1.json" rid model out pp
  [ -n "${HYBRIDRL_DRY_RUN:-}" ] && { say "dry run: train $name on GPU ${gpu:-all}"; return 0; }
  rid=$(python3 -c "import json;print(json.load(open('$cfg'))['run_id'])")
  model="$ref/models/$(python3 -c "import json;print(json.load(open('$cfg'))['run']['model'])")"
  out="$ref/runs/$rid"
  [ -f "$out/done.json" ] && { say "train $name already done"; return 0; }  # a rerun of the study resumes
  mkdir -p "$out"
  pp=$(controller_path "$name")
  say "train $name ($rid) on GPU ${gpu:-all}"
  local rc=0
  ( if [ -n "$gpu" ]; then export CUDA_VISIBLE_DEVICES=$gpu; else unset CUDA_VISIBLE_DEVICES; fi
    cp "$cfg" "$out/config.json"
    PYTHONPATH=$pp timeout 1200 python3 -m hybridrl train --run-config "$cfg" --model "$model" \
      --data "$ref/data" --out "$out" --done "$out/done.json" --no-progress ) > "$out/train.log" 2>&1 || rc=$?
  say "train $name exit $rc ($(wc -l < "$out/steps.jsonl" 2>/dev/null || echo 0) steps)"
}

# bench NAME GPU STEP [--set k=v]: the engine alone on step STEP's request set of that run, plus raw HTTP probes
bench() {
  local name=$1 gpu=$2 step=$3 cfg="$ref/cfg/$1.json" rid model pp
  [ -n "${HYBRIDRL_DRY_RUN:-}" ] && { say "dry run: bench $name step $step on GPU $gpu ${*:4}"; return 0; }
  shift 3
  rid=$(python3 -c "import json;print(json.load(open('$cfg'))['run_id'])")
  model="$ref/models/$(python3 -c "import json;print(json.load(open('$cfg'))['run']['model'])")"
  [ -f "$ref/bench/$name.json" ] && { say "bench $name already done"; return 0; }
  pp=$(controller_path "$name")
  say "bench $name step $step on GPU $gpu $*"
  local rc=0
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$pp timeout 600 python3 -m hybridrl bench --run-config "$cfg" \
    --model "$model" --data "$ref/data" --run-dir "$ref/runs/$rid" --step "$step" --repeats 3 --probe "$@" \
    --out "$ref/bench/$name.json" > "$ref/bench/$name.log" 2>&1 || rc=$?
  say "bench $name exit $rc"
}

# Plans: each sets `first` and `last` (runs on both GPUs) and `lane0`, `lane1` (one GPU each). An item is
# "train NAME [GPUS]" or "bench NAME STEP [ARGS]"; a lane item gets its lane's GPU.
plan_full() {
  # the split pair first, side by side with their GPUs crossed (it also fills the compile caches)
  first=("pair")
  lane0=("train sglang-colocate" "train sglang-restart" "train vllm-inprocess-restart"
         "train sglang-colocate-megatron" "bench sglang-colocate 3 --set sglang_release=all")
  lane1=("train vllm-colocate" "train vllm-inprocess-colocate" "train vllm-restart"
         "train vllm-colocate-megatron" "bench vllm-colocate 3")
  last=("train sglang-colocate-megatron-tp2 0,1" "train vllm-colocate-megatron-tp2 0,1")
}

plan_rest() {
  # after the first lease (5 of 8 HF runs): the restart runs, Megatron in the loop, the vLLM server again
  # with the adapter-reload fix, the standalone benchmarks, then TP 2
  first=()
  lane0=("train sglang-restart" "train vllm-inprocess-restart" "train sglang-colocate-megatron"
         "bench sglang-colocate-megatron 3 --set sglang_release=all")
  lane1=("train vllm-restart" "train vllm-colocate-megatron" "train vllm-colocate" "bench vllm-colocate 3")
  last=("train sglang-colocate-megatron-tp2 0,1" "train vllm-colocate-megatron-tp2 0,1" "train vllm-split 1,0")
}

plan_moe() {
  # config/gpu-2xh200-moe.yaml (issue 6 scaled to two GPUs): colocate in two lanes, then the split runs one
  # at a time, each with its engine on GPU 1 and its Megatron trainer on GPU 0
  first=()
  lane0=("train sglang-colocate-megatron" "train vllm-inprocess-colocate-megatron")
  lane1=("train vllm-colocate-megatron")
  last=("train sglang-split-megatron 0,1" "train vllm-split-megatron 0,1" "train vllm-inprocess-split-megatron 0,1")
}

item() {  # item GPU WORDS...: one plan item; GPU is the lane's, used where the item names none
  local gpu=$1 what=$2 name=${3:-}
  shift $(($# < 3 ? $# : 3))
  case $what in
    train) train "$name" "${1:-$gpu}" ;;
    bench) bench "$name" "$gpu" "$@" ;;
    pair) split_pair ;;
    *) echo "unknown plan item: $what" >&2; return 2 ;;
  esac
}

lane() {  # lane GPU ITEM...
  local gpu=$1 it
  shift
  for it in "$@"; do
    # shellcheck disable=SC2086
    item "$gpu" $it
    snapshot
  done
}

split_pair() {
  # both split runs at once, crossed so that no GPU holds two engines: SGLang's engine on GPU 1 with its
  # trainer on GPU 0, vLLM's engine on GPU 0 with its trainer on GPU 1 (the engine takes the last
  # visible GPU, the trainer cuda:0). Each samples both GPUs, so its memory maxima include the other
  # run's trainer (a few GB); its timings share the host's CPUs.
  train sglang-split "0,1" &
  local s0=$!
  train vllm-split "1,0" &
  local s1=$!
  wait $s0 $s1 || true
}

all() {
  local plan=${1:-full}
  [ -f "$ref/setup.done" ] || { echo "run setup first" >&2; exit 1; }
  declare -F "plan_$plan" > /dev/null || { echo "no plan named $plan (full, rest, moe)" >&2; exit 2; }
  local first=() lane0=() lane1=() last=()
  "plan_$plan"
  say "study start (plan $plan)"
  lane "" "${first[@]}"
  lane 0 "${lane0[@]}" > "$ref/lane0.log" 2>&1 &
  local p0=$!
  lane 1 "${lane1[@]}" > "$ref/lane1.log" 2>&1 &
  local p1=$!
  wait $p0 $p1 || true
  say "lanes done"
  lane "" "${last[@]}"
  say "study done"
  touch "$ref/all.done"
}

status() {
  for f in "$ref"/lane0.log "$ref"/lane1.log "$ref"/driver.log; do
    [ -f "$f" ] && { echo "== $f"; tail -n 8 "$f"; }
  done
  for d in "$ref"/runs/*/; do
    [ -d "$d" ] || continue
    printf '%-60s %s steps  ' "$(basename "$d")" "$(wc -l < "$d/steps.jsonl" 2>/dev/null || echo 0)"
    tail -n 1 "$d/train.log" 2>/dev/null | cut -c1-200
  done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader || true
}

snapshot() {  # the finished part of the study as $ref/latest.tar.gz, replaced atomically (lanes run at once)
  local tmp
  tmp=$(mktemp "$ref/.latest.XXXXXX")
  pack "$tmp" > /dev/null && mv -f "$tmp" "$ref/latest.tar.gz"
}

pack() {
  local dest=${1:?usage: run_reference.sh pack OUT_FILE}
  # small files only: no adapters, no models; engine logs trimmed to their last lines
  local stage
  stage=$(mktemp -d)
  mkdir -p "$stage/ref/runs" "$stage/ref/bench"
  for d in "$ref"/runs/*/; do
    [ -d "$d" ] || continue
    local r
    r=$(basename "$d")
    mkdir -p "$stage/ref/runs/$r/logs"
    cp "$d"/{steps.jsonl,provenance.json,canary.json,config.json,done.json} "$stage/ref/runs/$r/" 2>/dev/null || true
    tail -n 400 "$d/train.log" > "$stage/ref/runs/$r/train.log" 2>/dev/null || true
    for l in "$d"/logs/*; do [ -f "$l" ] && tail -n 300 "$l" > "$stage/ref/runs/$r/logs/$(basename "$l")"; done
  done
  cp "$ref"/bench/*.json "$stage/ref/bench/" 2>/dev/null || true
  for l in "$ref"/bench/*.log; do [ -f "$l" ] && tail -n 200 "$l" > "$stage/ref/bench/$(basename "$l")"; done
  cp "$ref"/*.log "$stage/ref/" 2>/dev/null || true
  tar czf "$dest" --exclude='*.tar.gz' -C "$stage" ref
  rm -rf "$stage"
  ls -l "$dest"
}

cmd=${1:-}; shift || true
case "$cmd" in
  setup) setup "$@" ;;
  start)
    # run from a snapshot of the code, so that later edits to the checkout cannot reach a running study
    rm -rf "$ref/code" && mkdir -p "$ref/code"
    cp -r "$repo"/{src,config,workflow,scripts} "$ref/code/"
    PYTHONPATH="$ctl:$ref/code/src" python3 -c "import hybridrl.loop, hybridrl.bench, hybridrl.engines.sglang"
    setsid nohup bash "$ref/code/scripts/gpu/run_reference.sh" all "${1:-full}" > "$ref/driver.log" 2>&1 < /dev/null &
    say "study started in the background (pid $!); logs in $ref" ;;
  all) all "$@" ;;
  train) train "$@" ;;
  bench) bench "$@" ;;
  status) status ;;
  pack) pack "$@" ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
