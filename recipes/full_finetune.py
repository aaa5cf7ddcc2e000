"""Full fine-tuning of a Llama-family model; checkpoints have the input's format and files.

    python recipes/full_finetune.py --config configs/tiny.yaml [key=value ...]

Rerunning the same command after a kill or a preemption continues from the newest
verified checkpoint in ``output_dir``, exactly where it stopped. The same script runs on
several GPUs or nodes: ``torchrun --nproc_per_node N recipes/full_finetune.py --config ...``
(FSDP2; intermediate checkpoints sharded with torch.distributed.checkpoint, resumable on
another number of processes; the final one also in the input's format). Copy this file and
edit it: it is the training loop, top to bottom. The reusable parts (checkpointers,
converters, model, data) live in the libraries.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

if importlib.util.find_spec("waypoint") is None:  # a checkout that is not installed: its root holds `waypoint`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from waypoint.checkpointers import load_into
from waypoint.checkpointers.base import RECIPE_STATE_FILE
from waypoint.checkpointers.commit import remove_stale_staging
from waypoint.checkpointers.extra_state import EXTRA_STATE_FILE, split_extra_state
from waypoint.checkpointers.load_model import load_sharded_into
from waypoint.checkpointers.retention import prune_checkpoints
from waypoint.checkpointers.sharded_checkpoint import SHARDED_DIR, holds_sharded_model
from waypoint.checkpointers.sharded_saver import ShardedSaver
from waypoint.training.collate import padded_collate
from waypoint.training.data_order import iterate_batches, optimizer_steps_per_epoch
from waypoint.training.distributed import Distributed
from waypoint.training.entry import run_recipe
from waypoint.training.fsdp import shard_model
from waypoint.training.loss import forward_backward
from waypoint.training.metrics import MetricsLog
from waypoint.training.run_data import run_data
from waypoint.training.validation import evaluate
from waypoint.training.nonfinite import check_weights_finite, clip_gradients, step_is_finite
from waypoint.training.optimizer_state import load_sharded_optimizer_state, load_whole_optimizer_state, optimizer_state
from waypoint.training.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch, requeue_slurm_job
from waypoint.training.recipe_state import build_recipe_state, load_recipe_state
from waypoint.training.resume import (apply_changes, check_config, check_global_batch, choose_checkpoint, restore_position,
                                      start_fresh)
from waypoint.training.rng_state import capture_rng
from waypoint.training.seed import seed_everything


def train(cfg: DictConfig, dist: Distributed) -> int:
    """The run; ``run_recipe`` has checked the config, started the process group (under torchrun) and holds
    ``output_dir`` for it."""
    output_dir = Path(cfg.output_dir)
    device, main = dist.device, dist.is_main
    say = print if main else (lambda *a, **k: None)  # noqa: E731
    config = OmegaConf.to_container(cfg, resolve=True)
    if not dist.enabled and (cfg.get("async_checkpoint") or cfg.get("mixed_precision")):
        say("note: async_checkpoint and mixed_precision apply under torchrun (FSDP2); one process computes in dtype "
            "and writes each checkpoint before going on")

    # Where to start: the newest verified checkpoint of this run (resume=auto), or the input.
    # Rank 0 decides about output_dir; every rank learns the decision.
    resume_from = dist.run_on_main(lambda: choose_checkpoint(output_dir, cfg.resume, cfg.overwrite))
    recipe_state = load_recipe_state(resume_from.path) if resume_from else None
    changes = check_config(recipe_state["config"], config, resume_from.path) if recipe_state else []
    seed_everything(cfg.seed)

    # Model: built on the meta device, sharded (FSDP2) under torchrun, then given the checkpoint's
    # tensors, each rank reading only its own piece. The checkpointer reads the input (its files, key ->
    # file map, dtypes and side files are what every save writes); a resumed run's weights come from its
    # step directory (as they trained, when its files hold a narrower dtype), which retention may delete later.
    sharded_resume = resume_from is not None and holds_sharded_model(resume_from.path)
    checkpointer = instantiate(cfg.checkpointer)
    state = checkpointer.load_checkpoint()  # memory-mapped and converted lazily: nothing is read yet
    if resume_from and not sharded_resume:
        state = instantiate(cfg.checkpointer, checkpoint_dir=resume_from.path).load_checkpoint()
        state["model"].update(recipe_state.get("model") or {})
    with torch.device("meta"):
        model = instantiate(cfg.model)
    if dist.enabled:
        shard_model(model, dist.mesh, cfg.get("mixed_precision"))
    if sharded_resume:
        report = load_sharded_into(model, resume_from.path, dtype=cfg.dtype, device=device)
    else:
        report = load_into(model, state["model"], dtype=cfg.dtype, device=device, strict=cfg.strict,
                           key_prefix_map=cfg.key_prefix_map)
    say("\n".join(report.lines() + checkpointer.notes))
    say(f"checkpoints are written in {checkpointer.output_dtype_note()}")
    del state
    model.activation_checkpointing = cfg.enable_activation_checkpointing
    model.train()

    # Data: a global batch of batch_size x gradient_accumulation_steps x processes samples per step.
    tokenizer = instantiate(cfg.tokenizer)
    # the dataset (validation held out, packed on request); a chat dataset's template also goes into each checkpoint
    dataset, validation = run_data(cfg, tokenizer, checkpointer, say)
    collate = lambda batch: padded_collate(batch, pad_id=tokenizer.pad_id)  # noqa: E731
    accumulate = cfg.gradient_accumulation_steps
    global_batch = cfg.batch_size * accumulate * dist.world_size
    steps_per_epoch = optimizer_steps_per_epoch(len(dataset), cfg.batch_size, accumulate, dist.world_size, cfg.max_steps_per_epoch)
    total_steps = cfg.epochs * steps_per_epoch

    # Optimizer after loading, so it holds the parameters the model really uses.
    optimizer = instantiate(cfg.optimizer, params=[p for p in model.parameters() if p.requires_grad])
    scheduler = instantiate(cfg.lr_scheduler, optimizer=optimizer, num_training_steps=total_steps)

    global_step, start_epoch, start_step = 0, 0, 0
    if recipe_state:
        check_global_batch(recipe_state, global_batch, cfg.batch_size, accumulate, dist.world_size, resume_from.path)
        if recipe_state["global_step"] >= total_steps:
            say(f"run already finished: {resume_from.path} is step {recipe_state['global_step']} of {total_steps}; nothing to do")
            return 0
        if recipe_state.get("optimizer") is not None:
            load_whole_optimizer_state(model, optimizer, recipe_state["optimizer"])
        else:
            load_sharded_optimizer_state(model, optimizer, resume_from.path / SHARDED_DIR, recipe_state["optimizer_param_groups"])
        scheduler.load_state_dict(recipe_state["lr_scheduler"])
        apply_changes(optimizer, scheduler, changes)  # changed settings take effect now, or are refused
        global_step, start_epoch, start_step, resume_lines = restore_position(recipe_state, dist.rank, dist.world_size, global_batch)
        say(f"resuming from {resume_from.path.name} (epoch {start_epoch}, sample {start_step * global_batch}/"
            f"{steps_per_epoch * global_batch}), {resume_from.files} files verified, {resume_from.bytes / 1e9:.2f} GB")
        for key, old, new in changes:
            say(f"note: {key}: {old} -> {new} (takes effect from step {global_step + 1})")
        for line in resume_lines:
            say(line)
    else:
        dist.run_on_main(lambda: start_fresh(output_dir, cfg.overwrite))  # only now: bad input above leaves output_dir as it was
    dist.run_on_main(lambda: remove_stale_staging(output_dir))
    metrics = MetricsLog(output_dir, keep_through_step=global_step, report=tqdm.write,
                         tensorboard_dir=cfg.get("log_dir")) if main else None
    saver = ShardedSaver(dist, output_dir, cfg.keep_last_n_checkpoints, cfg.get("async_checkpoint", False),
                         report=tqdm.write) if dist.enabled else None

    def save(next_epoch: int, next_step: int, final: bool) -> Path:
        check_weights_finite(model, global_step, dist.any)  # a checkpoint is never written from nan or inf weights
        whole = not dist.enabled  # a single process writes whole tensors, in the input's format
        optim = optimizer_state(model, optimizer)
        rng = dist.gather(capture_rng())
        recipe = build_recipe_state(
            optimizer=optim if whole else None, lr_scheduler=scheduler, global_step=global_step, epoch=next_epoch,
            step_in_epoch=next_step, steps_per_epoch=steps_per_epoch, total_steps=total_steps, seed=cfg.seed,
            epochs=cfg.epochs, rng=rng[0] if main else None, config=config, world_size=dist.world_size,
            rng_per_rank=rng if dist.enabled else None, optimizer_param_groups=None if whole else optim["param_groups"],
            data_position={"epoch": next_epoch, "samples_seen_in_epoch": next_step * global_batch,
                           "global_batch_size": global_batch, "permutation_seed": cfg.seed})
        if whole:
            saved = checkpointer.save_checkpoint({"model": model.state_dict(), "recipe_state": recipe}, step=global_step)
            tqdm.write(f"saved {saved}")
            prune_checkpoints(output_dir, cfg.keep_last_n_checkpoints)
            return saved
        # Sharded: DCP files of every rank (intermediate: model and optimizer; final: the optimizer, with the model
        # in the input's format, gathered and written one file at a time, and in the shards too when that format's
        # dtype is narrower than the one it trained in).
        model_state = model.state_dict()
        tensors, extra = split_extra_state(model_state)
        keep_model = not final or checkpointer.narrows(tensors)
        sharded = {"optimizer": optim["state"]} | ({"model": dict(tensors)} if keep_model else {})
        files = {RECIPE_STATE_FILE: recipe} | ({EXTRA_STATE_FILE: extra} if extra and keep_model else {})
        return saver.save(global_step, sharded, files, export=(checkpointer, model_state) if final else None,
                          asynchronous=False if final else None)

    preemption = PreemptionWatch(cfg.preemption_signals)
    bar = tqdm(total=total_steps, initial=global_step, desc="train", dynamic_ncols=True, disable=not main)
    first_step, saved = global_step + 1, None
    for epoch in range(start_epoch, cfg.epochs):
        first = start_step if epoch == start_epoch else 0
        batches = iterate_batches(dataset, cfg.batch_size, seed=cfg.seed, epoch=epoch, collate_fn=collate,
                                  start_batch=first * accumulate, rank=dist.rank, world_size=dist.world_size)
        for step_in_epoch in range(first, steps_per_epoch):
            started = time.perf_counter()
            micro_batches = [next(batches)[1] for _ in range(accumulate)]
            loss_sum, tokens, aux_loss = forward_backward(model, micro_batches, device, dist)
            grad_norm = clip_gradients(model.parameters(), cfg.clip_grad_norm)
            global_step += 1
            # A nan or inf stops the run here, before the weights change (or, with on_nonfinite=skip_step, skips the update).
            if step_is_finite(global_step, loss_sum, grad_norm, model, cfg.get("on_nonfinite", "stop"), tqdm.write,
                              updated=global_step > first_step):
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            record = dict(step=global_step, epoch=epoch, loss=loss_sum, lr=scheduler.get_last_lr()[0],
                          grad_norm=grad_norm, tokens_per_s=tokens / (time.perf_counter() - started))
            if aux_loss is not None:  # mixture of experts: the load-balancing loss, logged beside the loss it joins
                record["aux_loss"] = aux_loss
            if resume_from and global_step == first_step:  # where a plot marks the resumed segment
                record["resumed"] = True
            if main:
                metrics.write(**record)
            if validation and validation.due(global_step, total_steps):
                record["val_loss"] = evaluate(model, validation.dataset, cfg.batch_size, collate, device, dist)
                if main:
                    metrics.write(step=global_step, val_loss=record["val_loss"])
            bar.set_postfix(loss=f"{loss_sum:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}",
                            **({"val": f"{record['val_loss']:.4f}"} if "val_loss" in record else {}))
            bar.update()

            # Checkpoints at optimizer-step boundaries only; a signal on any rank stops every rank here.
            preempted = dist.any(preemption.requested)
            epoch_done = step_in_epoch + 1 == steps_per_epoch
            due = (global_step == total_steps or preempted
                   or (cfg.save_every_n_steps and global_step % cfg.save_every_n_steps == 0)
                   or (epoch_done and cfg.save_every_epoch))
            if due:
                saved = save(epoch + 1, 0, global_step == total_steps) if epoch_done else save(epoch, step_in_epoch + 1, False)
            if preempted and global_step < total_steps:
                if saver:
                    saver.close()
                bar.close()
                say(f"stopped by {preemption.received or 'a signal to another rank'} at step {global_step}; "
                    "rerun the same command to resume")
                if cfg.requeue and main:
                    requeue_slurm_job()
                return PREEMPTED_EXIT_CODE
    if saver:
        saver.close()
        say(f"checkpoint saves blocked training for {saver.blocked_s:.2f} s in all")
    bar.close()
    if metrics:
        metrics.close()
    say(f"done: the final model is {checkpointer.describe_output(saved)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_recipe(train, argv, description=__doc__.splitlines()[0], example="configs/tiny.yaml")


if __name__ == "__main__":
    sys.exit(main())
