#!/usr/bin/env bash
# The GPU reference studies (config/gpu-h200.yaml, config/gpu-2xh200-moe.yaml) on one leased machine with
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
# Plans (see below): `full`, `rest`, `rest4` (rest on four GPUs) for gpu-h200; `moe`, `moe4` for the 8-layer
# MoE study; `moe4full` (`moe2full` on two GPUs: colocate only) for the 48-layer one; `verdict` (one GPU) for
# the replicated, interleaved engine verdict (config/gpu-h200-verdict.yaml); `trainer` (one GPU) for the
# trainer benchmark of issue 15 (bench/trainer-<shape>.json in the default study's dir). A later plan's study is
# prepared while the first plan runs. HYBRIDRL_RUN_TIMEOUT_S caps a run (default 1800). HYBRIDRL_ENVS_READY
# lets `start` come before the overlays are installed (see wait_for_envs). Every process a run starts is in
# its process group.
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
  PYTHONPATH=$ctl_path python3 -m hybridrl prepare-study --config "$config" --out "$ref"
  touch "$ref/setup.done"
  say "setup of $1 done"
}

# the controller's PYTHONPATH: in-process vLLM lives in the controller; Megatron's workers inherit it
controller_path() {
  local p=$ctl_path
  [[ $1 == vllm-inprocess* ]] && p="/tmp/envs/vllm:$p"
  [[ $1 == *-megatron* ]] && p="/tmp/envs/trainer:$p"
  echo "$p"
}

# run_of CFG: the run's id and its model folder, from its config file (cfg/<name>.json)
run_of() {
  python3 -c "import json,sys;c=json.load(open(sys.argv[1]));print(c['run_id'], sys.argv[2] + '/models/' + c['run']['model'])" \
    "$1" "$ref"
}

# train NAME [GPU]: one run; GPU empty = every GPU visible (split)
train() {
  local name=$1 gpu=${2:-} cfg="$ref/cfg/$1.json" rid model out pp
  if [ -n "${HYBRIDRL_DRY_RUN:-}" ]; then
    say "dry run: train $name on GPU ${gpu:-all}"
    [ -z "${HYBRIDRL_START_BARRIER:-}" ] || say "  meets the others at the start barrier $HYBRIDRL_START_BARRIER"
    return 0
  fi
  read -r rid model < <(run_of "$cfg")
  out="$ref/runs/$rid"
  # a rerun of the study resumes
  [ -f "$out/done.json" ] && { say "train $name already done"; barrier_release "$rid"; return 0; }
  mkdir -p "$out"
  pp=$(controller_path "$name")
  say "train $name ($rid) on GPU ${gpu:-all}"
  local rc=0
  ( if [ -n "$gpu" ]; then export CUDA_VISIBLE_DEVICES=$gpu; else unset CUDA_VISIBLE_DEVICES; fi
    cp "$cfg" "$out/config.json"
    PYTHONPATH=$pp timeout "${HYBRIDRL_RUN_TIMEOUT_S:-1800}" python3 -m hybridrl train --run-config "$cfg" --model "$model" \
      --data "$ref/data" --out "$out" --done "$out/done.json" --no-progress ) > "$out/train.log" 2>&1 || rc=$?
  barrier_release "$rid"
  say "train $name exit $rc ($(steps_in "$out") steps)"
}

# fault NAME GPU KILL_STEP TERM_STEP: one run through `hybridrl fault-run` (engine SIGKILL in KILL_STEP's rollout,
# SIGTERM in TERM_STEP's training, then started again); its judgement in bench/fault-NAME.json
fault() {
  local name=$1 gpu=$2 kill_at=$3 term_at=$4 cfg="$ref/cfg/$1.json" rid model out
  [ -n "${HYBRIDRL_DRY_RUN:-}" ] && { say "dry run: fault $name on GPU $gpu: engine kill in step $kill_at, SIGTERM in step $term_at"; return 0; }
  [ -f "$ref/bench/fault-$name.json" ] && { say "fault $name already done"; return 0; }
  read -r rid model < <(run_of "$cfg")
  out="$ref/runs/$rid"
  mkdir -p "$out" "$ref/bench" && cp "$cfg" "$out/config.json"
  say "fault $name ($rid) on GPU $gpu"
  local rc=0
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$(controller_path "$name") timeout "${HYBRIDRL_RUN_TIMEOUT_S:-1800}" \
    python3 -m hybridrl fault-run --kill-engine-at "$kill_at" --term-at "$term_at" --out "$ref/bench/fault-$name.json" \
    -- python3 -m hybridrl train --run-config "$cfg" --model "$model" --data "$ref/data" --out "$out" \
    --done "$out/done.json" --no-progress > "$out/train.log" 2>&1 || rc=$?
  say "fault $name exit $rc ($(steps_in "$out") steps)"
}

steps_in() {  # steps_in RUN_DIR: how many steps the run recorded; 0, quietly, before its first
  { wc -l < "$1/steps.jsonl"; } 2>/dev/null || echo 0
}

# barrier_release RUN_ID: a run that never reached the start barrier (already done, or died before the loop
# could say so) releases the runs waiting there (src/hybridrl/run/barrier.py)
barrier_release() {
  [ -n "${HYBRIDRL_START_BARRIER:-}" ] || return 0
  local dir=${HYBRIDRL_START_BARRIER%:*}
  [ -e "$dir/$1.ready" ] || [ -e "$dir/$1.gone" ] || touch "$dir/$1.gone"
}

# bench NAME GPU STEP [--set k=v]: the engine alone on step STEP's request set of that run, plus raw HTTP probes
bench() {
  local name=$1 gpu=$2 step=$3 cfg="$ref/cfg/$1.json" rid model pp
  [ -n "${HYBRIDRL_DRY_RUN:-}" ] && { say "dry run: bench $name step $step on GPU $gpu ${*:4}"; return 0; }
  shift 3
  read -r rid model < <(run_of "$cfg")
  [ -f "$ref/bench/$name.json" ] && { say "bench $name already done"; return 0; }
  pp=$(controller_path "$name")
  say "bench $name step $step on GPU $gpu $*"
  local rc=0
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$pp timeout 600 python3 -m hybridrl bench --run-config "$cfg" \
    --model "$model" --data "$ref/data" --run-dir "$ref/runs/$rid" --step "$step" \
    --repeats "${HYBRIDRL_BENCH_REPEATS:-3}" --probe "$@" \
    --out "$ref/bench/$name.json" > "$ref/bench/$name.log" 2>&1 || rc=$?
  say "bench $name exit $rc"
}

