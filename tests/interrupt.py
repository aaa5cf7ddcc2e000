"""Run recipes/full_finetune.py (recipes/lora_finetune.py with INTERRUPT_RECIPE=lora, recipes/dpo_finetune.py with
INTERRUPT_RECIPE=dpo, recipes/grpo_finetune.py with INTERRUPT_RECIPE=grpo) in this process with a fault injected (``tests/faults.py`` describes each), as a cluster would
inflict it:

    python tests/interrupt.py MODE A B -- <recipe args>
    torchrun ... tests/interrupt.py kill-group-at-step K - -- <recipe args>

Faults that do not kill the process also run inside a test's own process (``tests/recipe_runs.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipes import dpo_finetune, full_finetune, grpo_finetune, lora_finetune  # noqa: E402
from tests.faults import injected  # noqa: E402

if __name__ == "__main__":
    mode, a, b, sep, *recipe_args = sys.argv[1:]
    assert sep == "--", "usage: interrupt.py MODE A B -- <recipe args>"
    recipe = {"lora": lora_finetune, "dpo": dpo_finetune, "grpo": grpo_finetune}.get(os.environ.get("INTERRUPT_RECIPE"), full_finetune)
    with injected([mode, a, b]):
        sys.exit(recipe.main(recipe_args))
