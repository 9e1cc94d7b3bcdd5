"""hybridrl: GRPO + LoRA with an inference engine and a trainer taking turns on the same GPUs."""

__version__ = "0.1.0"
