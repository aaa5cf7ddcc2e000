"""What the launch server (``tests/launch.py``) imports once, so that each run forked from it starts with it loaded:
the recipes, and through them torch, hydra and the libraries. Imports only: no tensor work, no threads."""

import torch.distributed.fsdp  # noqa: F401  (FSDP2 and DCP: what several ranks import first)
import torch.distributed.checkpoint  # noqa: F401

from recipes import dpo_finetune, full_finetune, grpo_finetune, lora_finetune  # noqa: F401
from tests import faults  # noqa: F401
