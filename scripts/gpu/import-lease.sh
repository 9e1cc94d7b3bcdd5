#!/usr/bin/env bash
# Here, after a lease: what a poll returned (latest.tar.gz) becomes results/reference/NAME: one study's runs with
# their request records gzipped, the driver's, lanes' and preparation's logs, the benchmarks and any warm-start
# record, then the tidy table, the report and its plots. Commit the folder at once; write its README after.
#
#   scripts/gpu/import-lease.sh TARBALL STUDY NAME   # e.g. /work/.device/3/latest.tar.gz gpu-h200-learning \
#                                                    #      2026-11-25-h200-verdictwarm2
# NAME with a slash is a folder of its own choosing (tests). An existing folder is never written into, and the
# folder appears only when complete (built beside it as NAME.partial, which a failure removes).
set -euo pipefail
shopt -s nullglob
die() { echo "import-lease: $*" >&2; exit 2; }
[ $# -eq 3 ] || die "usage: import-lease.sh TARBALL STUDY NAME (got $# arguments)"
tarball=$1 study=$2 name=$3
repo=$(cd "$(dirname "$0")/../.." && pwd)
case $name in */*) dest=$(realpath -m "$name") ;; *) dest=$repo/results/reference/$name ;; esac
py=${HYBRIDRL_PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
[ -f "$tarball" ] || die "no file $tarball"
[ -e "$dest" ] && die "$dest exists: nothing written (move it away, or pick another NAME)"
tmp=$(mktemp -d)
final=$dest
dest=$final.partial
rm -rf "$dest"
trap 'rm -rf "$tmp" "$dest"' EXIT
tar xzf "$tarball" -C "$tmp" 2>/dev/null || die "$tarball is not a gzipped tar (a poll's latest.tar.gz)"
src=$tmp/ref/$study
held=$(ls "$tmp/ref" 2>/dev/null | grep -v '\.log$' | tr '\n' ' ' || true)
[ -d "$src" ] || die "no study $study in $tarball; it holds: ${held% }"
mkdir -p "$dest/logs"
cp -r "$src/runs" "$dest/runs"
[ -n "$(ls -A "$src/bench" 2>/dev/null)" ] && cp -r "$src/bench" "$dest/bench"
warm=("$src"/models/*/warm_start.json)
if [ "${#warm[@]}" -eq 1 ]; then  # one model: model/warm_start.json, as the committed studies keep it
  mkdir -p "$dest/model" && cp "${warm[0]}" "$dest/model/"
else
  for w in "${warm[@]}"; do
    m=$(basename "$(dirname "$w")")
    mkdir -p "$dest/models/$m" && cp "$w" "$dest/models/$m/"
  done
fi
logs=("$src"/*.log "$tmp"/ref/*.log)
[ "${#logs[@]}" -eq 0 ] || cp "${logs[@]}" "$dest/logs/"
cd "$dest"
runs=(runs/*/steps.jsonl)
if [ "${#runs[@]}" -gt 0 ]; then  # a run that died before its first step has logs only: kept, not aggregated
  dirs=("${runs[@]%steps.jsonl}")
  "$py" -m hybridrl compact "${dirs[@]}"
  "$py" -m hybridrl aggregate --runs "${dirs[@]}" --csv steps.csv --parquet "$tmp/steps.parquet"
  "$py" -m hybridrl report --table steps.csv --md report.md --html "$tmp/report.html" --plots plots
fi
cd "$repo"
mv "$dest" "$final"
echo "import-lease: $final (${#runs[@]} runs with steps); commit it now: git add -f $final"
