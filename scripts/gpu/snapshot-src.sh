#!/usr/bin/env bash
# snapshot-src.sh REV: hybridrl's source as of commit REV in .gpu/src-REV/src, for a trainer tool's src-REV flag
# (run_reference.sh tbench/tprof): the commit before a change, measured beside it in one lease. Carry the folder
# with the call that runs it.
set -euo pipefail
rev=${1:?usage: scripts/gpu/snapshot-src.sh REV}
repo=$(cd "$(dirname "$0")/../.." && pwd)
git -C "$repo" rev-parse --verify -q "$rev^{commit}" > /dev/null || { echo "snapshot-src: no commit $rev" >&2; exit 2; }
out=$repo/.gpu/src-$rev
rm -rf "$out"
mkdir -p "$out"
git -C "$repo" archive "$rev" src | tar -x -C "$out"
echo "snapshot-src: $out/src ($(du -sh "$out" | cut -f1))"
