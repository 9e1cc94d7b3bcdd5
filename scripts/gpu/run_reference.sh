#!/usr/bin/env bash
# The GPU reference studies (config/gpu-h200.yaml and the other config/gpu-*.yaml) on one leased machine with one,
# two or four GPUs and no network. See docs/gpu.md for the lease, call by call.
#
# Run from the repository root on the GPU machine, after shared/gpu/gpu-env has installed the
# SGLang, vLLM and trainer (megatron-core) overlays under /tmp/envs (gpu-env collect ...; gpu-env install):
#
#   scripts/gpu/run_reference.sh setup WHEELS_DIR [CONFIG...]  # controller wheels, then `prepare` (gpu-h200)
#   scripts/gpu/run_reference.sh prepare CONFIG...      # run configs, data, models: python -m hybridrl
#                                                       # prepare-study, the Snakefile rules' own code and commands
#   scripts/gpu/run_reference.sh controller WHEELS_DIR  # controller wheels only (`start` prepares studies)
#   scripts/gpu/run_reference.sh start PLAN [PLAN...]   # plans one after the other, in the background
#   scripts/gpu/run_reference.sh status                 # progress
#   HYBRIDRL_DRY_RUN=1 scripts/gpu/run_reference.sh all PLAN   # print what a plan runs, in order, runs nothing
#   scripts/gpu/run_reference.sh pack OUT_FILE          # steps, provenance, bench/probe JSON, logs -> tar.gz
#   scripts/gpu/run_reference.sh poll OUT_DIR [ROUNDS]  # a lease's poll: pack to OUT_DIR every minute, ends
#                                                       # early once the driver has stopped
#
# Each study lives in $root/<config name>/ (root: HYBRIDRL_REF_DIR, default /tmp/ref). After every finished
# item the driver refreshes $root/latest.tar.gz. Copy it out with every poll of a leased machine
# (`status; cp /tmp/ref/latest.tar.gz "$OUT"/`): a lease that lapses takes /tmp with it, and on 2026-11-22
# one did, losing eleven finished runs that had not been copied out.
#
# The plans, the scheduler (phases, lanes, start barriers, HYBRIDRL_SKIP, waiting for the overlays) and the items
# (train, bench, fault, ceiling, tbench, tprof) are Python: src/hybridrl/tools/lease/ (`all`, `plans`, `start` and
# the items by hand call `python3 -m hybridrl.tools.lease`; `python3 -m hybridrl.tools.lease list` lists the
# plans, src/hybridrl/tools/lease/plans.py says what each is for). This script keeps the environment every
# process of a run inherits, the controller's setup and the transfer and polling glue (status, poll, pack).
# A later plan's study is prepared while the first plan runs. HYBRIDRL_RUN_TIMEOUT_S caps a run (default 1800).
# HYBRIDRL_ENVS_READY lets `start` come before the overlays are installed. Every process a run starts is in its
# process group.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
root=${HYBRIDRL_REF_DIR:-/tmp/ref}
default_study=config/gpu-h200.yaml
ctl=/tmp/ctl
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_DEVICE_ORDER=PCI_BUS_ID
# NVLink multicast stays off on these machines (see the device notes); engines inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# vLLM 0.26 at TP > 1 reaches for multicast on its own: its FlashInfer all-reduce fusion picks the "mnnvl"
# (multicast) workspace on Hopper, its symmetric-memory all-reduce uses multimem at 4+ GPUs. Its first TP 2
# start here died in the compiled profiling pass with an illegal memory access
# (results/reference/2026-11-22-4xh200-moe). The engines set these from the variables above
# (engines/vllm.py: multicast_off_env); set here too so that every process of a run sees them.
export VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm
ctl_path="$ctl:$repo/src"

say() { echo "[$(date +%T)] $*"; }

study_dir() { echo "$root/$(basename "$1" .yaml)"; }  # study_dir CONFIG: the study's folder under $root

