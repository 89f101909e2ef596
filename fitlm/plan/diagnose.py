"""OOM diagnosis: which component dominates, and which single change brings the plan under the limit.

Why single changes: a user fixing an out-of-memory error wants the smallest edit to the config,
with the arithmetic that shows it works ("recompute: full saves 11.2 GiB -> 61.3 GiB, fits").
Each remedy keeps what is learned unchanged (the global batch is held fixed), except the fine-tuning
ones offered when a pretrained model is fine-tuned (model.init_from): LoRA or QLoRA on q/v, or freezing the
bottom half, which train fewer parameters (and so say so); a LoRA run is offered QLoRA's 4-bit base; a GRPO run
whose rollout is the peak, half the accumulation (fewer prompts per step, and so says so).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fitlm import rules
from fitlm.plan.analytic import Breakdown, breakdown
from fitlm.plan.setup import Setup, to_overrides


@dataclass(frozen=True)
class Remedy:
    change: str  # the config edit, e.g. "memory.recompute: full"
    setup: Setup
    memory: Breakdown

    def saved(self, before: Breakdown) -> int:
        return before.total - self.memory.total


def dominant(b: Breakdown) -> str:
    parts = {k: v for k, v in b.as_dict().items() if k != "total"}
    return max(parts, key=parts.__getitem__)


def _tp_ok(s: Setup, tp: int) -> bool:
    return s.heads % tp == 0 and s.kv_heads % tp == 0 and s.ffn % tp == 0 and s.vocab % tp == 0


def _allowed(s: Setup, t: Setup) -> bool:
    """A remedy breaks no rule of fitlm.rules that the config itself keeps (DPO refuses tensor parallel and
    the chunked loss, for one)."""
    stages = ("config", "launch")
    values = rules.flatten(s.cfg.model_dump())
    trial = {**values, **rules.flatten(to_overrides(t))}
    return set(rules.broken(trial, stages)) <= set(rules.broken(values, stages))


def remedies(s: Setup) -> list[Remedy]:
    """Every single-key change that lowers this rank's peak, largest saving first."""
    trials: list[tuple[str, Setup]] = []
    for mode in ("selective", "full"):
        if s.recompute != mode and not (s.recompute == "full" and mode == "selective"):
            trials.append((f"memory.recompute: {mode}", replace(s, recompute=mode, recompute_every=1)))
    if s.dp > 1:
        for z in (1, 2, 3):
            if z > s.zero and not (z == 1 and (s.tp > 1 or s.pp > 1)):
                trials.append((f"parallel.zero_stage: {z}", replace(s, zero=z)))
    if not s.loss_chunk:
        trials.append(("memory.loss_chunk_size: 4096", replace(s, loss_chunk=4096)))
    if s.dims.fsdp_sharded and s.accum > 1 and not s.sync_every and s.pp == 1:  # pp reduces once per step anyway
        trials.append(("parallel.gradient_sync: every_micro_batch", replace(s, gradient_sync="every_micro_batch")))
    if s.mbs > 1 and s.mbs % 2 == 0 and (s.pp == 1 or (s.mbs // 2) % s.chunks == 0):
        trials.append(
            (
                f"train.micro_batch_size: {s.mbs // 2} (gradient_accumulation_steps: {s.accum * 2})",
                replace(s, mbs=s.mbs // 2, accum=s.accum * 2),
            )
        )
    if not s.offload:
        trials.append(("memory.cpu_offload: true", replace(s, offload=True)))
    if not s.act_offload and s.device_kind != "cpu":
        trials.append(("memory.activation_offload: true", replace(s, act_offload=True)))
    cp = s.cp * 2  # context parallel instead of half the data-parallel replicas: each sequence over twice the ranks
    if s.dp % 2 == 0 and s.pp == 1 and s.seq % (2 * cp) == 0 and s.method == "full":
        trials.append(
            (
                f"parallel.context_parallel: {cp} (data_parallel: {s.dp // 2})",
                replace(s, cp=cp, dp=s.dp // 2, accum=s.accum * 2),
            )
        )
    if s.dp % 2 == 0 and _tp_ok(s, s.tp * 2):
        trials.append(
            (
                f"parallel.tensor_parallel: {s.tp * 2} (data_parallel: {s.dp // 2})",
                replace(s, tp=s.tp * 2, dp=s.dp // 2, zero=s.zero if s.zero != 1 else 2, accum=s.accum * 2),
            )
        )
    if s.tp > 1 and not s.sp:
        trials.append(("parallel.sequence_parallel: true", replace(s, sp=True)))
    if s.level in ("O0", "O1"):
        trials.append(("memory.mixed_precision: O2", replace(s, level="O2")))
    if s.pretrained and s.method == "full":  # LoRA and freeze run under every layout
        qv = replace(s, lora_r=8, lora_targets=("q_proj", "v_proj"))
        trials.append(
            ("finetune.method: lora (r 8 on q_proj, v_proj; trains adapters only)", replace(qv, method="lora"))
        )
        # QLoRA only where fitlm.rules lets it run (torchao installed, no TP/PP/CP, not O3): `_allowed` drops it
        trials.append(
            (
                "finetune.method: qlora (r 8 on q_proj, v_proj; adapters on a 4-bit NF4 base)",
                replace(qv, method="qlora"),
            )
        )
        trials.append(
            (
                "finetune.method: freeze (freeze_layers: 0.5; trains the top half only)",
                replace(s, method="freeze", freeze_layers=0.5, freeze_embeddings=False),
            )
        )
    if s.pretrained and s.method == "lora":  # the same adapters on the base stored in 4 bits
        trials.append(("finetune.method: qlora (the same adapters on a 4-bit NF4 base)", replace(s, method="qlora")))
    trials += _grpo_trials(s)
    before = breakdown(s).total
    out = [Remedy(name, t, breakdown(t)) for name, t in trials if _allowed(s, t)]
    out = [r for r in out if r.memory.total < before]
    out.sort(key=lambda r: r.memory.total)
    return out


def _grpo_trials(s: Setup) -> list[tuple[str, Setup]]:
    """GRPO samples a rank's whole batch at once (fitlm.plan.grpo): half the accumulation samples half the
    completions (fewer prompts per step, so it changes what is learned, and says so); the rules drop it where the
    batch would no longer hold whole groups of G."""
    if s.objective != "grpo" or s.accum < 2 or s.accum % 2:
        return []
    change = (
        f"train.gradient_accumulation_steps: {s.accum // 2} (GRPO samples half the completions at once: "
        "half the prompts per step)"
    )
    return [(change, replace(s, accum=s.accum // 2))]


def oom_message(cfg, phase: str, rank: int, device_memory: int | None = None) -> str:
    """The paragraph a training run should print when it runs out of memory (the trainer's hook):
    where it failed, the plan's breakdown for this layout and the top remedies by memory saved."""
    from fitlm.plan.setup import from_config

    s = from_config(cfg)
    b = breakdown(s)
    gib = 1024**3
    parts = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in b.as_dict().items())
    lines = [
        f"out of memory on rank {rank} during {phase}. The plan for this layout ({parts}; peak during "
        f"{b.phase}) is dominated by {dominant(b)}."
    ]
    if device_memory:
        lines.append(f"The device holds {device_memory / gib:.2f} GiB.")
    fixes = remedies(s)[:5]
    if fixes:
        lines.append(
            "Remedies, by memory saved: "
            + "; ".join(
                f"{r.change} saves {r.saved(b) / gib:.2f} GiB (-> {r.memory.total / gib:.2f} GiB)" for r in fixes
            )
            + "."
        )
    lines.append("Run `fitlm plan CONFIG --search` for the fastest layout that fits.")
    return " ".join(lines)
