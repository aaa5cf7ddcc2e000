"""Engines that sample completions for online RL besides the policy's own decode loop (``models.sample_group``):
vLLM in the training process (``vllm_engine``), configured by a GRPO config's ``vllm`` section (``vllm_options``)."""
