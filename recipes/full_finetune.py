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

from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm import tqdm

from waypoint.cli.entry import run_recipe
from waypoint.cli.option_checks import COMMON
from waypoint.cli.run_config import config_as_given
from waypoint.data.collate import batch_collate
from waypoint.data.data_order import iterate_batches, optimizer_steps_per_epoch
from waypoint.data.run_data import run_data
from waypoint.evaluation.during_training import TrainingEval
from waypoint.models.vision_towers import freeze_tower
from waypoint.run.output_dir import RunDir
from waypoint.run.plan import RunPlan
from waypoint.run.preemption import PreemptionWatch
from waypoint.run.progress import TrainingProgress
from waypoint.run.recipe_state import capture_recipe_state
from waypoint.run.resume import RunStart
from waypoint.run.run_outputs import RunOutputs
from waypoint.run.step_content import model_step
from waypoint.training.distributed import Distributed
from waypoint.training.loss import forward_backward
from waypoint.training.nonfinite import check_weights_finite, clip_gradients, step_is_finite
from waypoint.training.recipe_model import load_model
from waypoint.training.seed import seed_everything
from waypoint.training.validation import evaluate


def train(cfg: DictConfig, dist: Distributed) -> int:
    """The run; ``run_recipe`` has checked the config, started the process group (under torchrun) and holds
    ``output_dir`` for it."""
    device, main = dist.device, dist.is_main
    say = print if main else (lambda *a, **k: None)  # noqa: E731
    config = config_as_given(cfg)  # what each checkpoint records (URLs, not this machine's local copies)
    # Where the run lives (an object-store run: the store and this machine's mirror of it).
    run_dir = RunDir(Path(cfg.output_dir), cfg.get("output_store"))
    if not dist.enabled and cfg.get("mixed_precision"):
        say("note: mixed_precision applies under torchrun (FSDP2); one process computes in dtype")

    # Where to start: the newest verified checkpoint of this run (resume=auto), or the input.
    # Rank 0 decides about output_dir; every rank learns the decision.
    start = RunStart(run_dir, cfg.resume, cfg.overwrite, config, dist)
    seed_everything(cfg.seed)
    # lm-eval tasks scored as it trains (eval: {tasks, every_n_steps}); resolved now, so a bad task fails here
    training_eval = TrainingEval.from_config(cfg.get("eval"), dist.world_size)

    # Model: built on the meta device, sharded (FSDP2) under torchrun, then given the checkpoint's
    # tensors, each rank reading only its own piece. The checkpointer reads the input (its files, key ->
    # file map, dtypes and side files are what every save writes); a resumed run's weights come from its
    # step directory (as they trained, when its files hold a narrower dtype), which retention may delete later.
    loaded = load_model(cfg, dist, start, lora=None, say=say)
    model, checkpointer = loaded.model, loaded.checkpointer
    say(f"checkpoints are written in {checkpointer.output_dtype_note()}")
    model.activation_checkpointing = cfg.enable_activation_checkpointing
    model.train()

    # Data: a global batch of batch_size x gradient_accumulation_steps x processes samples per step.
    tokenizer = instantiate(cfg.tokenizer)
    # the dataset (validation held out, packed on request); a chat dataset's template also goes into each checkpoint
    def make_dataset(**source):  # the config's dataset (with source=: a validation file)
        return instantiate(cfg.dataset, tokenizer=tokenizer, **source)
    dataset, validation = run_data(make_dataset, tokenizer, checkpointer, cfg.get("validation"), cfg.seed,
                                   packed_to=cfg.dataset.max_seq_len if cfg.get("packed", False) else None,
                                   vocab_size=model.args.vocab_size, say=say,
                                   max_positions=getattr(model.args, "max_seq_len", None))
    collate = lambda batch: batch_collate(batch, pad_id=tokenizer.pad_id)  # noqa: E731
    accumulate = cfg.gradient_accumulation_steps
    steps_per_epoch = optimizer_steps_per_epoch(len(dataset), cfg.batch_size, accumulate, dist.world_size,
                                                cfg.max_steps_per_epoch)
    plan = RunPlan(steps_per_epoch, cfg.epochs, cfg.batch_size, accumulate, dist.world_size, cfg.seed,
                   save_every_n_steps=cfg.save_every_n_steps or 0, save_every_epoch=cfg.save_every_epoch)

    # A vision-language model's tower stays as it came unless freeze_vision: false (its projector trains).
    if getattr(model, "vision", None) is not None and cfg.get("freeze_vision", True):
        freeze_tower(model.vision)
    # Optimizer after loading, so it holds the parameters the model really uses.
    optimizer = instantiate(cfg.optimizer, params=[p for p in model.parameters() if p.requires_grad])
    scheduler = instantiate(cfg.lr_scheduler, optimizer=optimizer, num_training_steps=plan.total_steps)

    # A resumed run gets its optimizer, scheduler, random states and data position back; a fresh one starts at 0.
    position = start.restore(optimizer, scheduler, model, plan, say)
    if position is None:
        return 0
    global_step, start_epoch, start_step = position
    # rank 0's logs and the checkpoints (torchrun: every rank writes its DCP shards; one process writes the model in
    # the input's files), from the resumed step on
    outputs = RunOutputs(cfg, config, run_dir, start, dist, global_step, sharded=dist.enabled, say=say)
    metrics = outputs.metrics

    def save(epoch: int, step_in_epoch: int, final: bool, preempted: bool) -> Path:
        check_weights_finite(model, global_step, dist.any)  # a checkpoint is never written from nan or inf weights
        recipe = capture_recipe_state(plan, global_step, epoch, step_in_epoch, scheduler, config, dist, outputs.trackers)
        content = model_step(model, optimizer, checkpointer, recipe, final, dist, outputs.verify, tqdm.write)
        return outputs.saver.save(global_step, content, final=final or preempted)

    loss_chunk = None if cfg.get("fused_loss", True) else 0  # None: chunks sized by the vocabulary; 0: full logits
    preemption = PreemptionWatch(cfg.preemption_signals)
    # a bar on a terminal, a plain line every progress_every_n_steps in a log (progress: auto | bar | lines | off)
    progress = TrainingProgress(plan.total_steps, global_step, cfg.get("progress_every_n_steps", 10), shown=main)
    first_step = global_step + 1
    for epoch in range(start_epoch, cfg.epochs):
        first = start_step if epoch == start_epoch else 0
        batches = iterate_batches(dataset, cfg.batch_size, seed=cfg.seed, epoch=epoch, collate_fn=collate,
                                  start_batch=first * accumulate, rank=dist.rank, world_size=dist.world_size)
        for step_in_epoch in range(first, plan.steps_per_epoch):
            started = time.perf_counter()
            micro_batches = [next(batches)[1] for _ in range(accumulate)]
            loss_sum, tokens, aux_loss = forward_backward(model, micro_batches, device, dist, loss_chunk)
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
            if start.checkpoint and global_step == first_step:  # where a plot marks the resumed segment
                record["resumed"] = True
            if main:
                metrics.write(**record)
            if validation and validation.due(global_step, plan.total_steps):
                record["val_loss"] = evaluate(model, validation.dataset, cfg.batch_size, collate, device, dist)
                if main:
                    metrics.write(step=global_step, val_loss=record["val_loss"])
            if training_eval and training_eval.due(global_step, plan.total_steps):
                scores = training_eval.run(model, tokenizer)  # the model and the random states as they were
                if main:
                    metrics.write(step=global_step, **scores)
            progress.update(global_step, loss=f"{loss_sum:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}",
                            **({"val": f"{record['val_loss']:.4f}"} if "val_loss" in record else {}))

            # Checkpoints at optimizer-step boundaries only; a signal on any rank stops every rank here.
            if outputs.step_end(plan, global_step, epoch, step_in_epoch, preemption, save):
                return outputs.stop(global_step, preemption, progress)
    outputs.close_saves()
    if cfg.get("async_checkpoint"):
        say(f"checkpoint saves blocked training for {outputs.saver.blocked_s:.2f} s in all")
    outputs.finish(progress)
    say(outputs.done_line(checkpointer, adapter=False))
    return 0


CHECKS = COMMON  # the options this recipe's config must get right (`waypoint validate` checks them too)


def main(argv: list[str] | None = None) -> int:
    return run_recipe(train, argv, description=__doc__.splitlines()[0], example="configs/tiny.yaml", checks=CHECKS)


if __name__ == "__main__":
    sys.exit(main())
