#!/usr/bin/env bash
# Here, after a lease: what a poll returned (latest.tar.gz) becomes results/reference/NAME: one study's runs with
# their request records gzipped, the driver's, lanes' and preparation's logs, the benchmarks and any warm-start
# record, then the tidy table, the report and its plots. Commit the folder at once; write its README after.
#
#   scripts/gpu/import-lease.sh TARBALL STUDY NAME   # e.g. /work/.device/3/latest.tar.gz gpu-h200-learning \
#                                                    #      2026-11-25-h200-verdictwarm2
#   scripts/gpu/import-lease.sh --add LABEL TARBALL STUDY NAME   # a later lease's runs (a study's next round)
#                                                    # added to the existing NAME: its logs as *-LABEL.log, its warm
#                                                    # start as warm_start-LABEL.json, the table and report anew
# NAME with a slash is a folder of its own choosing (tests). Without --add an existing folder is never written
# into; with it, a run the folder already holds stops the import. Either way the folder changes only when complete
# (built beside it as NAME.partial, which a failure removes).
set -euo pipefail
shopt -s nullglob
die() { echo "import-lease: $*" >&2; exit 2; }
label=
if [ "${1:-}" = --add ]; then
  [ $# -eq 5 ] || die "usage: import-lease.sh --add LABEL TARBALL STUDY NAME (got $(($# - 1)) arguments after --add)"
  label=$2
  [[ $label =~ ^[A-Za-z0-9][A-Za-z0-9._]*$ ]] || die "LABEL '$label' is not a plain word (letters, digits, . and _)"
  shift 2
fi
[ $# -eq 3 ] || die "usage: import-lease.sh TARBALL STUDY NAME (got $# arguments)"
tarball=$1 study=$2 name=$3
repo=$(cd "$(dirname "$0")/../.." && pwd)
case $name in */*) dest=$(realpath -m "$name") ;; *) dest=$repo/results/reference/$name ;; esac
py=${HYBRIDRL_PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
[ -f "$tarball" ] || die "no file $tarball"
if [ -z "$label" ]; then
  [ -e "$dest" ] && die "$dest exists: nothing written (move it away, or pick another NAME)"
else
  [ -d "$dest/runs" ] || die "$dest holds no runs to add to: nothing written (import without --add)"
fi
tmp=$(mktemp -d)
final=$dest
dest=$final.partial
rm -rf "$dest"
trap 'rm -rf "$tmp" "$dest"' EXIT
tar xzf "$tarball" -C "$tmp" 2>/dev/null || die "$tarball is not a gzipped tar (a poll's latest.tar.gz)"
src=$tmp/ref/$study
held=$(ls "$tmp/ref" 2>/dev/null | grep -v '\.log$' | tr '\n' ' ' || true)
[ -d "$src" ] || die "no study $study in $tarball; it holds: ${held% }"
suffix=${label:+-$label}
if [ -n "$label" ]; then
  for run in "$src"/runs/*/; do
    [ -e "$final/runs/$(basename "$run")" ] && die "$final already holds run $(basename "$run"): nothing written"
  done
  for b in "$src"/bench/*; do
    [ -e "$final/bench/$(basename "$b")" ] && die "$final already holds bench/$(basename "$b"): nothing written"
  done
  for log in "$final"/logs/*"$suffix".log; do die "$final already holds $log: nothing written (another LABEL)"; done
  cp -r "$final" "$dest"
  mkdir -p "$dest/runs"
  cp -r "$src"/runs/* "$dest/runs/"
else
  mkdir -p "$dest"
  cp -r "$src/runs" "$dest/runs"
fi
mkdir -p "$dest/logs"
[ -n "$(ls -A "$src/bench" 2>/dev/null)" ] && mkdir -p "$dest/bench" && cp -r "$src"/bench/* "$dest/bench/"
warm=("$src"/models/*/warm_start.json)
if [ "${#warm[@]}" -eq 1 ]; then  # one model: model/warm_start.json, as the committed studies keep it
  mkdir -p "$dest/model" && cp "${warm[0]}" "$dest/model/warm_start$suffix.json"
else
  for w in "${warm[@]}"; do
    m=$(basename "$(dirname "$w")")
    mkdir -p "$dest/models/$m" && cp "$w" "$dest/models/$m/warm_start$suffix.json"
  done
fi
for log in "$src"/*.log "$tmp"/ref/*.log; do
  base=$(basename "$log" .log)
  cp "$log" "$dest/logs/$base$suffix.log"
done
cd "$dest"
runs=(runs/*/steps.jsonl)
if [ "${#runs[@]}" -gt 0 ]; then  # a run that died before its first step has logs only: kept, not aggregated
  dirs=("${runs[@]%steps.jsonl}")
  "$py" -m hybridrl compact "${dirs[@]}"
  "$py" -m hybridrl aggregate --runs "${dirs[@]}" --csv steps.csv --parquet "$tmp/steps.parquet"
  "$py" -m hybridrl report --table steps.csv --md report.md --html "$tmp/report.html" --plots plots
fi
cd "$repo"
if [ -n "$label" ]; then  # the old folder leaves only once the new one is whole
  mv "$final" "$tmp/replaced"
fi
mv "$dest" "$final"
echo "import-lease: $final (${#runs[@]} runs with steps); commit it now: git add -f $final"