# Plans. Each sets `phases`, the names of arrays that run one after the other. A phase's array holds
# lanes that run side by side, each "GPUS|ITEM;ITEM;..." on its own GPUs (CUDA_VISIBLE_DEVICES; a run
# samples only those with NVML). An item is "train NAME [GPUS]" or "bench NAME STEP [ARGS]"; it gets its
# lane's GPUs unless it names its own. A plan may set `study` (a config under config/) and `gpus` (how many
# it needs). Order within a lane is priority: a lease that ends early keeps the runs that matter most.
# ceiling: the rollout client's ceiling on this host (python -m hybridrl client-ceiling), while nothing else runs
ceiling() {
  [ -n "${HYBRIDRL_DRY_RUN:-}" ] && { say "dry run: client ceiling"; return 0; }
  [ -f "$ref/bench/client-ceiling.json" ] && { say "client ceiling already measured"; return 0; }
  say "client ceiling"
  PYTHONPATH=$ctl_path python3 -m hybridrl client-ceiling --out "$ref/bench/client-ceiling.json" \
    > "$ref/bench/client-ceiling.log" 2>&1 || say "client ceiling exit $?"
}

# tbench SHAPE GPU TRAINER MICRO_BATCH [FLAG...]: the trainer benchmark (python -m hybridrl trainer-bench), one
# trainer in a process of its own; FLAGs (no-pack, varied, peft-lora) pass on as --FLAG, rK marks a replicate,
# src-REV runs hybridrl's source as of commit REV instead of the tree's (a before-and-after in one lease;
# scripts/gpu/snapshot-src.sh REV makes .gpu/src-REV, carried with the call), and all name the result:
# bench/trainer-SHAPE-TRAINER-mbN[-FLAG...].json
tbench() { trainer_tool trainer-bench trainer json "$@"; }

# tprof SHAPE GPU TRAINER MICRO_BATCH [FLAG...]: one update under torch.profiler (python -m hybridrl
# trainer-profile), its operator table in bench/profile-SHAPE-TRAINER-mbN[-FLAG...].txt
tprof() { trainer_tool trainer-profile profile txt "$@"; }

trainer_tool() {  # trainer_tool COMMAND PREFIX EXT SHAPE GPU TRAINER MICRO_BATCH [FLAG...]
  local cmd=$1 prefix=$2 ext=$3 shape=$4 gpu=$5 trainer=$6 mb=$7 name pid rc=0 flag args=() src=$repo/src
  shift 7
  name="$prefix-$shape-$trainer-mb$mb"
  # a flag rK only names replicate K of the same command (its own process and file); src-REV picks the source
  for flag in "$@"; do
    name+="-$flag"
    if [[ $flag =~ ^src-(.+)$ ]]; then src=$repo/.gpu/$flag/src; elif ! [[ $flag =~ ^r[0-9]+$ ]]; then args+=("--$flag"); fi
  done
  [ -n "${HYBRIDRL_DRY_RUN:-}" ] && { say "dry run: $cmd $shape $trainer mb $mb${*:+ $*} on GPU $gpu"; return 0; }
  [ -f "$src/hybridrl/__init__.py" ] || { say "$name: no hybridrl source at $src (scripts/gpu/snapshot-src.sh)"; return 1; }
  [ -f "$ref/bench/$name.$ext" ] && { say "$name already done"; return 0; }
  mkdir -p "$ref/bench" "$root/trainer-bench"
  say "$cmd $shape $trainer mb $mb${*:+ $*} on GPU $gpu"
  # a session of its own, killed whole afterwards: a benchmark killed by the host once left a worker holding
  # the GPU under the next one (results/reference/2026-11-24-h200-trainer)
  CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH="/tmp/envs/trainer:$ctl:$src" setsid timeout "${HYBRIDRL_TBENCH_TIMEOUT_S:-900}" \
    python3 -m hybridrl "$cmd" --shape "$shape" --trainer "$trainer" --micro-batch "$mb" "${args[@]}" \
    --workdir "$root/trainer-bench" --out "$ref/bench/$name.$ext" > "$ref/bench/$name.log" 2>&1 &
  pid=$!
  wait "$pid" || rc=$?
  kill -KILL -- "-$pid" 2> /dev/null || true
  say "$cmd $shape $trainer mb $mb${*:+ $*} exit $rc"
}

plan_full() {
  # the split pair first, side by side with their GPUs crossed so that no GPU holds two engines (the
  # engine takes the last visible GPU, the trainer cuda:0); it also fills the compile caches
  phases=(p1 p2 p3)
  p1=("0,1|train sglang-split" "1,0|train vllm-split")
  p2=("0|train sglang-colocate;train sglang-restart;train vllm-inprocess-restart;train sglang-colocate-megatron;bench sglang-colocate 3 --set sglang_release=all"
      "1|train vllm-colocate;train vllm-inprocess-colocate;train vllm-restart;train vllm-colocate-megatron;bench vllm-colocate 3")
  p3=("0,1|train sglang-colocate-megatron-tp2;train vllm-colocate-megatron-tp2")
}

plan_rest() {
  # after the first lease (5 of 8 HF runs): the restart runs, Megatron in the loop, the vLLM server again
  # with the adapter-reload fix, the standalone benchmarks, then TP 2
  phases=(p1 p2)
  p1=("0|train sglang-restart;train vllm-inprocess-restart;train sglang-colocate-megatron;bench sglang-colocate-megatron 3 --set sglang_release=all"
      "1|train vllm-restart;train vllm-colocate-megatron;train vllm-colocate;bench vllm-colocate 3")
  p2=("0,1|train sglang-colocate-megatron-tp2;train vllm-colocate-megatron-tp2;train vllm-split 1,0")
}

