"""Group Relative Policy Optimization's loss (`finetune.objective: grpo`), from per-token log-probabilities: equal
to TRL's GRPOTrainer for every `loss_type`, `scale_rewards` and `importance_sampling_level` it shares with fitlm
(tests/unit/test_grpo_loss.py drives TRL's own methods as the reference).

A generation batch holds N prompts × G completions (G = finetune.grpo.num_generations), each prompt's group
consecutive. Each completion's rewards (one per reward function, NaN where a function returned None) are summed
with their weights, ignoring NaN; a completion every function left unscored gets advantage 0 and stays out of its
group's baseline. The advantage is the total minus its group's mean, divided by (std + 1e-4) with std the group's
(`group`), the whole batch's (`batch`) or not divided (`none`); std is Bessel-corrected, as TRL's.

Per token t of completion i, with new/old/ref the log-probabilities under the policy being trained, the policy
that sampled the completion (detached; the policy itself when num_iterations is 1) and the reference:

    r      = exp(new − old)  per token (`token`), or exp(mean over i's tokens of new − old) (`sequence`, GSPO)
    loss   = −min(r · A_i, clip(r, 1 − epsilon, 1 + epsilon_high) · A_i) + beta · KL
    KL     = exp(ref − new) − (ref − new) − 1   (the k3 estimator; only when beta > 0)

and the per-token losses over the completion tokens (mask) become one number by `loss_type`:

    grpo     per-completion mean, then the mean over completions
    bnpo     sum / the micro batch's tokens
    dr_grpo  sum / (completions × max_completion_length)
    dapo     sum / the step's tokens per rank (all micro batches, all ranks, divided by the ranks)

The value returned for a micro batch is TRL's: its gradients, summed over the step's micro batches and averaged
over the data-parallel ranks, are the step's. So grpo, bnpo and dr_grpo divide by the micro batches of the step,
and dapo's denominator already spans them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitlm.config.schema import GrpoConfig
from fitlm.step.rewards import total_rewards

STD_EPS = 1e-4  # TRL's: keeps a group whose rewards are all equal at advantage 0 instead of 0/0


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaN (torch has none), over `dim` or all of x; NaN where fewer
    than 2 values count."""
    if dim is None:
        return nanstd(x.flatten(), dim=0)
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim)
    std = (var * count / (count - 1)).sqrt()
    return torch.where(count > 1, std, torch.full_like(std, float("nan")))


@dataclass(frozen=True)
class Advantages:
    """A generation batch's advantages [N·G] and the reward statistics logged beside the loss."""

    advantages: torch.Tensor  # [N·G], 0 for a completion no reward function scored
    metrics: dict[str, float]  # reward, reward_std, frac_reward_zero_std, rewards/<name>/mean and /std


def group_advantages(
    per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, scale: str, names: list[str]
) -> Advantages:
    """Advantages from the rewards per_func [N·G, F] (NaN = None) of N groups of `num_generations` consecutive
    completions, with std scaling `scale` (group, batch, none); `names` are the F functions' (for the metrics)."""
    total = total_rewards(per_func, weights)  # [N·G]
    groups = total.view(-1, num_generations)  # [N, G]
    baseline = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)  # [N·G]
    if scale == "batch":
        std = nanstd(total).expand_as(total)  # [N·G]: one std for the whole batch
    elif scale in ("group", "none"):  # `none` still needs the group std to log the groups without signal
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)  # [N·G]
    else:
        raise ValueError(f"finetune.grpo.scale_rewards: {scale!r} is not group, batch or none")
    advantages = total - baseline
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    metrics = {
        "reward": torch.nanmean(total).item(),
        "reward_std": nanstd(total).item(),
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
    }
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    return Advantages(torch.nan_to_num(advantages, nan=0.0), metrics)