use_study() {  # use_study CONFIG: sets `config` and `ref`; CONFIG is under the repository unless absolute
  [[ $1 == /* ]] && config=$1 || config=$repo/$1
  [ -f "$config" ] || { echo "no study config $1 in $repo" >&2; exit 2; }
  ref=$(study_dir "$1")
}

controller() {  # controller WHEELS_DIR: the few wheels the controller needs that the base image lacks
  local wheels=${1:?usage: run_reference.sh controller WHEELS_DIR}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$ctl" \
    "$wheels"/*.whl
}

setup() {
  local wheels=${1:?usage: run_reference.sh setup WHEELS_DIR [CONFIG...]} c
  shift
  controller "$wheels"
  for c in "${@:-$default_study}"; do prepare "$c"; done
}

prepare() {  # prepare CONFIG: the study's run configs, data and models, as the Snakefile's rules build them
  use_study "$1"
  mkdir -p "$ref"/{runs,bench}
  # cfg/<short name>.json per run (the `run_config` rule's file), then `python -m hybridrl data` and `model` with
  # the rules' arguments (src/hybridrl/study/prepare_study.py). A warm start trains on this host's GPU.
  # HYBRIDRL_PREP_MODELS="NAME ...": only those models, none where it is set empty (the driver names the ones its
  # plans' runs use); unset, every model of the study
  local only=()
  [ -z "${HYBRIDRL_PREP_MODELS+set}" ] || read -r -a only <<< "--models $HYBRIDRL_PREP_MODELS"
  PYTHONPATH=$ctl_path python3 -m hybridrl prepare-study --config "$config" --out "$ref" "${only[@]}"
  touch "$ref/setup.done"
  say "setup of $1 done"
}

steps_in() {  # steps_in RUN_DIR: how many steps the run recorded; 0, quietly, before its first
  { wc -l < "$1/steps.jsonl"; } 2>/dev/null || echo 0
}

# lease COMMAND ARGS...: the Python driver (src/hybridrl/tools/lease), with this script's environment
lease() { PYTHONPATH=$ctl_path python3 -m hybridrl.tools.lease --repo "$repo" "$@"; }

# poll OUT_DIR [ROUNDS]: ROUNDS times (default 5) a minute apart, the finished work packed to
# OUT_DIR/latest.tar.gz; then status. It returns at once when the driver is not running (done, dead or never
# started), so that the lease's remaining polls cost seconds, not minutes, and the idle machine goes back.
poll() {
  local out=${1:?usage: run_reference.sh poll OUT_DIR [ROUNDS]} rounds=${2:-5} i
  for ((i = 1; i <= rounds; i++)); do
    driver_running || { say "the driver is not running"; break; }
    wait_while_running "${HYBRIDRL_POLL_S:-56}"
    pack "$root/.poll.tgz" > /dev/null && mv -f "$root/.poll.tgz" "$out/latest.tar.gz"
  done
  pack "$root/.poll.tgz" > /dev/null && mv -f "$root/.poll.tgz" "$out/latest.tar.gz"
  status
}

driver_running() { [ -f "$root/driver.pid" ] && kill -0 "$(cat "$root/driver.pid")" 2> /dev/null; }

# wait_while_running SECONDS: sleep that long, or less once the driver has stopped (checked every second): a lease
# counts its held time to the second, and a poll that slept on after the plan ended cost up to a minute of it
wait_while_running() {
  driver_running || return 0
  timeout "$1" tail --pid="$(cat "$root/driver.pid")" -s 1 -f /dev/null || true
}

status() {
  local f d
  for f in "$root"/driver.log "$root"/prepare-*.log "$root"/*/lane*.log; do
    [ -f "$f" ] && { echo "== $f"; tail -n 6 "$f"; }
  done
  for d in "$root"/*/runs/*/; do
    [ -d "$d" ] || continue
    printf '%-60s %s steps  ' "$(basename "$d")" "$(steps_in "$d")"
    { tail -n 1 "$d/train.log" 2>/dev/null || echo; } | cut -c1-200
  done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader || true
}

# an engine's access-log line for one rollout request or health poll that succeeded (SGLang /generate, vLLM
# /v1/completions): one a request, and the request records keep each request; control calls (sleep, wake,
# adapters) stay
ROLLOUT_ACCESS='"(POST /(generate|v1/completions)|GET /(health|metrics|v1/models)[^ "]*) HTTP/[0-9.]+" 200'

trim_log() {  # trim_log SRC DEST [TAIL]: a log without its rollout access lines, then if still long its start, the
  # lines from its first error on, and its end
  local src=$1 dest=$2 tail=${3:-300} n first ok plain
  plain=$(mktemp)
  ok=$(grep -c -E "$ROLLOUT_ACCESS" "$src" || true)
  { [ "${ok:-0}" -gt 0 ] && echo "[... $ok rollout access lines (HTTP 200) left out ...]"
    grep -v -E "$ROLLOUT_ACCESS" "$src" || true; } > "$plain"
  n=$(wc -l < "$plain")
  if [ "$n" -le $((tail + 300)) ]; then cat "$plain" > "$dest"; rm -f "$plain"; return; fi
  first=$(grep -n -m1 -E 'Traceback|ERROR|Error: ' "$plain" | cut -d: -f1 || true)
  { head -n 50 "$plain"
    # the root cause: a crash's first error is often hundreds of lines above the end of its cascade
    if [ -n "$first" ] && [ "$first" -gt 50 ] && [ "$first" -lt $((n - tail)) ]; then
      echo "[... trimmed to the first error, line $first without the access lines ...]"
      sed -n "$((first > 60 ? first - 10 : 51)),$((first + 239))p" "$plain"
    fi
    echo "[... trimmed: $n lines in all without the access lines; the last $tail follow ...]"
    tail -n "$tail" "$plain"; } > "$dest"
  rm -f "$plain"
}

pack() {  # pack OUT_FILE: small files only (no adapters, no models); long logs trimmed (trim_log)
  local dest=${1:?usage: run_reference.sh pack OUT_FILE} stage s d r l name w m
  stage=$(mktemp -d)
  for s in "$root"/*/; do
    [ -f "$s/setup.done" ] || continue
    name=$(basename "$s")
    mkdir -p "$stage/ref/$name/runs" "$stage/ref/$name/bench"
    for d in "$s"runs/*/; do
      [ -d "$d" ] || continue
      r=$(basename "$d")
      mkdir -p "$stage/ref/$name/runs/$r/logs"
      cp "$d"/{steps.jsonl,provenance.json,canary.json,config.json,done.json} "$stage/ref/$name/runs/$r/" 2>/dev/null || true
      [ -d "$d/requests" ] && cp -r "$d/requests" "$stage/ref/$name/runs/$r/"  # per request: timings, error, reward
      [ -f "$d/train.log" ] && trim_log "$d/train.log" "$stage/ref/$name/runs/$r/train.log" 400
      for l in "$d"/logs/*; do [ -f "$l" ] && trim_log "$l" "$stage/ref/$name/runs/$r/logs/$(basename "$l")"; done
    done
    cp "$s"bench/*.json "$s"bench/*.txt "$stage/ref/$name/bench/" 2>/dev/null || true  # results; profiles (tprof)
    for w in "$s"models/*/warm_start.json; do  # a warm start's record (the model itself stays behind)
      [ -f "$w" ] || continue
      m="$stage/ref/$name/models/$(basename "$(dirname "$w")")"
      mkdir -p "$m" && cp "$w" "$m/"
    done
    for l in "$s"bench/*.log; do [ -f "$l" ] && trim_log "$l" "$stage/ref/$name/bench/$(basename "$l")" 200; done
    cp "$s"*.log "$stage/ref/$name/" 2>/dev/null || true
  done
  mkdir -p "$stage/ref"
  cp "$root"/*.log "$stage/ref/" 2>/dev/null || true
  tar czf "$dest" -C "$stage" ref
  rm -rf "$stage"
  ls -l "$dest"
}

cmd=${1:-}; shift || true
case "$cmd" in
  controller) controller "$@" ;;
  setup) setup "$@" ;;
  prepare) for c in "$@"; do prepare "$c"; done ;;
  start)
    [ $# -gt 0 ] || { echo "usage: run_reference.sh start PLAN [PLAN...] ($(lease list))" >&2; exit 2; }
    lease check "$@"  # every plan exists and names only runs its study has, before anything starts
    # the leased machine's copy of the tree may sit on a .git that is not its own: name the commit here
    [ -n "${HYBRIDRL_GIT_COMMIT:-}" ] || say "warning: HYBRIDRL_GIT_COMMIT is not set; provenance takes the" \
      "commit from this checkout's .git, which may not be the code that travelled (source_sha256 still is)"
    # run from a snapshot of the code, so that later edits to the checkout cannot reach a running study
    rm -rf "$root/code" && mkdir -p "$root/code"
    cp -r "$repo"/{src,config,workflow,scripts} "$root/code/"
    # the source snapshots a plan's src-REV items run (`lease check` found them all)
    if compgen -G "$repo/.gpu/src-*" > /dev/null; then mkdir -p "$root/code/.gpu" && cp -r "$repo"/.gpu/src-* "$root/code/.gpu/"; fi
    PYTHONPATH="$ctl:$root/code/src" python3 -c "import hybridrl.run.loop, hybridrl.tools.engine_bench, hybridrl.engines.sglang, hybridrl.tools.lease.driver"
    PYTHONPATH="$ctl:$root/code/src" setsid nohup python3 -m hybridrl.tools.lease --repo "$root/code" plans "$@" \
      > "$root/driver.log" 2>&1 < /dev/null &
    echo $! > "$root/driver.pid"
    say "plans $* started in the background (pid $!); logs in $root" ;;
  all|plans|list|check|train|bench|fault|ceiling|tbench|tprof) lease "$cmd" "$@" ;;
  status) status ;;
  pack) pack "$@" ;;
  poll) poll "$@" ;;
  *) sed -n '2,/^set -e/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