plan_rest4() {
  # `rest` on four GPUs: the three restart runs (5-8 min each) get a GPU each, the shorter runs share the
  # fourth; then the two-GPU runs on two pairs
  gpus=4
  phases=(p1 p2)
  p1=("0|train sglang-restart" "1|train vllm-restart"
      "2|train vllm-inprocess-restart;train vllm-colocate;bench vllm-colocate 3"
      "3|train vllm-colocate-megatron;train sglang-colocate-megatron;bench sglang-colocate-megatron 3 --set sglang_release=all")
  p2=("0,1|train sglang-colocate-megatron-tp2;train vllm-split" "2,3|train vllm-colocate-megatron-tp2")
}

plan_moe() {
  # config/gpu-2xh200-moe.yaml (issue 6 scaled to two GPUs): colocate in two lanes, then the split runs one
  # at a time, each with its engine on GPU 1 and its Megatron trainer on GPU 0
  study=config/gpu-2xh200-moe.yaml
  phases=(p1 p2)
  p1=("0|train sglang-colocate-megatron;train vllm-inprocess-colocate-megatron" "1|train vllm-colocate-megatron")
  p2=("0,1|train sglang-split-megatron;train vllm-split-megatron;train vllm-inprocess-split-megatron")
}

plan_moe4() {
  # the MoE study on four GPUs, one run a lane, so that every run meets the others of its phase at the start
  # barrier: the three colocate runs side by side, then the split pair, then in-process split
  study=config/gpu-2xh200-moe.yaml
  gpus=4
  phases=(p1 p2 p3)
  p1=("0|train sglang-colocate-megatron" "1|train vllm-colocate-megatron" "2|train vllm-inprocess-colocate-megatron")
  p2=("0,1|train sglang-split-megatron" "2,3|train vllm-split-megatron")
  p3=("0,1|train vllm-inprocess-split-megatron")
}

plan_moe2full() {
  # the 48-layer study on a two-GPU machine: only colocate fits (split needs two GPUs for each side), one
  # run at a time, those with the fewest committed steps first: on 2026-11-23 vLLM server ran 10 steps,
  # in-process vLLM 7; SGLang has 7 from the 4-GPU lease of 2026-11-22
  study=config/gpu-4xh200-moe.yaml
  phases=(p1)
  p1=("0,1|train sglang-colocate-megatron;train vllm-inprocess-colocate-megatron;train vllm-colocate-megatron")
}

plan_moe1full() {
  # issue 15's 48-layer colocate run on one H200 (config/gpu-h200-moefull.yaml: the engine at TP 1, the trainer's
  # base kept on the GPU, SGLang releasing its weights to a CPU copy): Megatron, then HF. Needs the `sglang` and
  # `trainer` overlays (the 61 GB checkpoint fits the 64 GiB disk beside them)
  study=config/gpu-h200-moefull.yaml
  one_lane "train sglang-colocate-megatron;train sglang-colocate"
}

plan_moe1vllm() {
  # the vLLM server in moe1full's layout (sleep level 1: its weights to CPU memory, as SGLang's full release), then
  # SGLang's second replicate beside it in the same lease. Needs the `sglang`, `vllm` and `trainer` overlays
  study=config/gpu-h200-moefull.yaml
  one_lane "train vllm-colocate-megatron;train sglang-colocate-megatron-r2"
}

plan_moe1pin() {
  # moe1full's engine pair again, SGLang's full release now keeping its pinned CPU copy of the weights between
  # sleeps (sglang_retain_cpu_backup), as the vLLM server's level 1 keeps its pinned buffers: SGLang, vLLM, SGLang's
  # second replicate, one lease. Needs the `sglang`, `vllm` and `trainer` overlays
  study=config/gpu-h200-moefull.yaml
  one_lane "train sglang-colocate-megatron;train vllm-colocate-megatron;train sglang-colocate-megatron-r2"
}

plan_moe1pin2() {
  # moe1pin's second replicates, in a later lease on another machine: SGLang's (moe1pin's was cut by the 30-minute
  # hold), then the vLLM server's, so that the 48-layer pair has two runs a side over two leases (interleaved: S V
  # in moe1pin, S V here). Needs the `sglang`, `vllm` and `trainer` overlays
  study=config/gpu-h200-moefull.yaml
  one_lane "train sglang-colocate-megatron-r2;train vllm-colocate-megatron-r2"
}

plan_moe4full() {
  # config/gpu-4xh200-moe.yaml (issue 6 at the write-up's shape, engines at TP 2; about 15 min a run): the
  # colocate pair side by side on the two GPU pairs, then split on all four, then in-process vLLM
  study=config/gpu-4xh200-moe.yaml
  gpus=4
  phases=(p1 p2)
  p1=("0,1|train sglang-colocate-megatron" "2,3|train vllm-colocate-megatron")
  p2=("0,1,2,3|train sglang-split-megatron;train vllm-split-megatron;train vllm-inprocess-colocate-megatron 0,1;train vllm-inprocess-split-megatron")
}

plan_client() {
  # issue 20 on one GPU: the client's ceiling on this host, then per HTTP engine the new-path colocate run and
  # the benchmark of its paths (raw, new, whole, stream-everything, old) on its step 3, then their old-path runs (the
  # HTTP client is what the issue measures, so a lease that ends early keeps those pairs), then in-process vLLM
  study=config/gpu-h200-client.yaml
  export HYBRIDRL_BENCH_REPEATS=5
  one_lane "ceiling;train sglang-new;bench sglang-new 3;train vllm-new;bench vllm-new 3;train sglang-old;train vllm-old;train vllm-inprocess-new;bench vllm-inprocess-new 3;train vllm-inprocess-old"
}

plan_timed() {
  # issue 20's next step on one GPU: per engine the dense colocate run with nothing streamed and the engine timing
  # every request itself (engine_timing), then `bench` on its step 3: raw, that path, and every request streamed
  # (the client's own TTFT and TPOT beside the engine's, on one engine start and request set); about 15 minutes
  study=config/gpu-h200-client.yaml
  export HYBRIDRL_BENCH_REPEATS=5
  local paths="--paths raw client stream_all"
  one_lane "train sglang-timed;bench sglang-timed 3 $paths;train vllm-timed;bench vllm-timed 3 $paths;train vllm-inprocess-timed;bench vllm-inprocess-timed 3 $paths"
}

plan_soak() {
  # issue 19 on one GPU: 50 colocate steps per engine, the asleep-memory gate on; about 10 minutes a run
  study=config/gpu-h200-soak.yaml
  one_lane "train sglang-soak;train vllm-soak;train vllm-inprocess-soak"
}

