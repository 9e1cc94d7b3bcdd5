#!/usr/bin/env bash
# The deployment without Apptainer: the same pins as containers/*.def, installed into one virtual
# environment per backend from an offline wheelhouse, because compute nodes often have no network.
#
#   login node (network):       bash scripts/wheelhouse.sh download [DIR]        # default: wheelhouse/
#   where the runs will run:    bash scripts/wheelhouse.sh install [BACKEND...]  # sglang vllm (default both)
#                               HYBRIDRL_DEPLOY=venv snakemake --profile slurm
#
# `install` needs no network: pip reads only DIR. It creates .venvs/gpu-<backend> with CPython 3.12
# (PYTHON=python3.12 by default) and checks the pinned versions. The train rules put the run's
# backend environment first on PATH (workflow/rules/common.smk). The wheels target Linux x86_64 and
# CPython 3.12, so `download` works from any login node, whatever its own Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PINS=containers/pins
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu130}
PYTHON=${PYTHON:-python3.12}
BACKENDS=(sglang vllm)

target=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:)
for n in 17 24 27 28 31 34 35; do target+=(--platform "manylinux_2_${n}_x86_64"); done
target+=(--platform manylinux2014_x86_64 --platform linux_x86_64 --platform any)

download() {
  local dir=${1:-wheelhouse}
  mkdir -p "$dir"
  echo "wheelhouse: base (torch 2.11.0+cu130 and its dependencies) -> $dir"
  python3 -m pip download -q "${target[@]}" --extra-index-url "$TORCH_INDEX" -d "$dir" -r "$PINS/base.txt"
  local b
  for b in "${BACKENDS[@]}" trainer; do
    echo "wheelhouse: $b overlay -> $dir"
    # the overlay lists are complete and pin different versions of shared packages: no resolver
    python3 -m pip download -q "${target[@]}" --no-deps -d "$dir" -r "$PINS/$b.txt"
  done
  echo "wheelhouse: hybridrl -> $dir"
  python3 -m pip wheel -q --no-deps -w "$dir" .
  cp "$PINS"/*.txt "$dir"/
  du -sh "$dir"
}

install_one() {
  local b=$1 dir=$2 venv=.venvs/gpu-$1
  [ -f "$PINS/$b.txt" ] || { echo "wheelhouse: unknown backend $b (known: ${BACKENDS[*]})" >&2; exit 2; }
  command -v "$PYTHON" >/dev/null || { echo "wheelhouse: $PYTHON not found (megatron-core needs 3.12)" >&2; exit 1; }
  echo "wheelhouse: $venv from $dir (no network)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --no-index --find-links "$dir" --disable-pip-version-check)
  "${pip[@]}" -r "$dir/base.txt"
  "${pip[@]}" --no-deps -r "$dir/$b.txt" -r "$dir/trainer.txt"
  "${pip[@]}" --no-deps hybridrl
  local tf
  tf=$(grep -i '^transformers==' "$dir/$b.txt" | cut -d= -f3)
  "$venv/bin/python" - "$b" "$(grep -i "^$b==" "$dir/$b.txt" | cut -d= -f3)" "$tf" <<'PY'
import importlib.metadata as md
import sys

backend, version, transformers = sys.argv[1:]
want = {"torch": "2.11.0+cu130", backend: version, "megatron-core": "0.19.2", "transformers": transformers}
bad = {name: md.version(name) for name, v in want.items() if md.version(name) != v}
if bad:
    raise SystemExit(f"wheelhouse: not the pinned versions: {bad}")
print(f"wheelhouse: {backend} environment ok: {want}")
PY
}

case "${1:-}" in
  download) download "${2:-wheelhouse}" ;;
  install)
    shift
    dir=${WHEELHOUSE:-wheelhouse}
    [ -d "$dir" ] || { echo "wheelhouse: no $dir; run \`bash scripts/wheelhouse.sh download\` on the login node" >&2; exit 1; }
    [ $# -gt 0 ] || set -- "${BACKENDS[@]}"
    for b in "$@"; do install_one "$b" "$dir"; done
    ;;
  *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
