"""Evaluations of DeepSeek-V4 checkpoints on our prefill path: `python -m eval.gsm8k` (GSM8K, lm-eval's `gsm8k`)."""
