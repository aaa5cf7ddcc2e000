"""Preference tuning (DPO, cDPO, IPO, hinge, SimPO) of a model, full or LoRA/QLoRA; outputs in the input's format.

    python recipes/dpo_finetune.py --config configs/tiny_dpo.yaml [key=value ...]

The second stage after supervised fine-tuning: chosen/rejected pairs (TRL's formats) rendered with the model's
chat template. The same loop, config keys, checkpoints, resume, preemption and torchrun support as
recipes/full_finetune.py and recipes/lora_finetune.py, with the preference differences:

- the reference model is the input model (full runs) or the base with the adapters switched off (``lora:``
  set): before the first step one pass of it over every training and validation pair computes their reference
  log-probs, kept in ``output_dir/reference/`` and in every step's ``recipe_state.pt`` (hashed into its manifest), so
  training needs no second model in memory and no reference forward per step; a resume reuses the table after
  checking it was computed from the same data, template and model (``waypoint.run.reference_logps``);
- a step puts the chosen and the rejected completions of its pairs through one forward, takes each completion's
  summed label log-probs from the fused output projection (never the full logits) and the loss of ``loss.type``
  (``waypoint.training.preference_loss``); it logs TRL's ``rewards/*`` and ``logps/*`` beside loss, lr, tokens/s;
- full runs write the policy in the input's format and files; LoRA runs write the PEFT adapter and ``merged/``
  (QLoRA merges from the input's full-precision weights), as the SFT recipes do.
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

from waypoint import console
from waypoint.checkpointers import CheckpointError
from waypoint.cli.entry import run_recipe
from waypoint.cli.hub_source import base_model_name
from waypoint.cli.option_checks import COMMON, LORA, PREFERENCE, check_options
from waypoint.cli.run_config import config_as_given
from waypoint.data.data_order import iterate_batches, optimizer_steps_per_epoch
from waypoint.data.run_data import run_data
from waypoint.evaluation.during_training import TrainingEval
from waypoint.models.lora import adapters_disabled
from waypoint.run.output_dir import RunDir
from waypoint.run.plan import RunPlan
from waypoint.run.preemption import PreemptionWatch
from waypoint.run.progress import TrainingProgress
from waypoint.run.recipe_state import capture_recipe_state
from waypoint.run.reference_logps import input_digest, obtain_reference, reference_fingerprint
from waypoint.run.resume import RunStart, refusing
from waypoint.run.run_outputs import RunOutputs
from waypoint.run.step_content import adapter_step, model_step
from waypoint.training.distributed import Distributed
from waypoint.training.nonfinite import check_weights_finite, clip_gradients, step_is_finite
from waypoint.training.preference_loss import PreferenceLoss
from waypoint.training.preference_step import (IndexedPairs, evaluate_preferences, pair_collate, pairs_digest,
                                               preference_forward_backward, reference_pass)
from waypoint.training.recipe_model import load_adapters, load_model
from waypoint.training.seed import seed_everything

# beside waypoint.run.resume.BREAKING_KEYS: another adapter or base, or a LoRA run resumed as a full one
LORA_BREAKING = ("lora", "quantize_base", "nf4")


def train(cfg: DictConfig, dist: Distributed) -> int:
    """The run; ``run_recipe`` has checked the config, started the process group (under torchrun) and holds
    ``output_dir`` for it."""
    device, main = dist.device, dist.is_main
    say = print if main else (lambda *a, **k: None)  # noqa: E731
    lora = cfg.get("lora")
    if lora:
        check_options(cfg, LORA)
    elif cfg.get("quantize_base"):
        raise CheckpointError("quantize_base: a 4-bit base is frozen, so it needs a lora section (QLoRA); "
                              "set quantize_base=null for full fine-tuning")
    loss = PreferenceLoss(cfg.loss.type, cfg.loss.beta, cfg.loss.get("label_smoothing", 0.0), cfg.loss.get("gamma", 0.5))
    config = config_as_given(cfg)  # what each checkpoint records (URLs, not this machine's local copies)
    run_dir = RunDir(Path(cfg.output_dir), cfg.get("output_store"))

    # Where to start: the newest verified checkpoint of this run (resume=auto), or the input.
    start = RunStart(run_dir, cfg.resume, cfg.overwrite, config, dist, check=refusing(LORA_BREAKING))
    seed_everything(cfg.seed)
    # lm-eval tasks scored as it trains (eval: {tasks, every_n_steps}); resolved now, so a bad task fails here
    training_eval = TrainingEval.from_config(cfg.get("eval"), dist.world_size)

    # Model, on the meta device, sharded (FSDP2) under torchrun, then given its tensors. Full: the input's, or a
    # resumed step's. LoRA: always the input's base (4-bit with quantize_base: nf4), the adapters fresh or resumed.
    loaded = load_model(cfg, dist, start, lora, say)
    model, checkpointer = loaded.model, loaded.checkpointer
    if lora:
        original, sources = loaded.original, loaded.report.sources  # the merge reads the input's full-precision base again
        converter = load_adapters(model, checkpointer, start)
        say(f"lora: {len(loaded.wrapped)} layers ({', '.join(lora.targets)}), rank {lora.rank}, alpha {lora.alpha}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.activation_checkpointing = cfg.enable_activation_checkpointing
    model.train()

    # Data: pairs rendered with the chat template, validation held out; a global batch of batch_size x
    # gradient_accumulation_steps x processes pairs per step, each pair two sequences of one forward.
    tokenizer = instantiate(cfg.tokenizer)
    def make_dataset(**source):  # the config's dataset (with source=: a validation file)
        return instantiate(cfg.dataset, tokenizer=tokenizer, **source)
    dataset, validation = run_data(make_dataset, tokenizer, checkpointer, cfg.get("validation"), cfg.seed,
                                   packed_to=None, vocab_size=model.args.vocab_size, say=say,
                                   max_positions=getattr(model.args, "max_seq_len", None))
    pairs, held_out = IndexedPairs(dataset), IndexedPairs(validation.dataset) if validation else None
    collate = pair_collate(tokenizer.pad_id)
    accumulate = cfg.gradient_accumulation_steps
    steps_per_epoch = optimizer_steps_per_epoch(len(pairs), cfg.batch_size, accumulate, dist.world_size,
                                                cfg.max_steps_per_epoch)
    plan = RunPlan(steps_per_epoch, cfg.epochs, cfg.batch_size, accumulate, dist.world_size, cfg.seed,
                   save_every_n_steps=cfg.save_every_n_steps or 0, save_every_epoch=cfg.save_every_epoch)

    optimizer = instantiate(cfg.optimizer, params=trainable)
    scheduler = instantiate(cfg.lr_scheduler, optimizer=optimizer, num_training_steps=plan.total_steps)
    position = start.restore(optimizer, scheduler, model, plan, say)
    if position is None:
        return 0
    global_step, start_epoch, start_step = position
    loss_chunk = None if cfg.get("fused_loss", True) else 0  # None: chunks sized by the vocabulary; 0: full logits

    # Reference log-probs: the resumed step's table, or one pass of the reference model now (SimPO needs none).
    reference = None
    if loss.uses_reference:
        fingerprint = reference_fingerprint([pairs_digest(pairs), pairs_digest(held_out) if held_out else "-",
                                             input_digest(checkpointer.checkpoint_dir), cfg.dtype,
                                             str(cfg.get("quantize_base") if lora else None)])

        def compute():
            bar = console.bar(total=len(pairs) + (len(held_out) if held_out else 0), desc="reference", disable=not main)
            batch = cfg.get("reference_batch_size") or cfg.batch_size
            with adapters_disabled(model):  # LoRA: the base; full: the input model, not yet trained
                tables = [reference_pass(model, data, batch, collate, device, dist, loss_chunk, progress=bar.update)
                          if data else None for data in (pairs, held_out)]
            bar.close()
            return tables
        reference = obtain_reference(run_dir.path, start.path, start.state, fingerprint, compute, dist, say)

    # rank 0 logs: metrics.jsonl, TensorBoard (log_dir) and the experiment trackers (metric_loggers), a resumed run's own
    outputs = RunOutputs(cfg, config, run_dir, start, dist, global_step, sharded=dist.enabled and not lora, say=say)
    metrics = outputs.metrics
    save_merged = "never" if cfg.get("save_adapter_weights_only", False) else cfg.get("save_merged", "final")

    def save(epoch: int, step_in_epoch: int, final: bool, preempted: bool) -> Path:
        check_weights_finite(model, global_step, dist.any)  # a checkpoint is never written from nan or inf weights
        recipe = capture_recipe_state(plan, global_step, epoch, step_in_epoch, scheduler, config, dist, outputs.trackers)
        if reference is not None:  # the table travels with every step, verified with it on resume
            recipe.reference_logps = reference.as_state()
        if lora:
            content = adapter_step(model, optimizer, recipe, checkpointer, converter=converter,
                                   base_name=base_model_name(checkpointer.checkpoint_dir),
                                   max_lora_rank=cfg.get("max_lora_rank", 16), layout=checkpointer.adapter_layout(),
                                   original=original, sources=sources, dist=dist, verify=outputs.verify, report=tqdm.write,
                                   merge=save_merged == "every" or (save_merged == "final" and final))
        else:
            content = model_step(model, optimizer, checkpointer, recipe, final, dist, outputs.verify, tqdm.write)
        return outputs.saver.save(global_step, content, final=final or preempted)

    preemption = PreemptionWatch(cfg.preemption_signals)
    # a bar on a terminal, a plain line every progress_every_n_steps in a log (progress: auto | bar | lines | off)
    progress = TrainingProgress(plan.total_steps, global_step, cfg.get("progress_every_n_steps", 10), shown=main)
    first_step = global_step + 1
    train_reference = reference.train if reference is not None else None
    for epoch in range(start_epoch, cfg.epochs):
        first = start_step if epoch == start_epoch else 0
        batches = iterate_batches(pairs, cfg.batch_size, seed=cfg.seed, epoch=epoch, collate_fn=collate,
                                  start_batch=first * accumulate, rank=dist.rank, world_size=dist.world_size)
        for step_in_epoch in range(first, plan.steps_per_epoch):
            started = time.perf_counter()
            micro_batches = [next(batches)[1] for _ in range(accumulate)]
            loss_value, tokens, pair_metrics, aux_loss = preference_forward_backward(
                model, micro_batches, train_reference, loss, device, dist, loss_chunk)
            grad_norm = clip_gradients(trainable, cfg.clip_grad_norm)
            global_step += 1
            # A nan or inf stops the run here, before the weights change (or, with on_nonfinite=skip_step, skips the update).
            if step_is_finite(global_step, loss_value, grad_norm, model, cfg.get("on_nonfinite", "stop"), tqdm.write,
                              updated=global_step > first_step):
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            record = dict(step=global_step, epoch=epoch, loss=loss_value, lr=scheduler.get_last_lr()[0],
                          grad_norm=grad_norm, tokens_per_s=tokens / (time.perf_counter() - started), **pair_metrics)
            if aux_loss is not None:
                record["aux_loss"] = aux_loss
            if start.checkpoint and global_step == first_step:  # where a plot marks the resumed segment
                record["resumed"] = True
            if main:
                metrics.write(**record)
            if validation and validation.due(global_step, plan.total_steps):
                val = evaluate_preferences(model, held_out, reference.validation if reference is not None else None,
                                           loss, cfg.batch_size, collate, device, dist, loss_chunk)
                record.update({f"val_{key}": value for key, value in val.items()})
                if main:
                    metrics.write(step=global_step, **{f"val_{key}": value for key, value in val.items()})
            if training_eval and training_eval.due(global_step, plan.total_steps):
                scores = training_eval.run(model, tokenizer)  # the model and the random states as they were
                if main:
                    metrics.write(step=global_step, **scores)
            progress.update(global_step, loss=f"{loss_value:.4f}", acc=f"{record['rewards/accuracies']:.2f}",
                            margin=f"{record['rewards/margins']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                            **({"val_acc": f"{record['val_rewards/accuracies']:.2f}"} if "val_loss" in record else {}))

            # Checkpoints at optimizer-step boundaries only; a signal on any rank stops every rank here.
            if outputs.step_end(plan, global_step, epoch, step_in_epoch, preemption, save):
                return outputs.stop(global_step, preemption, progress)
    outputs.finish(progress)
    say(outputs.done_line(checkpointer, adapter=bool(lora)))
    return 0


CHECKS = COMMON | PREFERENCE  # the options this recipe's config must get right (`waypoint validate` checks them too)


def main(argv: list[str] | None = None) -> int:
    return run_recipe(train, argv, description=__doc__.splitlines()[0], example="configs/tiny_dpo.yaml", checks=CHECKS)


if __name__ == "__main__":
    sys.exit(main())
