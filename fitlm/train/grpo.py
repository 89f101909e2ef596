"""`finetune.objective: grpo` in the trainer: the prompts, the reward functions, the reference and the sampler
of a run, asked for each step's micro batches (`GrpoRun.micro_batches`), and rollouts.jsonl.

What can be refused is refused before the output directory is touched (`grpo_problems`): prompts longer than
finetune.grpo.max_prompt_length, prompt + completion beyond the model's context, reward functions that cannot
be loaded, and a column a built-in reward reads that the prompts do not have.

A new generation batch is sampled every finetune.grpo.num_iterations steps, the g-th (0-based) for the steps
g·μ + 1 .. (g + 1)·μ, with its sampling seed and its prompts fixed by g. A run resumed at the start of a
generation batch therefore samples exactly what the uninterrupted run did (same weights, same seed, same
prompts); one resumed inside a batch (μ > 1, a checkpoint between its steps) samples that batch anew from the
restored weights, as the batch is not kept in checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from fitlm.config import Config, ConfigError
from fitlm.data.prompts import PromptDataset, PromptStream
from fitlm.data.tokenizer import Tokenizer
from fitlm.finetune.lora import adapters_off
from fitlm.parallel.apply import ParallelModel
from fitlm.parallel.data_parallel import plain_module
from fitlm.parallel.mesh import ParallelContext
from fitlm.step.grpo_objective import GrpoObjective
from fitlm.step.pair_objectives import frozen_copy
from fitlm.step.rewards import RewardError, load_rewards
from fitlm.step.rollout import Forward, Rollout, Rollouts


def grpo_problems(cfg: Config, data: PromptDataset) -> list[str]:
    """What stops a GRPO run before its first step, each naming the key or file and the fix."""
    g, longest = cfg.finetune.grpo, data.max_prompt_tokens
    problems = []
    allowed = g.longest_prompt(cfg.data.seq_length)
    if longest > allowed:
        problems.append(
            f"data.train: {data.path} holds a prompt of {longest} tokens, over finetune.grpo.max_prompt_length "
            f"({allowed}); raise max_prompt_length, or re-pack with `fitlm data pack --format prompts "
            f"--max-length {allowed}` to find and drop the long prompts"
        )
    if longest + g.max_completion_length > cfg.model.max_seq_len:
        problems.append(
            f"finetune.grpo.max_completion_length: {g.max_completion_length} tokens after a prompt of {longest} "
            f"(the longest in {data.path}) exceed the model's context, model.max_seq_len={cfg.model.max_seq_len}; "
            f"lower max_completion_length to {max(cfg.model.max_seq_len - longest, 0)} or shorten the prompts"
        )
    try:
        load_rewards(g.reward_funcs)
    except RewardError as e:
        problems.append(f"finetune.grpo.reward_funcs: {e}")
    for spec in g.reward_funcs:
        name, _, column = spec.partition(":")
        if name == "answer_equals" and (column or "answer") not in data.columns:
            problems.append(
                f"finetune.grpo.reward_funcs: {spec} compares the final answer with the prompts' "
                f"{column or 'answer'!r} column, which {data.path} does not have (its columns: "
                f"{', '.join(data.columns) or 'none'}); add it to every row and re-pack, or name the column: "
                "answer_equals:COLUMN"
            )
    return problems


def grpo_dry_run(cfg: Config, data: PromptDataset, world_size: int) -> dict:
    """`fitlm train --dry-run` of a GRPO config: its checks (ConfigError) and what each step samples."""
    if problems := grpo_problems(cfg, data):
        raise ConfigError(problems)
    g, t = cfg.finetune.grpo, cfg.train
    completions = t.micro_batch_size * t.gradient_accumulation_steps * cfg.parallel.data_parallel
    return {
        "model": cfg.model.arch,
        "processes": world_size,
        "objective": "grpo",
        "train_prompts": len(data.rows),
        "longest_prompt": data.max_prompt_tokens,
        "prompts_per_step": completions // g.num_generations,
        "completions_per_step": completions,
        "max_completion_length": g.max_completion_length,
        "reward_funcs": list(g.reward_funcs),
        "output_dir": str(cfg.train.output_dir),
    }


def reference_forward(cfg: Config, ctx: ParallelContext, policy: nn.Module) -> Forward:
    """The reference's forward (beta > 0): under LoRA/QLoRA the policy with its adapters switched off (no
    second copy), else a frozen copy of the starting model."""
    if cfg.finetune.adapters:

        def base(input_ids: torch.Tensor) -> torch.Tensor:
            with adapters_off(policy):
                return policy(input_ids)

        return base
    copy = frozen_copy(cfg, ctx)
    return lambda input_ids: copy(input_ids)


class GrpoRun:
    def __init__(
        self,
        cfg: Config,
        ctx: ParallelContext,
        pm: ParallelModel,
        tokenizer: Tokenizer,
        data: PromptDataset,
        output_dir: Path,
    ):
        g, t = cfg.finetune.grpo, cfg.train
        self.ctx, self.iterations = ctx, g.num_iterations
        per_rank = t.micro_batch_size * t.gradient_accumulation_steps // g.num_generations
        self.stream = PromptStream(data, per_rank, t.seed, ctx.dp_rank, ctx.dp)
        policy = plain_module(pm.model)
        reference = reference_forward(cfg, ctx, policy) if g.beta > 0 else None
        rewards = load_rewards(g.reward_funcs)
        # ZeRO-2/3 gather blocks and expert parallel exchanges tokens in every forward: ranks decode in lockstep
        collective = cfg.parallel.dims.fsdp_sharded or ctx.ep > 1
        peers = lockstep(ctx) if collective and ctx.distributed else None
        self.rollouts = Rollouts(cfg, policy, tokenizer, rewards, reference, ctx.device, peers)
        self.current: Rollout | None = None
        self.log_path = output_dir / "rollouts.jsonl" if t.observe.log_completions else None

    def micro_batches(self, step: int, objective: GrpoObjective) -> list[dict[str, torch.Tensor]]:
        """Step `step`'s (1-based) micro batches, sampling a new generation batch when the step starts one."""
        if (step - 1) % self.iterations == 0 or self.current is None:
            generation = (step - 1) // self.iterations
            rows, first = self.stream.batch(generation), self.stream.first(generation)
            self.current = self.rollouts.generate(rows, generation, first)
            self._log(step, self.current)
        else:  # a reused batch: nothing sampled this step
            self.current.metrics.update(sampling_seconds=0.0, sampling_tokens=0.0)
        objective.begin(self.current, self.ctx)
        return [m.batch() for m in self.current.micro]

    def _log(self, step: int, rollout: Rollout) -> None:
        """Every rank's completions of this step, written by the main rank in the order one process samples them
        (dp rank r holds the r-th slice of the generation batch's prompts)."""
        if self.log_path is None:
            return
        records = rollout.records
        if self.ctx.dp > 1:  # every rank takes part in the gather; only the main rank writes
            import torch.distributed as dist

            every: list[list[dict]] | None = [[] for _ in range(self.ctx.dp)] if self.ctx.dp_rank == 0 else None
            dist.gather_object(records, every, group=self.ctx.group("dp"), group_dst=0)
            records = [r for part in every or [] for r in part]
        if not self.ctx.is_main:
            return
        with self.log_path.open("a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps({"step": step, **record}, ensure_ascii=False, default=str) + "\n")


def lockstep(ctx: ParallelContext) -> Callable[[int], int]:
    """The largest of a count over every rank: under ZeRO-2/3 each decoding forward gathers blocks from all of
    them (under expert parallel it exchanges tokens), so they run as many as the busiest
    (fitlm.step.sampler.sample's `peers`)."""
    import torch.distributed as dist

    def peers(n: int) -> int:
        value = torch.tensor([n], dtype=torch.long, device=ctx.device)  # (NCCL reduces device tensors only)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    return peers


def grpo_objective(objective: object) -> GrpoObjective:
    assert isinstance(objective, GrpoObjective)  # (finetune.objective: grpo)
    return objective


__all__ = ["GrpoRun", "grpo_objective", "grpo_problems", "reference_forward"]
