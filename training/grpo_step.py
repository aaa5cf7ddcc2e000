"""One step of online RL (GRPO family): sample ``num_generations`` completions of every prompt from the policy, score
them with the reward functions, turn the rewards into group advantages, and take ``num_iterations`` optimizer steps on
TRL's loss over them (``waypoint.training.grpo_loss``).

Determinism, whatever the number of processes: a step draws one seed from the run's sampling generator (kept in
recipe_state.pt), and each prompt's group samples from a generator seeded by that seed and the prompt's index in the
dataset, so the completions of a prompt depend on the run's seed, the step and the weights alone, never on which rank
or micro-batch holds it (``group_generator``).

Under FSDP2 the policy samples with its parameters gathered whole on every rank (``training.fsdp.gathered``): each
rank generates its own prompts' completions, forwards of different numbers, with no collective among them. The
rewards are gathered from every rank, as TRL gathers them, for the advantages ``scale_rewards: batch`` needs and for
the logged metrics; the rest of the step is each rank's micro-batches, ``accumulate`` of them, as in SFT.

Preemption: sampling and scoring take ``stop`` (the recipe's "a preemption signal arrived"), checked before every
token and polled while a reward function runs (``waypoint.rewards.bounded``). Once it is true on a rank, that rank
drops the step's samples; every rank then learns it at the collective after scoring (``dist.any``) and raises
``Preempted``, with nothing of the step trained, so the caller saves the last whole step. Each reward call is also
bounded by ``reward_timeout`` seconds; past it the run stops in one line naming the function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from waypoint.models.fused_loss import IGNORE_INDEX
from waypoint.models.generate import Sampling
from waypoint.agents.tool_loop import AgentRollout, ToolTurns
from waypoint.agents.toolbox import ToolError
from waypoint.models.sample_group import generate_groups, generate_rows, group_seed, row_generator
from waypoint.rewards.bounded import Interrupted
from waypoint.rewards.finite import group_problem, prompt_excerpt
from waypoint.rewards.scoring import RewardError, reward_name, score
from waypoint.training.fsdp import gathered, reshard
from waypoint.training.gathered_metrics import reduce_gathered
from waypoint.training.grpo_loss import GRPOLossOptions, group_advantages, grpo_loss, rollout_metrics, weighted_rewards
from waypoint.training.loss import backward_with_balance
from waypoint.training.sampling_correction import (
    SamplingCorrection, importance_sampling_ratio, reduce_sampling_metrics, sampling_metrics)

_MIX = 0x9E3779B97F4A7C15  # an odd 64-bit constant: prompt indices far apart in seed space


class Preempted(Exception):
    """A preemption signal (on this rank or another) cut the step's sampling or scoring short: nothing of it was
    trained; save the last whole step and stop."""


def step_seed(generator: torch.Generator) -> int:
    """The step's seed: one draw from the run's sampling generator (every rank draws the same)."""
    return int(torch.randint(2 ** 62, (1,), generator=generator))


def turn_seed(row_seed: int, turn: int) -> int:
    """The seed of a multi-turn rollout's turn ``turn`` (1, 2, ...; turn 0 samples from ``row_seed`` itself)."""
    return (row_seed + turn * _MIX) % 2 ** 63


def group_generator(seed: int, index: int) -> torch.Generator:
    """The generator prompt ``index`` (its place in the dataset) samples its group from at the step of ``seed``."""
    return torch.Generator().manual_seed((seed + index * _MIX) % 2 ** 63)


@dataclass(frozen=True)
class RolloutOptions:
    """How completions are sampled (TRL's ``GRPOConfig`` names)."""

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop_strings: tuple[str, ...] = ()
    mask_truncated_completions: bool = False
    max_tool_calling_iterations: int | None = None  # with tools: the most turns that call them (None: no limit)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.repetition_penalty)


