#!/usr/bin/env bash
# The GPU reference study (config/gpu-h200.yaml) on one machine with two GPUs and no network.
#
# Run from the repository root on the GPU machine, after shared/gpu/gpu-env has installed the
# SGLang and vLLM overlays under /tmp/envs (gpu-env collect ...; gpu-env install):
#
#   scripts/gpu/run_reference.sh setup WHEELS_DIR   # controller wheels, data, random-init model, run configs
#   scripts/gpu/run_reference.sh start              # the whole study in the background (own session)
#   scripts/gpu/run_reference.sh status             # progress
#   scripts/gpu/run_reference.sh pack OUT_FILE      # steps, provenance, bench/probe JSON, logs -> tar.gz
#
# The two split runs need both GPUs and go first, side by side with their GPUs crossed. The other runs
# go in two lanes, one per GPU, so the study fits a short lease; each of them sees only its lane's GPU
# (CUDA_VISIBLE_DEVICES) and samples only that GPU with NVML. Every process a run starts is in that
# run's process group and is stopped with it.
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
    short = f"{run['engine']}-{run['placement']}"
    cfg = {"run_id": rid, "run": run, "study": study.name, "engine_env": study.engine_envs.get(run["engine"], {})}
    (ref / "cfg" / f"{short}.json").write_text(json.dumps(cfg, sort_keys=True))
    print(short, rid)
EOF
  local data_args model_name model_json
  # the study's synthetic data spec as CLI flags (no network here: GSM8K itself cannot be fetched)
  data_args=$(python3 -c "import json;d=json.load(open('$ref/study.json'))['data'];\
print(f\"--source synthetic --n-train {d.get('n_train',512)} --n-test {d.get('n_test',128)} --seed {d.get('seed',0)}\")")
  say "data: $data_args"
  # shellcheck disable=SC2086
  PYTHONPATH=$ctl_path python3 -m hybridrl data $data_args --out "$ref/data"
  model_name=$(python3 -c "import json;print(next(iter(json.load(open('$ref/study.json'))['models'])))")
  model_json=$(python3 -c "import json;print(json.dumps(json.load(open('$ref/study.json'))['models']['$model_name']))")
  PYTHONPATH=$ctl_path python3 -m hybridrl model --spec "$model_json" --corpus "$ref/data/train.jsonl" \
    --out "$ref/models/$model_name"
  echo "$model_name" > "$ref/model_name"
  python3 -c "import json;c=json.load(open('$ref/models/$model_name/config.json'));print({k:c.get(k) for k in ('vocab_size','hidden_size','num_hidden_layers')})"
  touch "$ref/setup.done"
  say "setup done"
}

# train NAME [GPU]: one run; GPU empty = every GPU visible (split)
train() {
  local name=$1 gpu=${2:-} cfg="$ref/cfg/$1.json" rid model out pp
  rid=$(python3 -c "import json;print(json.load(open('$cfg'))['run_id'])")
  model="$ref/models/$(cat "$ref/model_name")"
  out="$ref/runs/$rid"
  [ -f "$out/done.json" ] && { say "train $name already done"; return 0; }  # a rerun of the study resumes
  mkdir -p "$out"
  pp=$ctl_path
  [[ $name == vllm-inprocess-* ]] && pp="/tmp/envs/vllm:$ctl_path"  # vLLM lives in the controller
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
  shift 3
  rid=$(python3 -c "import json;print(json.load(open('$cfg'))['run_id'])")
  model="$ref/models/$(cat "$ref/model_name")"
  [ -f "$ref/bench/$name.json" ] && { say "bench $name already done"; return 0; }
  pp=$ctl_path
  [[ $name == vllm-inprocess-* ]] && pp="/tmp/envs/vllm:$ctl_path"
  say "bench $name step $step on GPU $gpu $*"
  local rc=0
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$pp timeout 600 python3 -m hybridrl bench --run-config "$cfg" \
    --model "$model" --data "$ref/data" --run-dir "$ref/runs/$rid" --step "$step" --repeats 3 --probe "$@" \
    --out "$ref/bench/$name.json" > "$ref/bench/$name.log" 2>&1 || rc=$?
  say "bench $name exit $rc"
}

# Order is priority: a lease that ends early keeps the runs that matter most. The split pair goes
# first (it also fills the compile caches), then each lane's colocate runs, then the restart runs,
# then the standalone benchmarks.
lane0() {
  train sglang-colocate 0
  train sglang-restart 0
  train vllm-inprocess-restart 0
  bench sglang-colocate 0 3 --set sglang_release=all  # the backup flag lets the probe try a full release too
}

lane1() {
  train vllm-colocate 1
  train vllm-inprocess-colocate 1
  train vllm-restart 1
  bench vllm-colocate 1 3
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
  [ -f "$ref/setup.done" ] || { echo "run setup first" >&2; exit 1; }
  say "study start"
  split_pair
  say "split pair done"
  lane0 > "$ref/lane0.log" 2>&1 &
  local p0=$!
  lane1 > "$ref/lane1.log" 2>&1 &
  local p1=$!
  wait $p0 $p1 || true
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
  tar czf "$dest" -C "$stage" ref
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
    setsid nohup bash "$ref/code/scripts/gpu/run_reference.sh" all > "$ref/driver.log" 2>&1 < /dev/null &
    say "study started in the background (pid $!); logs in $ref" ;;
  all) all ;;
  lane0) lane0 ;;
  lane1) lane1 ;;
  train) train "$@" ;;
  bench) bench "$@" ;;
  status) status ;;
  pack) pack "$@" ;;
  *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
