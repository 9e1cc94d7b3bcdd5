#!/usr/bin/env bash
# Here, before a GPU lease: pack the SGLang, vLLM and trainer overlays and lay out one carry folder per
# part (.gpu/x00 ... .gpu/xNN, each with gpu-env and its own part), so that the transfer calls follow each
# other with no work in between (a machine left idle for 30 s is given back). See docs/gpu.md.
#
#   scripts/gpu/prepare-transfer.sh [SHARED_GPU_DIR]    # default ../shared/gpu
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
shared=${1:-$repo/../shared/gpu}
[ -x "$shared/gpu-env" ] || { echo "prepare-transfer: no gpu-env in $shared" >&2; exit 2; }
cd "$repo"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
if ! ls .gpu/parts/part.* > /dev/null 2>&1; then
  bash "$shared/gpu-env" pack .gpu/parts sglang vllm trainer   # about 3 minutes, 943 MB
fi
rm -rf .gpu/x[0-9][0-9]
for part in .gpu/parts/part.*; do
  n=${part##*.}
  mkdir -p ".gpu/x$n"
  cp "$shared/gpu-env" ".gpu/x$n/"
  ln "$part" ".gpu/x$n/" 2>/dev/null || cp "$part" ".gpu/x$n/"
done
ls -d .gpu/x[0-9][0-9] | tr '\n' ' '; echo
