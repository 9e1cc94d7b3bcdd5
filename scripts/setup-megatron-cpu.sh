#!/usr/bin/env bash
# Install megatron-core 0.19.2 for the Megatron trainer into a CPU (Python 3.11) environment.
#
#   scripts/setup-megatron-cpu.sh [PYTHON]      (default: .venv/bin/python)
#
# Why the flags:
# - megatron-core 0.19.2 declares Requires-Python >= 3.12, but its cp311 wheel on PyPI compiles and runs
#   on 3.11 (every module byte-compiles; the parity tests pass). The only CPU torch on hand is for 3.11,
#   so we install it with --ignore-requires-python.
# - --no-deps: it needs only torch, numpy and packaging, which the project already has.
# - megatron.core imports triton at module level (MoE paged-stash kernels) even though nothing here runs
#   a triton kernel; torch's CPU build does not bring triton, so install it (3.6.0, the GPU stack's).
# The GPU machine (Python 3.12) gets megatron_core from ../shared/gpu/trainer.txt instead.
set -euo pipefail
PY="${1:-.venv/bin/python}"
MCORE_VERSION=0.19.2
TRITON_VERSION=3.6.0

have() { "$PY" - "$@" <<'PYEOF' 2>/dev/null
import importlib.metadata as md, sys
name, want = sys.argv[1], sys.argv[2]
try:
    sys.exit(0 if md.version(name) == want else 1)
except md.PackageNotFoundError:
    sys.exit(1)
PYEOF
}

if ! have megatron-core "$MCORE_VERSION"; then
  "$PY" -m pip install --quiet --no-deps --ignore-requires-python "megatron-core==$MCORE_VERSION"
fi
if ! "$PY" -c "import triton" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-deps "triton==$TRITON_VERSION"
fi
"$PY" -W ignore -c "import megatron.core, megatron.core.models.gpt, megatron.core.tensor_parallel; \
print('megatron-core', megatron.core.__version__, 'ready')"
