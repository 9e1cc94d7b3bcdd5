#!/usr/bin/env bash
# Here, around a GPU lease's transfer calls: every device call carries the working tree, and the committed results
# (results/reference, about 31 of the tree's 33 MB on 2026-11-27) leave each overlay part only 26 MB of the 64 MiB
# a call may carry: 36 transfer calls for `sglang vllm`, about 7 minutes of held time. Out of the tree they leave
# 60 MB parts: 16 calls, done with the install 2.4 minutes into the lease (2026-11-27). Nothing on the machine
# reads them.
#
#   scripts/gpu/lean-tree.sh off   # before prepare-transfer.sh: results/reference moves to .gpu/reference-stash
#                                  # (ignored, so it travels with no call) and leaves the index, files untouched
#   scripts/gpu/lean-tree.sh on    # after the last transfer call: back in place and in the index
#
# While it is off the index shows the results as deleted: commit nothing until `on` (it refuses to go off with
# uncommitted changes there, so `on` restores exactly what HEAD holds).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
cd "$repo"
ref=results/reference
stash=${HYBRIDRL_GPU_DIR:-$repo/.gpu}/reference-stash
case ${1:-} in
  off)
    if [ -e "$stash" ]; then
      echo "lean-tree: $stash exists already: the results are off; run \`$0 on\` first" >&2; exit 2
    fi
    if [ -n "$(git status --porcelain -- "$ref")" ]; then
      echo "lean-tree: $ref has uncommitted changes; commit them first (the stash must match HEAD)" >&2; exit 2
    fi
    mkdir -p "$(dirname "$stash")"
    git rm -r -q --cached -- "$ref"
    mv "$ref" "$stash"
    echo "lean-tree: $ref moved to $stash; run \`$0 on\` after the transfer calls"
    ;;
  on)
    if [ ! -d "$stash" ]; then
      echo "lean-tree: no $stash: the results are in place already" >&2; exit 2
    fi
    if [ -e "$ref" ]; then
      echo "lean-tree: $ref exists beside the stash $stash; move one of them by hand" >&2; exit 2
    fi
    mv "$stash" "$ref"
    git reset -q -- "$ref"
    echo "lean-tree: $ref back in place"
    ;;
  *)
    echo "usage: $0 off|on" >&2; exit 2
    ;;
esac