plan_faults() {
  # issue 19's fault runs on one GPU: per engine, its engine killed in step 2's rollout and SIGTERM in step 4's
  # training (then resumed); a few minutes a run, so it fits beside part of `soak` in a lease
  study=config/gpu-h200-soak.yaml
  one_lane "fault sglang-fault 2 4;fault vllm-fault 2 4;fault vllm-inprocess-fault 2 4"
}

plan_learning() {
  # issue 17 on one GPU (config/gpu-h200-learning.yaml; prepare warm-starts the model): 30 steps per engine
  # first (what the issue needs most), then the vocabulary measurement (short, rollout only, the two
  # vocabularies side by side per engine)
  study=config/gpu-h200-learning.yaml
  one_lane "train sglang-colocate;train vllm-colocate;train sglang-vocab-small;train sglang-vocab-qwen;train vllm-vocab-small;train vllm-vocab-qwen"
}

plan_learnentropy() {
  # learnlr's reading put to a measurement: with train/entropy in every step, SGLang's 50 steps at lr 1e-3, then its
  # 30 at learning's lr 1e-4 as the control (learnlr's run id; the control's id has changed since learning's lease,
  # its seed and prompts have not). Does the policy's
  # entropy fall faster at the higher rate, as a policy sharpening toward its greedy answers would? Then the HF
  # trainer's dense benchmark and profiled update: the profile's rows by input shape hold the entropy's own ops on
  # [.., vocab] chunks (it has no off switch to time against). Needs `sglang`
  study=config/gpu-h200-learning.yaml
  one_lane "train sglang-learn;train sglang-colocate;tbench qwen3-0.6b hf 32;tprof qwen3-0.6b hf 32"
}

plan_hffused() {
  # issue 15's HF dense target after the adapters' outputs moved inside their B matmul (hf_fast.fuse_lora_outputs):
  # PEFT's forward (peft-lora) and the fused one in one lease, fixed then varied lengths, Megatron's dense row
  # beside them, the fused update profiled; then learnentropy's owed lr 1e-4 control (learning's sglang-colocate,
  # entropy recorded, the fused HF trainer gated against SGLang's logprobs). Needs `sglang` and `trainer`
  study=config/gpu-h200-learning.yaml
  one_lane "tbench qwen3-0.6b hf 32 peft-lora;tbench qwen3-0.6b hf 32;tbench qwen3-0.6b megatron 32;tbench qwen3-0.6b hf 32 varied peft-lora;tbench qwen3-0.6b hf 32 varied;tprof qwen3-0.6b hf 32;train sglang-colocate"
}

plan_hfrounds() {
  # issue 15's dense rows in four interleaved rounds of one lease: the update is bound by the host's launches and its
  # median moved by tens of percent between processes of one configuration (results/reference/2026-11-25-h200-hffused),
  # so each configuration gets four processes: HF with PEFT's adapter forward and the fused one at 32 samples a
  # micro-batch, HF at 64, Megatron TP 1 at 32 and 64. Needs only the `trainer` overlay
  one_lane "$(tool_rounds 4 "tbench qwen3-0.6b hf 32 peft-lora" "tbench qwen3-0.6b hf 32" "tbench qwen3-0.6b hf 64" \
    "tbench qwen3-0.6b megatron 32" "tbench qwen3-0.6b megatron 64")"
}

plan_moerounds() {
  # issue 15's 48-layer rows (Qwen3-30B-A3B shape, 64 x 256, 16 samples a micro-batch, packed) as three interleaved
  # rounds of Megatron TP 1 then HF, one process each: the target (at most 1.9 s an update) was met by single
  # processes at 1.82 and 1.88 s, within the noise `hffused` showed between processes. Only the `trainer` overlay
  # (the 61 GB checkpoint needs the disk)
  one_lane "$(tool_rounds 3 "tbench qwen3-30b-a3b megatron 16" "tbench qwen3-30b-a3b hf 16")"
}

plan_moepermute() {
  # issue 15's 48-layer update after the MoE token permutation became gathers (trainers/megatron/dispatch.py): three
  # rounds of a Megatron TP 1 benchmark process with megatron's own permutation then one with the gathers (the wall
  # time, judged over processes on one host), then one profiled update of each (GPU kernel time: the wall time is
  # partly host-bound). Only the `trainer` overlay
  study=config/gpu-h200.yaml
  one_lane "$(tool_rounds 3 "tbench qwen3-30b-a3b megatron 16 megatron-permute" "tbench qwen3-30b-a3b megatron 16");\
tprof qwen3-30b-a3b megatron 16 megatron-permute;tprof qwen3-30b-a3b megatron 16"
}

plan_syncfree() {
  # issue 15 after the GRPO step stopped waiting for the GPU between micro-batches (trainers/grpo.py: every
  # micro-batch copied first, the readings summed on the device and read once): the commit before (src-ec2b5bd,
  # scripts/gpu/snapshot-src.sh) and the tree, interleaved in one lease. The 48-layer Megatron TP 1 update first
  # (three rounds), then both dense trainers (three rounds), then one profiled update of each shape's fastest trainer
  # with the host's remaining waits listed. Only the `trainer` overlay
  one_lane "$(tool_rounds 3 "tbench qwen3-30b-a3b megatron 16 src-ec2b5bd" "tbench qwen3-30b-a3b megatron 16");\
$(tool_rounds 3 "tbench qwen3-0.6b hf 32 src-ec2b5bd" "tbench qwen3-0.6b hf 32" "tbench qwen3-0.6b megatron 32 src-ec2b5bd" \
    "tbench qwen3-0.6b megatron 32");tprof qwen3-30b-a3b megatron 16;tprof qwen3-0.6b megatron 32;tprof qwen3-0.6b hf 32"
}

plan_syncfree2() {
  # syncfree again, its 48-layer rows interleaved from the first round (in syncfree the first copy of the code
  # lacked the snapshot, so the commit before ran rounds 1-3 after the change's rounds 1-2): four rounds of the
  # 48-layer Megatron TP 1 update from the commit before (src-ec2b5bd) and from the tree, then three of the dense HF
  # update, whose ratio syncfree also left open. Only the `trainer` overlay; about 24 minutes
  one_lane "$(tool_rounds 4 "tbench qwen3-30b-a3b megatron 16 src-ec2b5bd" "tbench qwen3-30b-a3b megatron 16");\
$(tool_rounds 3 "tbench qwen3-0.6b hf 32 src-ec2b5bd" "tbench qwen3-0.6b hf 32")"
}

