#!/usr/bin/env bash
# Build one backend's Apptainer image and write its digest file (the workflow's rule `container`).
#   bash scripts/build-container.sh BACKEND OUT.sif OUT.sif.json
# Runs on the login node: the build downloads the base image and the pinned wheels. The digest file
# holds the sha256 of the image file (what provenance.json and slurm.json of every run record) and
# of the definition and pin lists it was built from.
set -euo pipefail
backend=${1:?usage: build-container.sh BACKEND OUT.sif OUT.sif.json}
image=$(realpath -m "${2:?}")
digest=$(realpath -m "${3:?}")
cd "$(dirname "$0")/.."  # %files paths in the definitions are relative to the repository root
def=containers/$backend.def
[ -f "$def" ] || { echo "build-container: no definition $def" >&2; exit 2; }

bin=$(command -v apptainer || command -v singularity || true)
if [ -z "$bin" ]; then
  echo "build-container: neither apptainer nor singularity is installed; install Apptainer" \
       "(https://apptainer.org/docs/admin/main/installation.html) or use the wheelhouse deployment" \
       "(docs/cluster.md)" >&2
  exit 1
fi
flags=()
# unprivileged builds need --fakeroot (and /etc/subuid entries for the user)
[ "$(id -u)" = 0 ] || flags+=(--fakeroot)

mkdir -p "$(dirname "$image")"
tmp="$image.tmp.$$"
trap 'rm -f "$tmp"' EXIT
"$bin" build "${flags[@]}" --force "$tmp" "$def"
"$bin" test "$tmp"
mv "$tmp" "$image"

sum() { sha256sum "$1" | cut -d' ' -f1; }
pins=(containers/pins/base.txt "containers/pins/$backend.txt" containers/pins/trainer.txt)
{
  printf '{\n  "backend": "%s",\n  "digest": "sha256:%s",\n' "$backend" "$(sum "$image")"
  printf '  "size_bytes": %s,\n' "$(stat -c %s "$image")"
  printf '  "definition": {"path": "%s", "sha256": "%s"},\n' "$def" "$(sum "$def")"
  printf '  "pins": {'
  sep=""
  for p in "${pins[@]}"; do printf '%s"%s": "%s"' "$sep" "$p" "$(sum "$p")"; sep=", "; done
  printf '},\n  "builder": "%s",\n  "built_utc": "%s",\n  "host": "%s"\n}\n' \
    "$("$bin" --version)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(hostname)"
} > "$digest.tmp"
mv "$digest.tmp" "$digest"
echo "build-container: $image $(grep -o 'sha256:[0-9a-f]*' "$digest" | head -1)"
