"""What a training step is made of: the loss and its backward pass (supervised, preference and online RL), the
validation loss, the learning-rate schedule and gradient clipping with the non-finite guard, QLoRA's 4-bit base, and
distribution (the process group and FSDP2 sharding). The data a step reads is ``waypoint.data``; a run's life around
it (checkpoints, resume, the output directory) is ``waypoint.run``."""