plan_hfexport() {
  # the HF trainer's adapter export written by hybridrl (trainers/adapter_files.py: one copy to the host per dtype,
  # no model card) instead of PEFT's save_pretrained, against the commit before (src-c931dfb): the dense HF update,
  # export included, in five interleaved rounds (syncfree's HF export took 0.16-0.24 s of a 1.0-1.2 s update).
  # Only the `trainer` overlay; about 8 minutes
  one_lane "$(tool_rounds 5 "tbench qwen3-0.6b hf 32 src-c931dfb" "tbench qwen3-0.6b hf 32")"
}

plan_exportviews() {
  # both trainers' adapter export after the optimizer's moments became views of one host copy (one torch.save record
  # instead of one a tensor) and the HF trainer stopped walking PEFT's whole state dict each save, against 38fe1e5
  # (hfexport's tree; snapshot-src.sh 38fe1e5): the dense HF update in five interleaved rounds, then the 48-layer
  # Megatron TP 1 update in three (its export was 0.10-0.19 s of an update). Only the `trainer` overlay; about 20
  # minutes
  one_lane "$(tool_rounds 5 "tbench qwen3-0.6b hf 32 src-38fe1e5" "tbench qwen3-0.6b hf 32");\
$(tool_rounds 3 "tbench qwen3-30b-a3b megatron 16 src-38fe1e5" "tbench qwen3-30b-a3b megatron 16")"
}

plan_asyncstate() {
  # the optimizer state written on a thread after the update (trainers/adapter_files.StateWriter; the update ends
  # once the engine's files are written) against the commit before (src-5173bee), and exportviews' question, that
  # commit against 38fe1e5: the dense HF update in four interleaved rounds of the three, then the 48-layer Megatron
  # TP 1 update in three rounds of the commit before and the tree. Only the `trainer` overlay; about 20 minutes
  one_lane "$(tool_rounds 4 "tbench qwen3-0.6b hf 32 src-38fe1e5" "tbench qwen3-0.6b hf 32 src-5173bee" \
    "tbench qwen3-0.6b hf 32");$(tool_rounds 3 "tbench qwen3-30b-a3b megatron 16 src-5173bee" \
    "tbench qwen3-30b-a3b megatron 16")"
}

plan_exportstage() {
  # the adapter export through reused pinned host buffers (adapter_files.HostStaging) with the B norm as one fused
  # norm on the device, against the commit before (src-5bf06b5): exportprofile's 48-layer profile had the export's
  # three copies to fresh pageable memory take 55 ms of GPU time and the norm 30 ms. Three interleaved rounds of the
  # dense HF update, then two of the 48-layer Megatron TP 1 update. Only the `trainer` overlay; about 13 minutes
  one_lane "$(tool_rounds 3 "tbench qwen3-0.6b hf 32 src-5bf06b5" "tbench qwen3-0.6b hf 32");\
$(tool_rounds 2 "tbench qwen3-30b-a3b megatron 16 src-5bf06b5" "tbench qwen3-30b-a3b megatron 16")"
}

plan_learnlr() {
  # issue 17's open question on one GPU (config/gpu-h200-learning.yaml): 50 warm-started steps per engine at ten
  # times `learning`'s learning rate (1e-3), eval every 5 steps, SGLang then the vLLM server
  study=config/gpu-h200-learning.yaml
  one_lane "train sglang-learn;train vllm-learn"
}

plan_trainer() {
  # issue 15 on one GPU: the trainer benchmark, HF and Megatron TP 1 on a fixed batch, 5 updates after a
  # warm-up, one trainer a process (both in one held the 30B checkpoint twice over: killed by the host): the dense
  # 0.6B shape (128 x 256) at 32 samples a pass, then the 48-layer Qwen3-30B-A3B shape (64 x 256) at 16, the
  # most that fits (2026-11-24)
  one_lane "tbench qwen3-0.6b hf 32;tbench qwen3-0.6b megatron 32;tbench qwen3-30b-a3b hf 16;tbench qwen3-30b-a3b megatron 16"
}

plan_packing() {
  # issue 15, packed sequences: per shape both trainers packed (the default now) and padded (--no-pack) on
  # completions of varied length, then packed on the fixed lengths of `trainer`'s rows; one update of each
  # trainer on the dense shape under torch.profiler (Megatron's gap to HF); the 48-layer shape last (its model
  # build takes minutes)
  one_lane "tbench qwen3-0.6b hf 32 varied;tbench qwen3-0.6b megatron 32 varied;tbench qwen3-0.6b hf 32 varied no-pack;tbench qwen3-0.6b megatron 32 varied no-pack;tbench qwen3-0.6b hf 32;tbench qwen3-0.6b megatron 32;tprof qwen3-0.6b hf 32;tprof qwen3-0.6b megatron 32;tbench qwen3-30b-a3b hf 16 varied;tbench qwen3-30b-a3b megatron 16 varied;tbench qwen3-30b-a3b hf 16 varied no-pack;tbench qwen3-30b-a3b megatron 16 varied no-pack;tbench qwen3-30b-a3b megatron 16"
}

plan_trainerloop() {
  # issue 15 after the Megatron LoRA's matmuls moved to the activations' dtype: Megatron TP 1 packed on both
  # shapes (fixed lengths; dense also varied) with HF dense beside it in the same lease, its profiled update, a dense
  # SGLang colocate run with the Megatron trainer (packed, in the loop, its logprob gap gated against the engine)
  one_lane "tbench qwen3-0.6b megatron 32;tbench qwen3-0.6b hf 32;tbench qwen3-0.6b megatron 32 varied;tprof qwen3-0.6b megatron 32;train sglang-colocate-megatron;tbench qwen3-30b-a3b megatron 16"
}

plan_trainermoe() {
  # the 48-layer row that `trainerloop` lost to a full disk: Megatron TP 1 then HF on the MoE shape, packed, fixed
  # lengths, in a lease with only the `trainer` overlay (the 61 GB checkpoint fits the 64 GiB disk beside it)
  one_lane "tbench qwen3-30b-a3b megatron 16;tbench qwen3-30b-a3b hf 16"
}

