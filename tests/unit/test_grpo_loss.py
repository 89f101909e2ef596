"""fitlm.step.grpo_loss against TRL's GRPOTrainer: on the same completions, rewards and log-probabilities, the
advantages, loss mask, loss, gradient w.r.t. the policy's log-probabilities, KL and clip metrics equal those of
TRL's own `_generate_and_score_completions` and `_compute_loss`, run on a trainer built without a model (the
attributes those methods read; generation, the forward and the reward functions answer with the fixed tensors)."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from fitlm.config.schema import GrpoConfig
from fitlm.step.grpo_loss import group_advantages, grpo_loss, loss_mask, nanstd

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

N, G, T = 3, 4, 6  # prompts, completions per prompt, completion tokens at most
EOS, PAD = 2, 0
MICRO_BATCHES = 2  # the step's accumulation micro batches (TRL: gradient_accumulation_steps = steps_per_generation)
NAMES = ["answer", "format"]
WEIGHTS = [1.0, 0.5]


def batch() -> dict:
    """N·G completions of varied lengths (completion 5 cut at T without EOS: truncated), their rewards per
    function with a None, a completion no function scored and a group whose rewards are all equal, and
    log-probabilities of the policy, the sampling policy (far enough off for clipping) and the reference."""
    g = torch.Generator().manual_seed(0)
    lengths = [6, 3, 4, 6, 2, 6, 5, 1, 4, 3, 6, 2]
    ends_with_eos = [True] * len(lengths)
    ends_with_eos[5] = False
    completions = []
    for n, eos in zip(lengths, ends_with_eos):
        ids = torch.randint(3, 50, (n,), generator=g).tolist()
        completions.append(ids[:-1] + [EOS] if eos else ids)
    rewards = torch.randint(0, 3, (N * G, len(NAMES)), generator=g).float()
    rewards[1, 1] = float("nan")  # one function returned None
    rewards[6] = float("nan")  # no function scored completion 6
    rewards[8:12] = torch.tensor([1.0, 2.0])  # the last group: all equal, no signal
    new = -torch.rand(N * G, T, generator=g) * 3  # [B, T]
    return {
        "completions": completions,
        "rewards": rewards,
        "new": new,
        # a shift per completion too, so that whole completions (GSPO's ratio) are clipped, not only tokens
        "old": new + (torch.rand(N * G, T, generator=g) - 0.5) * 0.8 + (torch.rand(N * G, 1, generator=g) - 0.5),
        "ref": new + (torch.rand(N * G, T, generator=g) - 0.5) * 0.6,
    }


def accelerator() -> SimpleNamespace:
    """One process: gathers and reductions return their input."""
    same = lambda x, *a, **k: x  # noqa: E731
    return SimpleNamespace(
        device=torch.device("cpu"), process_index=0, num_processes=1, gather=same, reduce=same, sync_gradients=True
    )


def trl_trainer(cfg: GrpoConfig, data: dict, new: torch.Tensor):
    """A GRPOTrainer holding only what its scoring and loss methods read; the forward answers `new` (the
    policy's log-probabilities) and the reference's, the reward functions answer data["rewards"]."""
    trainer = object.__new__(trl_grpo.GRPOTrainer)
    completions = data["completions"]

    def forward(model, *args, **kwargs):  # the policy's forward, or the reference's (ref_model)
        logps = data["ref"] if model == "ref" else new
        return logps, torch.zeros_like(new), None

    attrs = dict(
        accelerator=accelerator(),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        ref_model="ref",
        environment_factories=None,
        environments=[],
        tools=None,
        _generate=lambda prompts: (
            [[7, 8]] * len(prompts),
            completions,
            None,
            ["c"] * len(prompts),
            None,
            {},
            None,
            [],
        ),
        _tokenizer=SimpleNamespace(pad_token_id=PAD),
        eos_token_ids=[EOS],
        pad_to_multiple_of=None,
        args=SimpleNamespace(
            per_device_train_batch_size=N * G,
            steps_per_generation=MICRO_BATCHES,
            gradient_accumulation_steps=MICRO_BATCHES,
            gradient_checkpointing_kwargs=None,
            use_bias_correction_kl=False,
            delta=None,
        ),
        _get_per_token_logps_and_entropies=forward,
        _calculate_rewards=lambda *args: data["rewards"].clone(),
        multi_objective_aggregation="sum_then_normalize",
        reward_weights=torch.tensor(WEIGHTS),
        reward_func_names=NAMES,
        _metrics={"train": defaultdict(list)},
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [], "extra": {}},
        _pending_extra_logs={},
        _pending_metrics={},
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=MICRO_BATCHES,
        num_generations=G,
        max_completion_length=T,
        epsilon_low=cfg.epsilon,
        epsilon_high=cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high,
    )
    attrs.update(
        {k: getattr(cfg, k) for k in ("beta", "loss_type", "scale_rewards", "importance_sampling_level")},
        num_iterations=cfg.num_iterations,
        mask_truncated_completions=cfg.mask_truncated_completions,
    )
    trainer.__dict__.update(attrs)
    return trainer


def trl_step(cfg: GrpoConfig, data: dict, use_old: bool) -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
    """TRL's scored batch, loss, gradient w.r.t. the policy's log-probabilities and logged metrics."""
    new = data["new"].clone().requires_grad_()
    trainer = trl_trainer(cfg, data, new)
    scored = trainer._generate_and_score_completions([{"prompt": "p"} for _ in range(N * G)])
    if use_old:
        scored["old_per_token_logps"] = data["old"]
    loss = trainer._compute_loss(trainer.model, scored)
    (grad,) = torch.autograd.grad(loss, new)
    return scored, loss.detach(), grad, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


VARIANTS = [  # beta, epsilon_high, mask_truncated_completions, old policy kept (num_iterations > 1)
    (0.0, None, False, True),
    (0.04, 0.28, True, True),
    (0.04, None, False, False),
    (0.0, 0.28, True, False),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "beta{}-eh{}-masktrunc{}-old{}".format(*v))
@pytest.mark.parametrize(
    "loss_type,scale,level",
    list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], ["group", "batch", "none"], ["token", "sequence"])),
)
def test_grpo_loss_equals_trl(loss_type, scale, level, variant):
    beta, epsilon_high, mask_truncated, use_old = variant
    cfg = GrpoConfig(
        num_generations=G,
        max_completion_length=T,
        beta=beta,
        epsilon_high=epsilon_high,
        loss_type=loss_type,
        scale_rewards=scale,
        importance_sampling_level=level,
        mask_truncated_completions=mask_truncated,
        num_iterations=2 if use_old else 1,
        reward_funcs=NAMES,
    )
    data = batch()
    scored, trl_loss, trl_grad, trl_metrics = trl_step(cfg, data, use_old)

    ours_adv = group_advantages(data["rewards"], torch.tensor(WEIGHTS), G, scale, NAMES)
    torch.testing.assert_close(ours_adv.advantages, scored["advantages"])
    for key, value in ours_adv.metrics.items():
        assert close(value, trl_metrics[key]), (key, value, trl_metrics[key])

    lengths = torch.tensor([len(c) for c in data["completions"]])
    completion_mask = (torch.arange(T) < lengths.unsqueeze(1)).long()  # [B, T]
    truncated = torch.tensor([c[-1] != EOS for c in data["completions"]])
    mask = loss_mask(completion_mask, truncated, mask_truncated)
    assert torch.equal(mask, scored["completion_mask"])

    new = data["new"].clone().requires_grad_()
    ours = grpo_loss(
        new,
        data["old"] if use_old else None,
        data["ref"],
        ours_adv.advantages,
        mask,
        cfg,
        micro_batches=MICRO_BATCHES,
        tokens_per_rank=float(scored["num_items_in_batch"]),
    )
    (grad,) = torch.autograd.grad(ours.loss, new)
    torch.testing.assert_close(ours.loss.detach(), trl_loss)
    torch.testing.assert_close(grad, trl_grad)
    assert (ours.kl is None) == (beta == 0.0)
    for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert (key in ours.metrics) == (key in trl_metrics), key
    for key, value in ours.metrics.items():
        assert close(value, trl_metrics[key]), (key, value, trl_metrics[key])
    if use_old:  # the batch is off-policy enough for clipping to bite, so the clip terms are exercised
        assert ours.metrics["clip_ratio/region_mean"] > 0


def test_per_token_kl_is_k3_and_zero_at_the_reference():
    new = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    cfg = GrpoConfig(beta=0.1, reward_funcs=["length"])
    out = grpo_loss(new, None, ref, torch.zeros(1), torch.ones(1, 2), cfg, tokens_per_rank=2.0)
    d = -0.5
    torch.testing.assert_close(out.kl, torch.tensor([[math.exp(d) - d - 1, 0.0]]))


def test_nanstd_is_trls():
    x = torch.tensor([[1.0, float("nan"), 3.0, 4.0], [float("nan")] * 3 + [2.0]])
    theirs = pytest.importorskip("trl.trainer.utils").nanstd
    torch.testing.assert_close(nanstd(x, dim=1), theirs(x, dim=1), equal_nan=True)
    torch.testing.assert_close(nanstd(x), theirs(x), equal_nan=True)
