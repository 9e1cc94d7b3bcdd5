#!/usr/bin/env bash
# Megatron trainer on the GPU machine: parity with HF + PEFT at TP 1 and 2, then trainer throughput
# against the HF trainer on the same batch and the memory left on the GPU after offload.
# Run from the repo root on a 2-GPU machine, with carry [".venvs/mcore-gpu"] (the cp312 wheel).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-index --target /tmp/mc .venvs/mcore-gpu/*.whl
export PYTHONPATH=/tmp/mc:$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m hybridrl.tools.megatron_parity --device cuda --tp 1 /tmp/p1 2>&1 | tee "$OUT/parity_tp1.log"
python3 -m hybridrl.tools.megatron_parity --device cuda --tp 2 --archs llama,qwen2,qwen3 /tmp/p2 2>&1 \
  | tee "$OUT/parity_tp2.log"
python3 -m hybridrl.tools.megatron_bench /tmp/b --tp 1 2>&1 | tee "$OUT/bench_tp1.log"
python3 -m hybridrl.tools.megatron_bench /tmp/b --tp 2 --skip-hf --model /tmp/b/model 2>&1 | tee "$OUT/bench_tp2.log"
