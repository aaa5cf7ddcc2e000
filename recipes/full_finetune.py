"""Full fine-tuning of a Llama-family model; checkpoints have the input's format and files.

    python recipes/full_finetune.py --config configs/tiny.yaml [key=value ...]

Rerunning the same command after a kill or a preemption continues from the newest
verified checkpoint in ``output_dir``, exactly where it stopped. Copy this file and
edit it: it is the training loop, top to bottom. The reusable parts (checkpointers,
converters, model, data) live in the libraries.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from checkpointers import CheckpointError, load_into
from checkpointers.commit import prune_checkpoints, remove_stale_staging, step_dirs
from training.collate import padded_collate
from training.entry import run_recipe
from training.data_order import batches_per_epoch, iterate_batches
from training.loss import next_token_loss_sum, supervised_tokens
from training.metrics import MetricsLog
from training.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch, requeue_slurm_job
from training.recipe_state import build_recipe_state, load_recipe_state
from training.resume import check_config, find_checkpoint, set_aside_newer, start_fresh
from training.rng_state import capture_rng, restore_rng
from training.seed import seed_everything


def train(cfg: DictConfig) -> int:
    output_dir = Path(cfg.output_dir)
    device = torch.device(cfg.device)
    config = OmegaConf.to_container(cfg, resolve=True)

    # Where to start: the newest verified checkpoint of this run (resume=auto), or the input.
    resume_from = find_checkpoint(output_dir, cfg.resume)
    recipe_state = load_recipe_state(resume_from.path) if resume_from else None
    notes = check_config(recipe_state["config"], config, resume_from.path) if recipe_state else []
    if resume_from:  # later checkpoints are corrupt (auto) or unwanted (a pinned path): kept, renamed
        set_aside_newer(output_dir, resume_from.path, "corrupt" if cfg.resume in (True, "auto") else "superseded")
    if not resume_from and cfg.resume not in (False, "false") and step_dirs(output_dir) and not cfg.overwrite:
        raise CheckpointError(f"output_dir {output_dir} holds checkpoints but none verifies; "
                              "set resume=<path> to pick one or overwrite=true to start again")
    seed_everything(cfg.seed)

    # Model: built on the meta device, then given the checkpoint's (memory-mapped) tensors.
    checkpointer = instantiate(cfg.checkpointer, **({"checkpoint_dir": resume_from.path} if resume_from else {}))
    state = checkpointer.load_checkpoint()
    with torch.device("meta"):
        model = instantiate(cfg.model)
    report = load_into(model, state["model"], dtype=cfg.dtype, device=device, strict=cfg.strict,
                       key_prefix_map=cfg.key_prefix_map)
    print("\n".join(report.lines()))
    del state
    model.activation_checkpointing = cfg.enable_activation_checkpointing
    model.train()

    # Data.
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer=tokenizer)
    collate = lambda batch: padded_collate(batch, pad_id=tokenizer.pad_id)  # noqa: E731
    accumulate = cfg.gradient_accumulation_steps
    steps_per_epoch = batches_per_epoch(len(dataset), cfg.batch_size) // accumulate
    if cfg.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.max_steps_per_epoch)
    if steps_per_epoch < 1:
        raise CheckpointError(f"dataset has {len(dataset)} samples: too few for batch_size={cfg.batch_size} "
                              f"x gradient_accumulation_steps={accumulate}")
    total_steps = cfg.epochs * steps_per_epoch

    # Optimizer after loading, so it holds the parameters the model really uses.
    optimizer = instantiate(cfg.optimizer, params=[p for p in model.parameters() if p.requires_grad])
    scheduler = instantiate(cfg.lr_scheduler, optimizer=optimizer, num_training_steps=total_steps)

    global_step, start_epoch, start_step = 0, 0, 0
    if recipe_state:
        if recipe_state["global_step"] >= total_steps:
            print(f"run already finished: {resume_from.path} is step {recipe_state['global_step']} of {total_steps}; nothing to do")
            return 0
        optimizer.load_state_dict(recipe_state["optimizer"])
        scheduler.load_state_dict(recipe_state["lr_scheduler"])
        restore_rng(recipe_state["rng"])
        global_step, start_epoch, start_step = recipe_state["global_step"], recipe_state["epoch"], recipe_state["step_in_epoch"]
        print(f"resuming from {resume_from.path.name} (epoch {start_epoch}, batch {start_step * accumulate}/"
              f"{steps_per_epoch * accumulate}), {resume_from.files} files verified, {resume_from.bytes / 1e9:.2f} GB")
        for key in notes:
            print(f"note: {key} differs from the checkpoint's config; accepted")
    else:
        start_fresh(output_dir, cfg.overwrite)  # only now: bad input above must leave output_dir as it was
    remove_stale_staging(output_dir)
    metrics = MetricsLog(output_dir, keep_through_step=global_step)

    def save(next_epoch: int, next_step: int) -> Path:
        recipe = build_recipe_state(
            optimizer=optimizer, lr_scheduler=scheduler, global_step=global_step, epoch=next_epoch,
            step_in_epoch=next_step, steps_per_epoch=steps_per_epoch, total_steps=total_steps, seed=cfg.seed,
            epochs=cfg.epochs, rng=capture_rng(), config=config,
            data_position={"epoch": next_epoch, "next_batch": next_step * accumulate, "batch_size": cfg.batch_size,
                           "samples_seen_in_epoch": next_step * accumulate * cfg.batch_size, "seed": cfg.seed})
        path = checkpointer.save_checkpoint({"model": model.state_dict(), "recipe_state": recipe}, step=global_step)
        prune_checkpoints(output_dir, cfg.keep_last_n_checkpoints)
        return path

    preemption = PreemptionWatch(cfg.preemption_signals)
    bar = tqdm(total=total_steps, initial=global_step, desc="train", dynamic_ncols=True)
    for epoch in range(start_epoch, cfg.epochs):
        first = start_step if epoch == start_epoch else 0
        batches = iterate_batches(dataset, cfg.batch_size, seed=cfg.seed, epoch=epoch, collate_fn=collate,
                                  start_batch=first * accumulate)
        for step_in_epoch in range(first, steps_per_epoch):
            started = time.perf_counter()
            micro_batches = [next(batches)[1] for _ in range(accumulate)]
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

            # Checkpoints at optimizer-step boundaries only.
            epoch_done = step_in_epoch + 1 == steps_per_epoch
            due = (global_step == total_steps or preemption.requested
                   or (cfg.save_every_n_steps and global_step % cfg.save_every_n_steps == 0)
                   or (epoch_done and cfg.save_every_epoch))
            if due:
                saved = save(epoch + 1, 0) if epoch_done else save(epoch, step_in_epoch + 1)
                bar.write(f"saved {saved}")
            if preemption.requested and global_step < total_steps:
                bar.close()
                print(f"stopped by {preemption.received} at step {global_step}; rerun the same command to resume")
                if cfg.requeue:
                    requeue_slurm_job()
                return PREEMPTED_EXIT_CODE
    bar.close()
    metrics.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_recipe(train, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
