"""What a GPU can do at most, per its vendor's data sheet: dense bf16 tensor-core peak (FLOP/s) and HBM bandwidth
(bytes/s). MFU (trainers/flops.py) and the report's floor table (report/floors.py) read them from here.

Sources (NVIDIA's data sheets, cross-checked against third-party spec pages):
- H100 SXM5 80GB HBM3 ("NVIDIA H100 80GB HBM3"): 3.35 TB/s; bf16 1,979 TFLOP/s with 2:4 sparsity, 989.4 dense.
- H200 SXM 141GB HBM3e: 4.8 TB/s; the same GH100 die and tensor cores as the H100 SXM: 989.4 dense.
- H100 PCIe: 756 TFLOP/s dense; H100 NVL: 835 dense (their HBM bandwidth is not entered: unverified here).
- A100 SXM4 80GB HBM2e: 2.039 TB/s; A100 80GB PCIe: 1.935 TB/s; A100 40GB (SXM4 and PCIe, HBM2): 1.555 TB/s;
  every A100: 312 TFLOP/s bf16 dense.
A GPU not in the table has no peak and no bandwidth: callers show "no floor" / no MFU, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    key: str  # matched case-insensitively against the device's name; the first entry found in it wins
    peak_bf16_flops: float  # dense, no sparsity
    hbm_bytes_per_s: float | None  # None: not entered (unverified), so no bandwidth floor


# Order matters: the more specific name first ("H100 PCIe" before "H100", "A100 80GB PCIe" before "A100").
SPECS: tuple[GpuSpec, ...] = (
    GpuSpec("H200", 989.4e12, 4.8e12),
    GpuSpec("H100 PCIe", 756.0e12, None),
    GpuSpec("H100 NVL", 835.0e12, None),
    GpuSpec("H100", 989.4e12, 3.35e12),  # SXM5, torch's name "NVIDIA H100 80GB HBM3"
    GpuSpec("A100-SXM4-80GB", 312.0e12, 2.039e12),
    GpuSpec("A100 80GB PCIe", 312.0e12, 1.935e12),
    GpuSpec("A100-SXM4-40GB", 312.0e12, 1.555e12),
    GpuSpec("A100-PCIE-40GB", 312.0e12, 1.555e12),
    GpuSpec("A100", 312.0e12, None),  # another A100 variant: its peak is the same, its bandwidth unknown here
)


def spec(device_name: str | None) -> GpuSpec | None:
    """The table's entry for a device name (torch's or NVML's); None for a CPU or a GPU not in the table."""
    if not device_name:
        return None
    name = device_name.lower()
    return next((s for s in SPECS if s.key.lower() in name), None)
