"""The task: GSM8K data, answer extraction and reward, GRPO advantages."""
