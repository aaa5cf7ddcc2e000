"""What the launch server (``tests/launch.py``) imports once, so that each run forked from it starts with it loaded:
the recipes, and through them torch, hydra and the libraries. Imports only: no tensor work, no threads.

Beyond the recipes' own imports, what every run imported at its first step (270 modules, about 1 s of each forked
run on 2 cores): torch._dynamo (torch's optimizers and FSDP2 import it lazily, and torch.onnx, inductor and
torch._numpy with it), jinja2's sandbox and tokenizers (the data and its template), and hydra's core plugins (scanned
by its first compose)."""

import gc

import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401  (FSDP2 and DCP: what several ranks import first)
import torch.utils.serialization  # noqa: F401
from hydra.core.plugins import Plugins

import jinja2.sandbox  # noqa: F401
import tokenizers  # noqa: F401
from recipes import dpo_finetune, full_finetune, grpo_finetune, lora_finetune  # noqa: F401
from tests import faults  # noqa: F401

Plugins.instance()  # imports and registers hydra's core plugins (bash completion, the basic launcher, ...)

gc.collect()
gc.freeze()  # what every child shares stays out of its cyclic GC's scans (and their copy-on-write of its pages)
