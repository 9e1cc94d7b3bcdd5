"""The trainer interface: one GRPO step on a batch of scored rollouts, then a PEFT adapter on disk."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    engine_logprobs: list[float]  # one per completion token, as the engine reported them
    advantage: float


@dataclass
class TrainResult:
    adapter_dir: Path
    metrics: dict[str, float]  # train/loss, train/grad_norm, train/kl, train/clipfrac, perf/train_tokens,
    # check/rollout_logprob_abs_diff (trainer logprobs before the update vs engine logprobs), and
    # timing_s/save_adapter: seconds of step() spent writing the adapter (the loop records it as its own phase)


def lora_b_norm(named: Iterable[tuple[str, Any]]) -> float:
    """L2 norm of an adapter's LoRA B matrices over (name, tensor) pairs, PEFT's names or a model's parameters
    (train/lora_norm): zero means the adapter is still the identity it was built as, which no engine can show
    applied. One fused norm and one read, wherever the tensors are (hundreds of small reductions took 30 ms)."""
    import torch
    from torch.profiler import record_function

    with record_function("export.norm"):
        bs = [t.detach() for name, t in named if "lora_B" in name]
        return float(torch.nn.utils.get_total_norm(bs, 2.0)) if bs else 0.0


class Trainer(Protocol):
    def step(self, step: int, samples: list[Sample], out_dir: Path) -> TrainResult:
        """Recompute logprobs, take one optimizer step, save a PEFT adapter in out_dir; its optimizer.pt may still
        be being written when step() returns (flush waits for it)."""

    def flush(self) -> float:
        """Wait until the last step's optimizer.pt is on disk (before the step is recorded); the seconds waited.
        Raises OSError naming the file if it could not be written."""

    def offload(self) -> None:
        """Move weights and optimizer state off the GPU (colocate); no-op on CPU."""

    def onload(self) -> None: ...

    def release_base(self) -> None:
        """From now on offload moves the frozen base off the GPU too (keep_base_on_gpu auto, when it does not fit
        beside the engine); at once if offloaded already."""

    def gpu_pids(self) -> list[int]:
        """The processes that hold this trainer's GPU memory (NVML charges memory per process)."""

    def resume(self, adapter_dir: Path) -> None:
        """Continue from an adapter dir that step() wrote (adapter weights and optimizer.pt)."""

    def ports(self) -> dict[str, int]:
        """The ports the trainer's processes listen on, by kind (trainer_rendezvous); empty where it has none."""

    def close(self) -> None: ...