plan_trainerfuse() {
  # issue 15 after the trainers' launch cuts (Megatron: one LoRA site per base linear, RoPE tables once per forward,
  # norms in the model's dtype; HF: no fp32 copy of each adapter input): Megatron TP 1 and HF on the dense shape in
  # one lease, fixed and varied lengths, both profiled, then a dense SGLang colocate run with the Megatron trainer
  # (its logprobs gated against the engine's). The 48-layer rows are `trainermoe` (their 61 GB checkpoint and the
  # SGLang overlay do not share the disk)
  one_lane "tbench qwen3-0.6b megatron 32;tbench qwen3-0.6b hf 32;tbench qwen3-0.6b megatron 32 varied;tbench qwen3-0.6b hf 32 varied;tprof qwen3-0.6b megatron 32;tprof qwen3-0.6b hf 32;train sglang-colocate-megatron"
}

plan_trainerfast() {
  # issue 15 after HF's norms went through torch's fused kernel: both trainers on both shapes in one lease with
  # only the `trainer` overlay (dense fixed and varied lengths, HF's update profiled, then the 48-layer rows)
  one_lane "tbench qwen3-0.6b megatron 32;tbench qwen3-0.6b hf 32;tbench qwen3-0.6b megatron 32 varied;tbench qwen3-0.6b hf 32 varied;tprof qwen3-0.6b hf 32;tbench qwen3-30b-a3b megatron 16;tbench qwen3-30b-a3b hf 16"
}

# one_lane ITEMS: a plan of one phase whose one lane holds GPU 0 ("ITEM;ITEM;...", as a lane takes them)
one_lane() { gpus=1; phases=(p1); p1=("0|$1"); }

# replica ARM K: the run name of replicate K of ARM (the first keeps the plain name, as the study's run ids do)
replica() { if (($2 > 1)); then echo "$1-r$2"; else echo "$1"; fi; }

# interleave ROUNDS ARM...: "train ARM" items round by round (A B C A B C ...), replicate k > 1 as ARM-rK, so
# that a slow drift of the host falls on every arm alike and a lease that ends early keeps whole rounds
interleave() {
  local rounds=$1 k arm out=()
  shift
  for ((k = 1; k <= rounds; k++)); do
    for arm in "$@"; do out+=("train $(replica "$arm" "$k")"); done
  done
  (IFS=';'; echo "${out[*]}")
}

# tool_rounds ROUNDS ITEM...: tbench/tprof items round by round (A B A B ...), each marked rK (replicate K), so that
# every configuration gets ROUNDS processes of its own and a drift of the host falls on all of them alike
tool_rounds() {
  local rounds=$1 k item out=()
  shift
  for ((k = 1; k <= rounds; k++)); do
    for item in "$@"; do out+=("$item r$k"); done
  done
  (IFS=';'; echo "${out[*]}")
}

plan_verdict() {
  # issue 16 on one GPU (config/gpu-h200-verdict.yaml), first lease: the headline pair, SGLang and the vLLM server,
  # each releasing weights and KV cache, three replicates each, interleaved round by round, one run at a time with
  # nothing else on the host; then each engine's standalone benchmark, 5 repeats, on step 3's request set (the same
  # in every replicate), raw against the run's client only (the client lease measured the other paths); the
  # client's ceiling last. Two arms, not three: with each engine's first start on a bare host, three arms x three
  # rounds take about 30 minutes before any benchmark, more than a lease holds
  local vpaths="--paths raw client"
  study=config/gpu-h200-verdict.yaml
  export HYBRIDRL_BENCH_REPEATS=5
  one_lane "$(interleave 3 sglang-full vllm-server);bench sglang-full 3 $vpaths;bench vllm-server 3 $vpaths;ceiling"
}

plan_timingcost() {
  # issue 20's open question on one GPU (config/gpu-h200-verdict.yaml): SGLang with nothing streamed, its own
  # request timing off and on (engine_timing forces its stream interval to 1), two replicates each, interleaved
  study=config/gpu-h200-verdict.yaml
  one_lane "$(interleave 2 sglang-untimed sglang-timed)"
}

plan_verdictpin() {
  # the headline pair again (config/gpu-h200-verdict.yaml), SGLang's full release now keeping its pinned CPU copy of
  # the weights from one sleep to the next (sglang_retain_cpu_backup), as vLLM's level 1 keeps its pinned buffers;
  # `verdict` ran SGLang re-pinning the copy every sleep. Three replicates each, interleaved; no benchmarks (the
  # runs' client was measured in `verdict`)
  study=config/gpu-h200-verdict.yaml
  one_lane "$(interleave 3 sglang-full vllm-server)"
}

plan_verdictwarm() {
  # issue 16's headline pair on issue 17's model (config/gpu-h200-learning.yaml; prepare warm-starts it): SGLang's
  # full release (pinned copy kept) and the vLLM server at level 1, three replicates each, interleaved, 10 steps a
  # run, rollouts stopping at EOS; no benchmarks
  study=config/gpu-h200-learning.yaml
  one_lane "$(interleave 3 sglang-verdict vllm-verdict)"
}

plan_verdictkv() {
  # issue 16, second lease: in-process vLLM (level 1) and SGLang's KV-only release, an arm of its own (its sleep and
  # wake move other bytes than any other arm's), three replicates each, interleaved, then their benchmarks; their
  # comparisons with the first lease's arms span two leases, which the report's caveats say
  local vpaths="--paths raw client"
  study=config/gpu-h200-verdict.yaml
  export HYBRIDRL_BENCH_REPEATS=5
  one_lane "$(interleave 3 vllm-inprocess sglang-kv);bench vllm-inprocess 3 $vpaths;bench sglang-kv 3 $vpaths"
}

plan_placement() {
  # issue 18 on two GPUs (config/gpu-2xh200-placement.yaml): one round of the six arms, round HYBRIDRL_ROUND
  # (default 1; replicate K is ARM-rK), one run at a time: colocate on GPU 0, split and overlap with the engine on
  # GPU 1 and the trainer on GPU 0; the engines alternate so that a drift of the host falls on both. About 20
  # minutes, so one lease a round, each holding every comparison of its round
  study=config/gpu-2xh200-placement.yaml
  gpus=2
  local k=${HYBRIDRL_ROUND:-1} arm items=()
  for arm in sglang-colocate vllm-colocate; do items+=("train $(replica "$arm" "$k") 0"); done
  for arm in sglang-split vllm-split sglang-overlap vllm-overlap; do items+=("train $(replica "$arm" "$k")"); done
  phases=(p1)
  p1=("0,1|$(IFS=';'; echo "${items[*]}")")
}

