"""nemo_grpo: GRPO post-training for LLMs."""
