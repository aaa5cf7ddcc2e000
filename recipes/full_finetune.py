"""Full fine-tuning of a Llama-family model; the output checkpoint has the input's format and files.

    python recipes/full_finetune.py --config configs/tiny.yaml [key=value ...]

Copy this file and edit it: it is the training loop, top to bottom. The
reusable parts (checkpointers, converters, model, data) live in the libraries.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm import tqdm

from checkpointers import CheckpointError, load_into
from training.collate import padded_collate
from training.config import parse_config
from training.data_order import batches_per_epoch, iterate_batches
from training.loss import next_token_loss_sum, supervised_tokens
from training.metrics import MetricsLog
from training.seed import seed_everything


def prepare_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Refuse to mix a new run into a directory that holds an earlier run's checkpoints."""
    earlier = sorted(p.name for p in output_dir.glob("step_*")) if output_dir.is_dir() else []
    if earlier and not overwrite:
        raise CheckpointError(f"output_dir {output_dir} already holds checkpoints ({', '.join(earlier)}); "
                              "choose another output_dir or set overwrite=true to replace them")
    for name in earlier:
        shutil.rmtree(output_dir / name)
    (output_dir / "metrics.jsonl").unlink(missing_ok=True)
    output_dir.mkdir(parents=True, exist_ok=True)


def train(cfg: DictConfig) -> Path:
    output_dir = Path(cfg.output_dir)
    device = torch.device(cfg.device)
    seed_everything(cfg.seed)

    # Model: built on the meta device, then given the checkpoint's (memory-mapped) tensors.
    checkpointer = instantiate(cfg.checkpointer)
    state = checkpointer.load_checkpoint()
    with torch.device("meta"):
        model = instantiate(cfg.model)
    load_into(model, {k: v.to(device) for k, v in state["model"].items()}, dtype=cfg.dtype)
    del state
    model.activation_checkpointing = cfg.enable_activation_checkpointing
    model.train()

    # Data.
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer=tokenizer)
    collate = lambda batch: padded_collate(batch, pad_id=tokenizer.pad_id)  # noqa: E731
    steps_per_epoch = batches_per_epoch(len(dataset), cfg.batch_size) // cfg.gradient_accumulation_steps
    if cfg.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.max_steps_per_epoch)
    if steps_per_epoch < 1:
        raise CheckpointError(f"dataset has {len(dataset)} samples: too few for batch_size={cfg.batch_size} "
                              f"x gradient_accumulation_steps={cfg.gradient_accumulation_steps}")
    total_steps = cfg.epochs * steps_per_epoch

    # Optimizer after loading, so it holds the parameters the model really uses.
    optimizer = instantiate(cfg.optimizer, params=[p for p in model.parameters() if p.requires_grad])
    scheduler = instantiate(cfg.lr_scheduler, optimizer=optimizer, num_training_steps=total_steps)

    prepare_output_dir(output_dir, cfg.overwrite)  # only now: bad input above must leave output_dir as it was
    metrics = MetricsLog(output_dir)
    global_step = 0
    bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True)
    for epoch in range(cfg.epochs):
        batches = iterate_batches(dataset, cfg.batch_size, seed=cfg.seed, epoch=epoch, collate_fn=collate)
        for _ in range(steps_per_epoch):
            started = time.perf_counter()
            micro_batches = [next(batches)[1] for _ in range(cfg.gradient_accumulation_steps)]
            n_supervised = sum(supervised_tokens(b["labels"]) for b in micro_batches)
            loss_sum = 0.0
            for batch in micro_batches:
                logits = model(batch["tokens"].to(device))
                loss = next_token_loss_sum(logits, batch["labels"].to(device)) / max(n_supervised, 1)
                loss.backward()
                loss_sum += loss.item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm or float("inf"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            tokens = sum(b["tokens"].numel() for b in micro_batches)
            record = dict(step=global_step, epoch=epoch, loss=loss_sum, lr=scheduler.get_last_lr()[0],
                          grad_norm=float(grad_norm), tokens_per_s=tokens / (time.perf_counter() - started))
            metrics.write(**record)
            bar.set_postfix(loss=f"{loss_sum:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update()
    bar.close()
    metrics.close()

    saved = checkpointer.save_checkpoint({"model": model.state_dict()}, step=global_step)
    print(f"saved {saved}")
    return saved


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv, description=__doc__.splitlines()[0])
    try:
        train(cfg)
    except (CheckpointError, FileNotFoundError, InstantiationException) as e:
        if os.environ.get("WAYPOINT_DEBUG"):
            raise
        cause = e.__cause__ if isinstance(e, InstantiationException) and e.__cause__ else e
        print(f"error: {str(cause).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