plan_overlap1() {
  # issue 18's overlapped split on one GPU, shared by engine and trainer (config/gpu-h200-overlap.yaml): a check of
  # behaviour before the two-GPU study, no placement figure. Per engine with the HF trainer a run, then a fault run
  # (the engine killed while step 3's rollout runs ahead, SIGTERM in step 5's training), then with Megatron TP 1
  study=config/gpu-h200-overlap.yaml
  one_lane "train sglang-overlap;train vllm-overlap;fault sglang-overlap-fault 3 5;fault vllm-overlap-fault 3 5;\
train sglang-overlap-megatron;train vllm-overlap-megatron"
}

plan_placement1() {
  # issue 18's placement question on one GPU (config/gpu-h200-placement1.yaml): per engine, colocate (taking turns,
  # everything released) against overlap (both resident, step k+1's rollout beside step k's training), two
  # replicates interleaved round by round, one run at a time; about 22 minutes with each engine's first start
  study=config/gpu-h200-placement1.yaml
  one_lane "$(interleave 2 sglang-colocate vllm-colocate sglang-overlap vllm-overlap)"
}

plan_placement1v() {
  # placement1's third replicate of the vLLM server's pair (colocate, then overlap), in a lease of its own: needs
  # only the `vllm` overlay
  study=config/gpu-h200-placement1.yaml
  one_lane "train vllm-colocate-r3;train vllm-overlap-r3"
}

plan_placement1s() {
  # placement1's third replicate of SGLang's pair (colocate, then overlap), in a lease of its own as placement1v was
  # for the vLLM server: needs only the `sglang` overlay
  study=config/gpu-h200-placement1.yaml
  one_lane "train sglang-colocate-r3;train sglang-overlap-r3"
}

plan_placementlong() {
  # issue 18's drift runs: 30 overlapped steps per engine, one after the other (about 8 minutes each)
  study=config/gpu-2xh200-placement.yaml
  gpus=2
  phases=(p1)
  p1=("0,1|train sglang-overlap-long;train vllm-overlap-long")
}

item() {  # item GPUS WORDS...: one plan item; GPUS is the lane's, used where the item names none
  local gpu=$1 what=$2 name=${3:-}
  shift $(($# < 3 ? $# : 3))
  case $what in
    train) train "$name" "${1:-$gpu}" ;;
    bench) bench "$name" "$gpu" "$@" ;;
    ceiling) ceiling ;;
    fault) fault "$name" "$gpu" "$@" ;;
    tbench) tbench "$name" "$gpu" "$@" ;;
    tprof) tprof "$name" "$gpu" "$@" ;;
    *) echo "unknown plan item: $what" >&2; return 2 ;;
  esac
}

# HYBRIDRL_SKIP="RUN RUN ...": items of these runs are left out, so that a lease can take the rest of a plan that
# an earlier lease began (for example `HYBRIDRL_SKIP=sglang-fault start faults soak`)
skipped() {  # skipped ITEM: true where the item's run is in HYBRIDRL_SKIP
  local words
  read -ra words <<< "$1"
  [ "${#words[@]}" -ge 2 ] && [[ " ${HYBRIDRL_SKIP:-} " == *" ${words[1]} "* ]]
}

lane() {  # lane "GPUS|ITEM;ITEM;...": the items one after the other, a snapshot after each
  local gpu=${1%%|*} items it
  IFS=';' read -ra items <<< "${1#*|}"
  for it in "${items[@]}"; do
    if skipped "$it"; then say "skipped: $it (HYBRIDRL_SKIP)"; continue; fi
    # shellcheck disable=SC2086
    item "$gpu" $it
    # only a lane's first run meets the others at the start barrier
    [[ $it == train* ]] && unset HYBRIDRL_START_BARRIER
    snapshot
  done
}

load_plan() {  # load_plan PLAN: sets the caller's `study`, `gpus` and `phases` (defaults, then the plan's)
  declare -F "plan_$1" > /dev/null || { echo "no plan named $1 ($(known_plans))" >&2; exit 2; }
  study=$default_study gpus=2 phases=()
  "plan_$1"
}

study_of() {  # study_of PLAN: prints the plan's study config
  local study gpus phases
  load_plan "$1"
  echo "$study"
}

run_plans() {  # run_plans PLAN...: one after the other; studies not yet set up are prepared meanwhile
  local p c preps=() started=" "
  for p in "$@"; do
    c=$(study_of "$p")
    # once per study, even where several plans share it
    [ -f "$(study_dir "$c")/setup.done" ] || [[ $started == *" $c "* ]] && continue
    started+="$c "
    # few threads: runs being measured share this host's CPUs with the model build
    ( export OMP_NUM_THREADS=${HYBRIDRL_PREP_THREADS:-8}; prepare "$c" ) \
      > "$root/prepare-$(basename "$c" .yaml).log" 2>&1 &
    preps+=($!)
  done
  wait_for_envs
  for p in "$@"; do
    c=$(study_of "$p")
    # a study being prepared is waited for (its log says why, if it fails)
    [ -f "$(study_dir "$c")/setup.done" ] || wait "${preps[@]}" || true
    ( all "$p" ) || say "plan $p stopped (exit $?)"
  done
  say "plans done: $*"
}

# With HYBRIDRL_ENVS_READY=FILE, `start` may come before the engine overlays are installed: the studies are
# prepared (the 48-layer model takes minutes) while the overlays travel, and the runs wait for FILE, which the
# lease's last transfer call touches after `gpu-env install`; HYBRIDRL_ENVS_WAIT_S at most. The default, 600 s,
# is four times what 16 transfers and the install took on 2026-11-23 (2.4 min): a lease whose transfers were
# refused then gives up after 10 minutes, not 20, and its polls return at once with the rest of the budget.
wait_for_envs() {
  local f=${HYBRIDRL_ENVS_READY:-} limit=${HYBRIDRL_ENVS_WAIT_S:-600} waited=0
  [ -n "$f" ] || return 0
  [ -e "$f" ] || say "waiting for the engine overlays ($f)"
  while [ ! -e "$f" ]; do
    [ "$waited" -lt "$limit" ] || { say "no $f after ${limit} s: the engine overlays were never installed"; exit 1; }
    sleep 1; waited=$((waited + 1))
  done
}

