"""GRPO's generation batch on one data-parallel rank: sample, score, and cut into the step's micro batches.

A step trains on train.micro_batch_size × gradient_accumulation_steps completions per rank: that many / G of
this rank's prompts (`fitlm.data.prompts.PromptStream`), G completions each (`fitlm.step.sampler`). Every
finetune.grpo.num_iterations steps a new batch is sampled; the steps between reuse it, with the log-probabilities
of the policy that sampled it (`old`) kept for the importance ratio. For each batch, in order:

    completions    sampled from the current weights (the plain module in eval mode, autocast as training)
    rewards        every reward function on (prompts, completion texts, the rows' other columns)
    advantages     per scale_rewards, over this rank's groups (a rank holds whole groups)
    old            the policy's per-token log-probabilities, when num_iterations > 1
    ref            the reference's, when beta > 0: adapters switched off under LoRA/QLoRA, else a frozen copy

Sequences are prompt + completion right-padded: causal attention never looks right, so the training forward
needs no mask and gives each row its own positions from 0. `labels` holds each completion token at the
position whose logits predict it (-100 elsewhere), the training loss's convention; log-probabilities are of
softmax(logits / temperature), as TRL's are.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from fitlm.config import Config
from fitlm.data.prompts import PromptRow
from fitlm.data.tokenizer import Tokenizer
from fitlm.memory.precision import autocast
from fitlm.models.loss import IGNORE_INDEX
from fitlm.parallel.data_parallel import whole_root
from fitlm.step.grpo_loss import group_advantages, loss_mask
from fitlm.step.rewards import BUILTINS, Reward, score, total_rewards
from fitlm.step.sampler import sample, sampling_seed

# (input_ids [B, T]) -> logits [B, T, V], without gradients: a model's forward (the policy, or the reference)
Forward = Callable[[torch.Tensor], torch.Tensor]


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(label) under softmax(logits / temperature), fp32: logits [B, T, V], labels [B, T] -> [B, T], 0 where
    the label is -100."""
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    return (picked - torch.logsumexp(scaled, dim=-1)) * (labels != IGNORE_INDEX)


@dataclass
class MicroRollout:
    """One micro batch of completions: what the step's loop feeds the model and what the loss reads beside it."""

    input_ids: torch.Tensor  # [b, T] prompt + completion, right-padded
    labels: torch.Tensor  # [b, T] completion tokens at their predicting position, else -100
    advantages: torch.Tensor  # [b]
    mask: torch.Tensor  # [b, T] float: the loss's tokens (truncated completions out when masked)
    old: torch.Tensor | None = None  # [b, T] the sampling policy's log-probabilities (num_iterations > 1)
    ref: torch.Tensor | None = None  # [b, T] the reference's (beta > 0)

    def batch(self) -> dict[str, torch.Tensor]:
        """The micro batch as the step's loop reads one: with data.document_mask, each row one document from
        position 0 (its padding on the right changes nothing a causal forward computes)."""
        b, t = self.input_ids.shape
        positions = torch.arange(t, device=self.input_ids.device).expand(b, t)  # [b, T]
        documents = torch.zeros_like(self.input_ids)  # [b, T]
        return {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "position_ids": positions,
            "document_ids": documents,
        }


@dataclass
class Rollout:
    """A rank's generation batch, cut into the step's micro batches, with its metrics and its rows for
    rollouts.jsonl."""

    micro: list[MicroRollout]
    metrics: dict[str, float]  # this rank's sums and counts (reduced over ranks by the objective)
    records: list[dict[str, Any]] = field(default_factory=list)


def sequences(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], labels [B, T]) of prompt + completion rows, right-padded with pad_id."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        if c:  # position t predicts token t + 1
            labels[i, len(p) - 1 : len(p) + len(c) - 1] = torch.tensor(c, dtype=torch.long)
    return ids, labels