@dataclass
class Samples:
    """A step's sampled rows: each row's ``prompts`` ids and ``completions`` ids, an engine's ``logps`` of them; with
    tools, each completion's ``model_masks`` (0 at tool output), ``messages`` (as the reward functions get them) and
    ``agents`` (the rollouts, their tools and environments)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    logps: list[list[float]] | None = None
    model_masks: list[list[int]] | None = None
    messages: list[list[dict]] | None = None
    agents: list[AgentRollout] | None = None


@dataclass
class Rollout:
    """One micro-batch's completions, ready for the loss: ``tokens`` [N, L] (each prompt then a completion, padded
    on the right), ``labels`` (-100 but at the completion's tokens), ``advantages`` [N]; ``old_logps`` and
    ``ref_logps`` [N, L - 1] when the loss needs them; from an engine (vLLM), ``sampling_logps`` [N, L - 1] (its
    log-prob of each completion token, 0 elsewhere) and the importance-sampling ratio that corrects for it."""

    tokens: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    sampling_ratio: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        return (self.labels[:, 1:] != IGNORE_INDEX).float()


class GRPOStep:
    """A GRPO step's parts, set up once per run; :meth:`rollouts` samples and scores, :meth:`train` takes the
    optimizer steps. ``engine``: None (sample with the policy, ``models.sample_group``), or an engine in its place
    (``sampling.vllm_engine.VLLMEngine``, given the policy's weights after each step by the caller) whose
    ``sample(prompts, seeds, max_tokens, sampling, stop_ids, stop_strings) -> (tokens, log-probs)`` samples a step's
    prompts in one batch, one seed a completion; ``correction``: TRL's importance-sampling correction of the engine's
    samples (None or disabled: none). ``reward_timeout``: the seconds one reward call may take (None: no bound).
    ``sample_batch``: how many prompts' groups the native sampler decodes in one loop (the recipe's batch_size);
    ``turns``: tools the model may call, each completion then a multi-turn rollout (``waypoint.agents.tool_loop``)."""

    def __init__(self, rollout: RolloutOptions, loss: GRPOLossOptions, reward_funcs: list[Callable],
                 reward_weights, tokenizer, stop_ids: list[int], conversational: bool, device: torch.device, dist,
                 loss_chunk: int | None = None, engine=None, reward_timeout: float | None = None,
                 correction: SamplingCorrection | None = None, sample_batch: int = 1, turns: ToolTurns | None = None
                 ) -> None:
        self.rollout, self.options, self.funcs, self.weights = rollout, loss, reward_funcs, reward_weights
        self.names = [reward_name(f) for f in reward_funcs]
        self.tokenizer, self.stop_ids, self.conversational = tokenizer, list(stop_ids), conversational
        self.device, self.dist, self.loss_chunk, self.engine = device, dist, loss_chunk, engine
        self.reward_timeout = reward_timeout
        self.sample_batch = max(1, sample_batch)  # the prompts the native sampler decodes together (a micro-batch's)
        self.correction = correction if engine is not None and correction is not None and correction.enabled else None
        self.turns = turns  # multi-turn rollouts with tools (waypoint.agents.tool_loop); None: one turn

    # Sampling and scoring ------------------------------------------------------------------------------------------

    def _sample(self, model, items: list[dict], seed: int, stop) -> Samples:
        """Every item's ``num_generations`` completions (and, from an engine, its log-probs of their tokens): item
        ``i``'s group from ``group_generator(seed, index)``, row ``r`` from its base seed + ``r`` (the native sampler's
        row generators; an engine's request seeds). The native sampler decodes ``sample_batch`` prompts' groups at a
        time in one loop; an engine takes them all. With tools, each row is a multi-turn rollout (``_agent``)."""
        if self.turns is not None:
            return self._agent(model, items, seed, stop)
        r, interrupt = self.rollout, _interrupter(stop)
        prompts = [item["prompt_ids"] for item in items for _ in range(r.num_generations)]
        if self.engine is None:
            out = []
            for first in range(0, len(items), self.sample_batch):
                chunk = items[first: first + self.sample_batch]
                for group in generate_groups(
                        model, [item["prompt_ids"] for item in chunk], r.num_generations, r.max_completion_length,
                        r.sampling, self.stop_ids, list(r.stop_strings), self._text if r.stop_strings else None,
                        [group_generator(seed, item["index"]) for item in chunk], interrupt):
                    out.extend(group)
            return Samples(prompts, out)
        if interrupt is not None:
            interrupt()
        seeds = [[base + row for row in range(r.num_generations)] for base in self._bases(items, seed)]
        completions, logps = self.engine.sample([item["prompt_ids"] for item in items], seeds, r.max_completion_length,
                                                r.sampling, self.stop_ids, list(r.stop_strings))
        if interrupt is not None:
            interrupt()
        return Samples(prompts, completions, logps)

    @staticmethod
    def _bases(items: list[dict], seed: int) -> list[int]:
        """Each item's group seed at the step of ``seed``: its row ``r`` samples from ``base + r``."""
        return [group_seed(group_generator(seed, item["index"])) for item in items]

    def _rows(self, model, prompts: list[list[int]], seeds: list[int], max_tokens: int, interrupt
              ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One completion of each prompt, row ``i`` from seed ``seeds[i]`` (the native sampler ``sample_batch``
        groups' rows at a time, or the engine all at once)."""
        r = self.rollout
        if self.engine is None:
            out, width = [], self.sample_batch * r.num_generations
            for first in range(0, len(prompts), width):
                out += generate_rows(model, prompts[first: first + width], max_tokens,
                                     [row_generator(s, 0) for s in seeds[first: first + width]], r.sampling,
                                     self.stop_ids, list(r.stop_strings), self._text if r.stop_strings else None,
                                     interrupt)
            return out, None
        if interrupt is not None:
            interrupt()
        return self.engine.sample(prompts, [[s] for s in seeds], max_tokens, r.sampling, self.stop_ids,
                                  list(r.stop_strings))

    def _agent(self, model, items: list[dict], seed: int, stop) -> Samples:
        """Multi-turn rollouts: each row's environment made and reset (its prompt re-rendered where ``reset``
        returned text), its first turn sampled from ``base + r`` as a single-turn row is, then turn ``t`` from
        ``turn_seed(base + r, t)`` after the tools answered (``waypoint.agents.tool_loop``)."""
        n, turns, interrupt = self.rollout.num_generations, self.turns, _interrupter(stop)
        rollouts, seeds = [], []
        for item, base in zip(items, self._bases(items, seed)):
            for row in range(n):
                toolbox, observation = turns.toolset.toolbox({"prompt": item["prompt"], **item["columns"]}, base + row,
                                                             stop)
                prompt = item["prompt_ids"]
                if observation is not None:  # appended to the last message, as TRL appends it
                    messages, content = item["prompt"], item["prompt"][-1]["content"]
                    content = content + [{"type": "text", "text": observation}] if isinstance(content, list) \
                        else content + observation
                    prompt = turns.prompt_ids(messages[:-1] + [{**messages[-1], "content": content}])
                if len(prompt) + self.rollout.max_completion_length > turns.max_positions:
                    raise ToolError(f"environment_factory: reset() made a prompt of {len(prompt)} tokens, which with "
                                    f"generation.max_completion_length={self.rollout.max_completion_length} passes the "
                                    f"model's {turns.max_positions} positions; return less text from reset()")
                rollouts.append(AgentRollout(prompt, toolbox))
                seeds.append(base + row)
        first, logps = self._rows(model, [a.prompt for a in rollouts], seeds, self.rollout.max_completion_length,
                                  interrupt)
        turns.run(rollouts, first, logps,
                  lambda prefixes, which, turn, most: self._rows(
                      model, prefixes, [turn_seed(seeds[i], turn) for i in which], most, interrupt), stop)
        return Samples([a.prompt for a in rollouts], [a.completion for a in rollouts],
                       None if logps is None else [a.logps for a in rollouts],
                       [a.model_mask for a in rollouts], [a.messages for a in rollouts], rollouts)

    def _text(self, ids: list[int]) -> str:
        stops = set(self.stop_ids) | {self.tokenizer.pad_id}
        return self.tokenizer.decode([t for t in ids if t not in stops])

    def _sample_and_score(self, model, items: list[dict], seed: int, stop) -> tuple[Samples, torch.Tensor]:
        """(every item's ``num_generations`` completions, their rewards per function); ``Preempted`` on every rank
        once ``stop()`` was true on one while it sampled, ran a tool or scored. Conversational completions reach the
        reward functions as TRL passes them: one assistant message, or with tools the rollout's messages (and each
        rollout's environment as ``environments``)."""
        n, interrupted = self.rollout.num_generations, False
        samples, per_func = Samples([], []), torch.zeros(0, len(self.funcs))
        try:
            with gathered(model) if self.dist.enabled and self.engine is None else contextlib.nullcontext():
                samples = self._sample(model, items, seed, stop)
            if items:
                completions = samples.completions
                if samples.messages is not None:
                    shown = samples.messages
                else:
                    texts = [self._text(ids) for ids in completions]
                    shown = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
                columns = {key: [item["columns"].get(key) for item in items for _ in range(n)]
                           for key in {k for item in items for k in item["columns"]}}
                if samples.agents is not None and self.turns.toolset.factory is not None:
                    columns["environments"] = [a.toolbox.environment for a in samples.agents]
                _, per_func = score(self.funcs, self.weights, [item["prompt"] for item in items for _ in range(n)],
                                    shown, completions, columns, timeout=self.reward_timeout, stop=stop)
        except Interrupted:
            interrupted = True
        if self.dist.any(interrupted):
            raise Preempted
        return samples, per_func

    def rollouts(self, model, micro_batches: list[list[dict]], seed: int,
                 stop: Callable[[], bool] | None = None) -> tuple[list[Rollout], dict[str, float]]:
        """(one :class:`Rollout` per micro-batch of prompt items, TRL's reward and completion metrics of the whole
        step) for the step whose seed is ``seed``; ``Preempted`` once ``stop()`` is true before the step is scored."""
        r, n = self.rollout, self.rollout.num_generations
        items = [item for batch in micro_batches for item in batch]
        samples, per_func = self._sample_and_score(model, items, seed, stop)
        completions = samples.completions
        terminated = torch.tensor([bool(ids) and (ids[-1] in self.stop_ids or self._stopped(ids)) for ids in completions])
        lengths = torch.tensor([len(ids) for ids in completions] if samples.model_masks is None
                               else [sum(mask) for mask in samples.model_masks])  # TRL: the model's tokens only

        # every rank's rewards, in rank order (TRL's gather), for the advantages and the metrics
        local = torch.cat([per_func, lengths[:, None].float(), terminated[:, None].float()], dim=1)
        everyone = torch.cat(self.dist.all_gather(local))
        all_per_func = everyone[:, : len(self.funcs)]
        weights = None if self.weights is None else torch.tensor(list(self.weights), dtype=torch.float32)
        rewards = weighted_rewards(all_per_func, weights)
        first = self.dist.rank * len(items)  # this rank's first group (every rank samples as many)
        problem = group_problem(rewards, n, self.options.scale_rewards,
                                lambda g: prompt_excerpt(items[g - first]["prompt"]) if 0 <= g - first < len(items)
                                else f"{g} of the step (rank {g // len(items)}'s)")
        if problem:
            raise RewardError(problem)
        advantages, zero_std = group_advantages(rewards, n, self.options.scale_rewards)
        metrics = rollout_metrics(all_per_func, self.names, everyone[:, -2], everyone[:, -1].bool(), weights)
        metrics.update(zero_std)
        if samples.agents is not None:
            metrics.update(self._tool_metrics(samples.agents, len(everyone)))
        start = self.dist.rank * len(completions)  # every rank samples as many
        mine = advantages[start: start + len(completions)]

        out, offset = [], 0
        for batch in micro_batches:
            rows = len(batch) * n
            prompt_ids = samples.prompts[offset: offset + rows]
            keep = [not (r.mask_truncated_completions and not bool(terminated[offset + i])) for i in range(rows)]
            masks = None if samples.model_masks is None else samples.model_masks[offset: offset + rows]
            rollout = self._pack(prompt_ids, completions[offset: offset + rows], keep, mine[offset: offset + rows],
                                 masks)
            if samples.logps is not None:
                rollout.sampling_logps = _aligned(prompt_ids, samples.logps[offset: offset + rows],
                                                  rollout.tokens.shape[1])
            out.append(rollout)
            offset += rows
        return out, metrics

    def _tool_metrics(self, agents: list[AgentRollout], everyone: int) -> dict[str, float]:
        """TRL's ``tools/call_frequency`` (calls a rollout, over every rank's) and ``tools/failure_frequency`` (the
        share of calls that failed)."""
        calls, failures = (self.dist.sum(float(sum(getattr(a.toolbox, k) for a in agents))) for k in ("calls", "failures"))
        return {"tools/call_frequency": calls / everyone, "tools/failure_frequency": failures / calls if calls else 0.0}

    def _stopped(self, ids: list[int]) -> bool:
        return bool(self.rollout.stop_strings) and any(s in self._text(ids) for s in self.rollout.stop_strings)

    def _pack(self, prompts: list[list[int]], completions: list[list[int]], keep: list[bool],
              advantages: torch.Tensor, model_masks: list[list[int]] | None = None) -> Rollout:
        """The rows as tensors; a completion's labels are its tokens, but where ``model_masks`` marks a tool's."""
        width = max(len(p) + len(c) for p, c in zip(prompts, completions))
        tokens = torch.full((len(prompts), width), self.tokenizer.pad_id, dtype=torch.long)
        labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
        for row, (p, c, kept) in enumerate(zip(prompts, completions, keep)):
            tokens[row, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
            if kept and c:
                labels[row, len(p): len(p) + len(c)] = torch.tensor(c, dtype=torch.long)
                if model_masks is not None:
                    tools = torch.tensor(model_masks[row], dtype=torch.bool).logical_not()
                    labels[row, len(p): len(p) + len(c)][tools] = IGNORE_INDEX
        return Rollout(tokens, labels, advantages.clone())

    def evaluate(self, model, prompts, seed: int, stop: Callable[[], bool] | None = None) -> dict[str, float]:
        """``val_reward`` (and ``val_rewards/<func>/mean``, ``val_completions/mean_length``): the mean reward of
        ``num_generations`` completions of every held-out prompt, sampled as in training from a generator fixed for
        the run (each evaluation sees the same draws), each rank its share of the prompts; ``Preempted`` as
        :meth:`rollouts`."""
        items = [prompts[i] for i in range(self.dist.rank, len(prompts), self.dist.world_size)]
        samples, per_func = self._sample_and_score(model, items, seed, stop)
        lengths = torch.tensor([float(len(ids)) for ids in samples.completions] if samples.model_masks is None
                               else [float(sum(mask)) for mask in samples.model_masks])
        per_func = torch.cat(self.dist.all_gather(per_func))
        lengths = torch.cat(self.dist.all_gather(lengths))
        weights = None if self.weights is None else torch.tensor(list(self.weights), dtype=torch.float32)
        out = {"val_reward": torch.nanmean(weighted_rewards(per_func, weights)).item(),
               "val_completions/mean_length": lengths.mean().item()}
        for i, name in enumerate(self.names):
            out[f"val_rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        return out

    # Log-probs and the loss --------------------------------------------------------------------------------------

    def token_logps(self, model, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropies) [N, L - 1] of the completion tokens under ``model`` (the sampling temperature's)."""
        return model(rollout.tokens.to(self.device), labels=rollout.labels.to(self.device), loss_chunk=self.loss_chunk,
                     per_token=True, temperature=self.rollout.temperature or 1.0)

    @torch.no_grad()
    def fill_fixed_logps(self, model, rollouts: list[Rollout], reference: Callable | None) -> None:
        """Before the updates: the sampling policy's log-probs when ``num_iterations`` > 1 or an engine's samples
        are corrected (the ratio's denominator for every iteration; TRL computes them then too), the correction's
        ratio, and the reference's log-probs when ``beta`` > 0 (``reference``: a context in which ``model`` is the
        reference, or a callable returning it)."""
        if self.options.num_iterations > 1 or self.correction is not None:
            for rollout in rollouts:
                rollout.old_logps = self.token_logps(model, rollout)[0]
                if self.correction is not None:
                    rollout.sampling_ratio = importance_sampling_ratio(
                        rollout.old_logps, rollout.sampling_logps.to(rollout.old_logps.device),
                        rollout.mask.to(rollout.old_logps.device), self.correction)
        if self.options.beta != 0.0:
            with reference() as ref_model:
                for rollout in rollouts:
                    rollout.ref_logps = self.token_logps(ref_model, rollout)[0]
        reshard(model)

    def backward(self, model, rollouts: list[Rollout]) -> tuple[float, dict[str, float]]:
        """One optimizer step's gradients over ``rollouts`` (this rank's micro-batches): each micro-batch's loss as
        TRL computes it, scaled so that N processes train as one. Returns (the loss over every rank, TRL's loss
        metrics averaged over micro-batches and ranks)."""
        w, o = self.dist.world_size, self.options
        num_items = None
        if o.loss_type in ("dapo", "cispo", "vespo"):  # the step's completion tokens over every rank
            num_items = torch.tensor(self.dist.sum(sum(float(r.mask.sum()) for r in rollouts)))
        total, logged = 0.0, []
        for rollout in rollouts:
            logps, entropies = self.token_logps(model, rollout)
            mask = rollout.mask.to(logps.device)
            loss, metrics = grpo_loss(logps, None if rollout.old_logps is None else rollout.old_logps.to(logps.device),
                                      None if rollout.ref_logps is None else rollout.ref_logps.to(logps.device),
                                      rollout.advantages.to(logps.device), mask, o, entropies, num_items, w,
                                      importance_sampling_ratio=None if rollout.sampling_ratio is None
                                      else rollout.sampling_ratio.to(logps.device))
            backward_with_balance(model, loss / w, self.dist, (rollout.tokens != self.tokenizer.pad_id), len(rollouts))
            total += float(loss.detach()) / w
            logged.append(metrics)
        return self.dist.sum(total), reduce_gathered([m for ms in self.dist.all_gather(logged) for m in ms])

    def sampling_metrics(self, rollouts: list[Rollout]) -> dict[str, float]:
        """TRL's ``sampling/*`` metrics of the step's engine samples against the policy's log-probs (empty without a
        correction): this rank's micro-batches as one batch, then every rank's combined as TRL's gathers do."""
        if self.correction is None:
            return {}
        width = max(r.mask.shape[1] for r in rollouts)
        pad = lambda t: torch.nn.functional.pad(t.float().cpu(), (0, width - t.shape[1]))  # noqa: E731
        ratios = [r.sampling_ratio.cpu() if self.correction.sequence_level else pad(r.sampling_ratio) for r in rollouts]
        mine = sampling_metrics(torch.cat([pad(r.old_logps) for r in rollouts]),
                                torch.cat([pad(r.sampling_logps) for r in rollouts]),
                                torch.cat([pad(r.mask) for r in rollouts]), torch.cat(ratios), self.correction)
        return reduce_sampling_metrics(self.dist.all_gather(mine))


def _aligned(prompts: list[list[int]], logps: list[list[float]], width: int) -> torch.Tensor:
    """An engine's log-probs of each completion's tokens, placed as ``token_logps`` places the policy's [N, width - 1]
    (position ``j`` scores token ``j + 1``), 0 elsewhere."""
    out = torch.zeros(len(prompts), width - 1)
    for row, (prompt, values) in enumerate(zip(prompts, logps)):
        if values:
            out[row, len(prompt) - 1: len(prompt) - 1 + len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def _interrupter(stop: Callable[[], bool] | None) -> Callable[[], None] | None:
    """What sampling calls before each token: ``Interrupted`` once ``stop()`` is true."""
    if stop is None:
        return None

    def interrupt() -> None:
        if stop():
            raise Interrupted
    return interrupt