# check_names PLAN: refuses, in one line, a plan whose train, bench or fault item names no run of its study (such an
# item would fail only when its turn came, after the runs before it)
check_names() {
  local study gpus phases phase l it words tmp names bad=() w src=()
  load_plan "$1"
  use_study "$study"
  tmp=$(mktemp -d)
  PYTHONPATH=$ctl_path python3 -m hybridrl prepare-study --config "$config" --out "$tmp" --configs-only > /dev/null ||
    { echo "cannot list the runs of $study (python3 -m hybridrl prepare-study failed: run \`$0 controller\` first?)" >&2
      exit 2; }
  names=" $(cd "$tmp/cfg" && ls | sed 's/\.json$//' | tr '\n' ' ')"
  rm -rf "$tmp"
  for phase in "${phases[@]}"; do
    declare -n lanes=$phase
    for l in "${lanes[@]}"; do
      IFS=';' read -ra items <<< "${l#*|}"
      for it in "${items[@]}"; do
        read -ra words <<< "$it"
        [[ ${words[0]} =~ ^(train|bench|fault)$ && $names != *" ${words[1]} "* ]] && bad+=("${words[1]}")
        for w in "${words[@]}"; do
          [[ $w =~ ^src-.+$ && ! -f $repo/.gpu/$w/src/hybridrl/__init__.py ]] && src+=("$w")
        done
      done
    done
    unset -n lanes
  done
  [ "${#bad[@]}" -eq 0 ] || { echo "plan $1 names runs its study ($study) does not have: ${bad[*]} (it has:$names)" >&2; exit 2; }
  [ "${#src[@]}" -eq 0 ] || { echo "plan $1 runs source snapshots $repo/.gpu lacks: $(printf '%s\n' "${src[@]}" | sort -u | tr '\n' ' ')(scripts/gpu/snapshot-src.sh REV, carried with the call)" >&2; exit 2; }
}

known_plans() { declare -F | awk '$3 ~ /^plan_/ {sub("plan_", "", $3); printf "%s ", $3}'; }

all() {
  local plan=${1:-full} study gpus phases n=0 have
  load_plan "$plan"
  check_names "$plan"
  use_study "$study"
  [ -f "$ref/setup.done" ] || { echo "run setup first ($ref/setup.done is missing): \`$0 setup WHEELS_DIR" \
    "$study\` builds its data and models; a dry run checks only that the marker is there (docs/gpu.md)" >&2; exit 1; }
  if [ -z "${HYBRIDRL_DRY_RUN:-}" ]; then
    have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [ "$have" -ge "$gpus" ] || { echo "plan $plan needs $gpus GPUs, this machine has $have" >&2; exit 2; }
  fi
  say "study start (plan $plan, $study)"
  local phase lanes pids l parties barrier
  for phase in "${phases[@]}"; do
    declare -n lanes=$phase
    pids=()
    # the lanes' first runs start their steps together, once all are up: a run's start (weights, compile,
    # conversion) slows the steps of runs beside it (results/reference/2026-11-22-4xh200-moe)
    parties=0
    for l in "${lanes[@]}"; do [[ ${l#*|} == train* ]] && parties=$((parties + 1)); done
    barrier="$ref/barrier/$plan-$phase"
    rm -rf "$barrier" && mkdir -p "$barrier"
    [ "$parties" -gt 1 ] && say "$phase: start barrier of $parties runs ($barrier)"
    for l in "${lanes[@]}"; do
      n=$((n + 1))
      say "lane $n: ${l%%|*}"
      ( [ "$parties" -gt 1 ] && export HYBRIDRL_START_BARRIER="$barrier:$parties"
        lane "$l" ) > "$ref/lane-$plan-$n.log" 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}" || true
    unset -n lanes
    say "$phase done"
  done
  say "study done"
  touch "$ref/all.done"
}

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

snapshot() {  # what finished, every study, as $root/latest.tar.gz, replaced atomically (lanes run at once)
  local tmp
  tmp=$(mktemp "$root/.latest.XXXXXX")
  pack "$tmp" > /dev/null && mv -f "$tmp" "$root/latest.tar.gz"
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
    [ $# -gt 0 ] || { echo "usage: run_reference.sh start PLAN [PLAN...] ($(known_plans))" >&2; exit 2; }
    for p in "$@"; do study_of "$p" > /dev/null; check_names "$p"; done
    # the leased machine's copy of the tree may sit on a .git that is not its own: name the commit here
    [ -n "${HYBRIDRL_GIT_COMMIT:-}" ] || say "warning: HYBRIDRL_GIT_COMMIT is not set; provenance takes the" \
      "commit from this checkout's .git, which may not be the code that travelled (source_sha256 still is)"
    # run from a snapshot of the code, so that later edits to the checkout cannot reach a running study
    rm -rf "$root/code" && mkdir -p "$root/code"
    cp -r "$repo"/{src,config,workflow,scripts} "$root/code/"
    # the source snapshots a plan's src-REV items run (check_names found them all)
    if compgen -G "$repo/.gpu/src-*" > /dev/null; then mkdir -p "$root/code/.gpu" && cp -r "$repo"/.gpu/src-* "$root/code/.gpu/"; fi
    PYTHONPATH="$ctl:$root/code/src" python3 -c "import hybridrl.run.loop, hybridrl.tools.engine_bench, hybridrl.engines.sglang"
    setsid nohup bash "$root/code/scripts/gpu/run_reference.sh" plans "$@" > "$root/driver.log" 2>&1 < /dev/null &
    echo $! > "$root/driver.pid"
    say "plans $* started in the background (pid $!); logs in $root" ;;
  plans) run_plans "$@" ;;
  all) all "$@" ;;
  train|bench|tbench|tprof) use_study "${HYBRIDRL_STUDY:-$default_study}"; "$cmd" "$@" ;;
  status) status ;;
  pack) pack "$@" ;;
  poll) poll "$@" ;;
  *) sed -n '2,/^set -e/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