class Rollouts:
    """Samples and scores one rank's generation batches (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        policy: nn.Module,
        tokenizer: Tokenizer,
        rewards: list[Reward],
        reference: Forward | None,
        device: torch.device,
        peers: Callable[[int], int] | None = None,
    ):
        """`peers`: fitlm.step.sampler.sample's (ranks sharing sharded weights decode in lockstep)."""
        self.cfg, self.g, self.peers = cfg, cfg.finetune.grpo, peers
        self.policy, self.tokenizer, self.rewards = policy, tokenizer, rewards
        self.reference, self.device = reference, device
        weights = self.g.reward_weights or [1.0] * len(rewards)
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.keys = reward_keys(rewards)

    def generate(self, rows: list[PromptRow], generation: int, first: int) -> Rollout:
        """Generation batch `generation` (0-based) of this rank from its prompt rows, the first of them at place
        `first` of the global batch (their sampling seeds)."""
        g, micro = self.g, self.cfg.train.micro_batch_size
        started = time.perf_counter()
        was_training = self.policy.training
        self.policy.eval()  # no dropout while sampling
        try:
            with autocast(self.cfg.memory, self.device), whole_root(self.policy):
                samples = sample(
                    self.policy,
                    [r.ids for r in rows],
                    g,
                    self.tokenizer.stop_ids,
                    [sampling_seed(self.cfg.train.seed, generation, first + i) for i in range(len(rows))],
                    self.peers,
                )
        finally:
            self.policy.train(was_training)
        sampling_s = time.perf_counter() - started
        prompts = [r for r in rows for _ in range(g.num_generations)]
        texts = [self.tokenizer.decode(c) for c in samples.completions]
        columns = {k: [r.columns.get(k) for r in prompts] for k in sorted({k for r in rows for k in r.columns})}
        per_func = score(self.rewards, [r.text for r in prompts], texts, columns)  # [B, F]
        adv = group_advantages(per_func, self.weights, g.num_generations, g.scale_rewards, self.keys)
        ids, labels = sequences([r.ids for r in prompts], samples.completions, self.tokenizer.pad_id)
        truncated = torch.tensor(samples.truncated)
        mask = loss_mask((labels != IGNORE_INDEX).float(), truncated, g.mask_truncated_completions)
        lengths_in = [len(r.ids) + len(c) for r, c in zip(prompts, samples.completions)]
        parts = []
        for s in range(0, len(prompts), micro):
            w = max(lengths_in[s : s + micro])  # this micro batch's longest row: no column of padding only
            part = (ids[s : s + micro, :w], labels[s : s + micro, :w], adv.advantages[s : s + micro])
            parts.append(self._micro(*part, mask[s : s + micro, :w]))
        lengths = torch.tensor([float(len(c)) for c in samples.completions])
        metrics = {
            **adv.metrics,
            "completions/mean_length": lengths.mean().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
            "entropy": samples.entropy_sum / max(samples.tokens, 1),
            "sampling_tokens": float(samples.tokens),
            "sampling_seconds": sampling_s,
            "loss_tokens": float(mask.sum()),
            "train_tokens": float(sum(lengths_in)),
        }
        total = total_rewards(per_func, self.weights)
        records = [
            {
                "prompt": p.text,
                "completion": t,
                "reward": _num(total[i]),
                **{k: _num(per_func[i, j]) for j, k in enumerate(self.keys)},
                **p.columns,
            }
            for i, (p, t) in enumerate(zip(prompts, texts))
        ]
        return Rollout(parts, metrics, records)

    @torch.no_grad()
    def _micro(self, ids: torch.Tensor, labels: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> MicroRollout:
        ids, labels, mask = ids.to(self.device), labels.to(self.device), mask.to(self.device)
        temperature = self.g.temperature
        out = MicroRollout(ids, labels, adv.to(self.device), mask)
        with autocast(self.cfg.memory, self.device):
            if self.g.num_iterations > 1:
                out.old = token_logps(self.policy(ids), labels, temperature)
            if self.reference is not None:
                out.ref = token_logps(self.reference(ids), labels, temperature)
        return out


def reward_keys(rewards: list[Reward]) -> list[str]:
    """The names a reward is logged under (rewards/<key>/mean, rollouts.jsonl), as TRL's: the function's name
    (`check` of `rewards.py:check`), a built-in's own (`answer_equals`), in characters every tracker takes
    (MLflow refuses `:`); a name taken twice gets its position appended."""
    keys = []
    for r in rewards:
        builtin = r.name.partition(":")[0]
        key = builtin if builtin in BUILTINS else r.name.rpartition(":")[2]  # module:function -> function
        keys.append(re.sub(r"[^A-Za-z0-9_.-]", "_", key))
    return [k if keys.count(k) == 1 else f"{k}_{i}" for i, k in enumerate(keys)]


def _num(x: torch.Tensor) -> float | None:
    """A reward for JSON: None where it was None (NaN)."""
    v = float(x)
    return None if v != v else round(v, 6)


__all__ = ["Forward", "MicroRollout", "Rollout", "Rollouts", "sequences", "token_logps"]
