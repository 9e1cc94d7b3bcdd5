"""GRPO + LoRA on megatron-core (tensor parallel, torchrun workers, PEFT export).

`MegatronTrainer` (the controller side) imports no megatron code; the worker processes do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MegatronTrainer", "MegatronSetupError", "MegatronWorkerError"]


def __getattr__(name: str) -> Any:
    # lazy, so `import hybridrl.trainers.megatron.spec` stays cheap
    if name in ("MegatronTrainer", "MegatronWorkerError"):
        from hybridrl.trainers.megatron import trainer

        return getattr(trainer, name)
    if name == "MegatronSetupError":
        from hybridrl.trainers.megatron.spec import MegatronSetupError

        return MegatronSetupError
    raise AttributeError(name)