def loss_mask(completion_mask: torch.Tensor, truncated: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """The tokens the loss counts [B, T]: the completion's (completion_mask [B, T]), none of a completion cut at
    max_completion_length (truncated [B] bool: it ends without end-of-sequence) when mask_truncated is set."""
    if not mask_truncated:
        return completion_mask
    return completion_mask * (~truncated).unsqueeze(1).to(completion_mask.dtype)


def log_importance_weights(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log(new/old policy): [B, T] per token, or [B, 1] the completion's mean over its tokens (GSPO)."""
    log_ratio = new - old  # [B, T]
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    raise ValueError(f"finetune.grpo.importance_sampling_level: {level!r} is not token or sequence")


def per_token_kl(new: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """KL(policy ‖ reference) per token by the k3 estimator, [B, T]: unbiased, never negative."""
    delta = ref - new
    return torch.exp(delta) - delta - 1


@dataclass(frozen=True)
class GrpoLoss:
    """One micro batch's loss (with its gradient), its per-token KL [B, T] (None when beta is 0) and the metrics
    TRL logs for it: kl, clip_ratio/low_mean, high_mean, region_mean, low_min, high_max."""

    loss: torch.Tensor
    kl: torch.Tensor | None
    metrics: dict[str, float]


def grpo_loss(
    new: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GrpoConfig,
    micro_batches: int = 1,
    tokens_per_rank: float | None = None,
) -> GrpoLoss:
    """The loss of B completions: log-probabilities new (the policy, with gradient), old (the sampling policy;
    None = new, detached) and ref (the reference; needed when cfg.beta > 0), each [B, T] over completion tokens,
    advantages [B], mask [B, T] (loss_mask). `micro_batches`: the step's accumulation micro batches;
    `tokens_per_rank` (dapo): the step's mask tokens over all ranks divided by the ranks."""
    old = new.detach() if old is None else old
    adv = advantages.unsqueeze(1)  # [B, 1]
    ratio = torch.exp(log_importance_weights(new, old, mask, cfg.importance_sampling_level))  # [B, T] or [B, 1]
    low, high = cfg.epsilon, cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    token_loss = -torch.min(ratio * adv, clipped * adv)  # [B, T] or [B, 1], broadcast by the mask below
    kl = None
    if cfg.beta != 0.0:
        if ref is None:
            raise ValueError("finetune.grpo.beta > 0 needs the reference's log-probabilities")
        kl = per_token_kl(new, ref)  # [B, T]
        token_loss = token_loss + cfg.beta * kl
    loss = aggregate(token_loss, mask, cfg, micro_batches, tokens_per_rank)
    metrics = clip_metrics(ratio, adv, mask, low, high)
    if kl is not None:
        metrics["kl"] = masked_mean(kl.detach(), mask)
    return GrpoLoss(loss, kl, metrics)


def aggregate(
    token_loss: torch.Tensor, mask: torch.Tensor, cfg: GrpoConfig, micro_batches: int, tokens_per_rank: float | None
) -> torch.Tensor:
    """Per-token losses [B, T] (or [B, 1]) over the mask [B, T] as one micro batch's loss, by cfg.loss_type."""
    summed = (token_loss * mask).sum()
    if cfg.loss_type == "grpo":
        loss = ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif cfg.loss_type == "bnpo":
        loss = summed / mask.sum().clamp(min=1.0)
    elif cfg.loss_type == "dr_grpo":
        loss = summed / (token_loss.shape[0] * cfg.max_completion_length)
    elif cfg.loss_type == "dapo":
        if tokens_per_rank is None:
            raise ValueError("loss_type dapo needs the step's tokens per rank (tokens_per_rank)")
        return summed / max(tokens_per_rank, 1.0)  # already spans the step's micro batches
    else:
        raise ValueError(f"finetune.grpo.loss_type: {cfg.loss_type!r} is not grpo, bnpo, dr_grpo or dapo")
    return loss / micro_batches


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the mask's tokens of x [B, T]; of x [B, 1] (one value per completion), over the completions."""
    if x.shape[1] == 1:
        return (x.sum() / max(x.shape[0], 1)).item()
    return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()


def nan_extreme(x: torch.Tensor, largest: bool) -> float:
    """The largest (or smallest) of x [B] ignoring NaN; NaN when all are."""
    # NaN mapped past every value rather than indexed away: a boolean index has a data-dependent shape, which
    # `fitlm plan --simulate`'s fake tensors cannot run
    fill = float("-inf") if largest else float("inf")
    if x.numel() == 0:
        return float("nan")
    filled = torch.where(torch.isnan(x), fill, x)
    value = (filled.max() if largest else filled.min()).item()
    return float("nan") if value == fill else value


def clip_metrics(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> dict:
    """Shares of tokens whose ratio [B, T] (or [B, 1]) was clipped where clipping bites (below 1 − low with a
    negative advantage, above 1 + high with a positive one), and the extreme completions' shares."""
    is_low = ((ratio < 1 - low) & (adv < 0)).float()
    is_high = ((ratio > 1 + high) & (adv > 0)).float()

    def per_completion(x: torch.Tensor) -> torch.Tensor:  # [B]; NaN for a completion with no tokens
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    return {
        "clip_ratio/low_mean": masked_mean(is_low, mask),
        "clip_ratio/high_mean": masked_mean(is_high, mask),
        "clip_ratio/region_mean": masked_mean(torch.maximum(is_low, is_high), mask),
        "clip_ratio/low_min": nan_extreme(per_completion(is_low), largest=False),
        "clip_ratio/high_max": nan_extreme(per_completion(is_high), largest=True),
    }


__all__ = ["Advantages", "GrpoLoss", "group_advantages", "grpo_loss", "loss_mask", "nanstd", "per_token_kl"]
