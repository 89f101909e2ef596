"""LoRA on the experts: fitlm's LoRA training step beside transformers + PEFT's on the same Qwen3-MoE and batches
(issue #55). Not a script: bench/moe.py runs it (its `lora` part, with its own command, machine and rounds).

* fitlm: `finetune.method: lora` (r 8, alpha 16, no dropout) on attention (q/k/v/o_proj) and the stacked experts'
  gate_proj, up_proj, down_proj (fitlm.finetune.expert_lora: the grouped matmul computes the base and the
  adapters' A and B where torch has the kernel), `Trainer.train_step` as in the full-training rows;
* transformers + PEFT: the same checkpoint (experts implementation `--lora-hf-impl`) with PEFT's LoRA of the same
  r and alpha on the same attention Linears and, on transformers 5's fused experts, `target_parameters`
  `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (what a PEFT user trains on transformers 5; PEFT
  parametrizes each parameter as W + scaling·B·A, built for every expert in each forward); the model's own loss
  with its router aux loss, clip and torch's AdamW over the adapters, with fitlm's hyper-parameters;
* the same start: PEFT initializes its adapters (A random, B zero) and saves them, and fitlm's trainer reads that
  adapter (fitlm.finetune.peft_format.load_adapter) into its own. PEFT's gate_up_proj has one A per expert for
  gate and up, which fitlm reads as equal A_gate and A_up; from there fitlm's two follow their own gradients where
  PEFT's one follows their sum. The first two steps are the same training (B is zero at the first, so A has no
  gradient); after them they part a little (small size, 5 steps: the adapters' effects on the logits ~7% apart,
  the losses 2e-5), where `--lora-experts down_proj` (the same parameters on both sides) stays at float rounding
  (2e-6 and 5e-7): the shared A, not the setup;
* honesty checks: each step's token and aux loss against fitlm_lora's (a wrong scaling shows from step 2 at
  ~1e-3), and after round one's steps the adapters' effect on the logits of a batch (with adapters minus without)
  on both sides: `adapter_effect_rel_diff` = max |Δ_peft − Δ_fitlm| / max |Δ_fitlm| (~0.5 for a wrong
  scaling).
"""

from __future__ import annotations

import gc
from pathlib import Path

from common import log, machine
from moe_setup import batches_for, fitlm_contender, hf_contender, hf_model, loss_checks, summary, timed

R, ALPHA = 8, 16.0
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# `--lora-experts`: fitlm's stacked experts' projections, and transformers 5's fused expert parameters for PEFT.
# `down_proj` alone is the control where both sides have the same parameters (no A shared by gate and up).
EXPERTS = {
    "all": (["gate_proj", "up_proj", "down_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "down_proj": (["down_proj"], ["mlp.experts.down_proj"]),
}


def peft_model(ckpt: Path, impl: str, experts: str, adapter_dir: Path):
    """The transformers model of `ckpt` with PEFT's fresh adapters (seeded), which it saves to `adapter_dir`."""
    import peft
    import torch

    config = peft.LoraConfig(
        r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=ATTENTION, target_parameters=EXPERTS[experts][1]
    )
    torch.manual_seed(0)
    model = peft.get_peft_model(hf_model(ckpt, impl), config)
    model.save_pretrained(str(adapter_dir))
    return model.train()


def fitlm_lora(ckpt: Path, data_dir: Path, out: Path, size: dict, experts: str, adapter_dir: Path):
    """fitlm's LoRA step (step() -> (token loss, aux loss), its Trainer) whose adapters start as `adapter_dir`'s."""
    from fitlm.finetune.peft_format import load_adapter

    lora = {"r": R, "alpha": ALPHA, "dropout": 0.0, "target_modules": ATTENTION + EXPERTS[experts][0]}
    step, trainer = fitlm_contender(ckpt, data_dir, out, size, loop=False, finetune={"method": "lora", "lora": lora})
    _, tensors = load_adapter(adapter_dir)
    model = trainer.pm.modules[0]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(tensors) != trainable:  # every adapter of one side is one of the other's
        raise RuntimeError(f"PEFT's and fitlm's adapters differ: {sorted(set(tensors) ^ trainable)}")
    model.load_state_dict(tensors, strict=False)
    return step, trainer


def adapter_effect_diff(fit_model, hf_peft, ids) -> float:
    """max |Δ_peft − Δ_fitlm| / max |Δ_fitlm|, Δ = logits with the adapters − without, on ids [B, T]."""
    import torch

    from fitlm.finetune.lora import adapters_off

    with torch.no_grad():
        fit = fit_model(ids).float()
        with adapters_off(fit_model):
            fit = fit - fit_model(ids).float()
        hf = hf_peft(input_ids=ids).logits
        with hf_peft.disable_adapter():
            hf = hf - hf_peft(input_ids=ids).logits
    return float((hf - fit).abs().max() / fit.abs().max())


def trainable(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters() if p.requires_grad)


def lora_part(args, size: dict, ckpt: Path, data_dir: Path, tmp: Path, command: str) -> dict:
    """The LoRA part of a report: how it was run, and `step`, the summaries of fitlm_lora and hf_peft_lora."""
    how = {"command": command, "machine": machine(), "steps": args.steps, "warmup": args.warmup}
    how |= {"rounds": args.rounds, "hf_impl": args.lora_hf_impl, "r": R, "alpha": ALPHA}
    how |= {"experts": args.lora_experts}
    return how | {"step": lora_rounds(args, size, ckpt, data_dir, tmp)}


def lora_rounds(args, size: dict, ckpt: Path, data_dir: Path, tmp: Path) -> dict:
    """`--rounds` rounds of fitlm_lora and hf_peft_lora, interleaved step by step; their step summaries."""
    from fitlm.memory.tracking import peak_live_bytes

    steps = args.warmup + args.steps
    times: dict[str, list[list[float]]] = {}
    losses: dict[str, list[tuple[float, float]]] = {}
    extra: dict[str, dict] = {}
    for r in range(args.rounds):
        log(f"[{args.size}] LoRA round {r + 1}/{args.rounds}: fitlm_lora, transformers {args.lora_hf_impl} + PEFT")
        hf_peft = peft_model(ckpt, args.lora_hf_impl, args.lora_experts, tmp / f"peft{r}")
        fit_step, trainer = fitlm_lora(ckpt, data_dir, tmp / f"lora{r}", size, args.lora_experts, tmp / f"peft{r}")
        batches = batches_for(trainer.cfg, steps + 2)
        hf_step, opt = hf_contender(hf_peft, batches)
        contenders = {"fitlm_lora": fit_step, "hf_peft_lora": hf_step}
        holders = {"fitlm_lora": (trainer.pm.modules, trainer.step.optimizer), "hf_peft_lora": ([hf_peft], opt)}
        per, outs = timed(contenders, steps)
        for n in contenders:
            times.setdefault(n, []).append(per[n])
        if r == 0:
            losses = outs
            effect = adapter_effect_diff(trainer.pm.modules[0], hf_peft, batches[0]["input_ids"])
            extra = {n: {"trainable_params": trainable(holders[n][0])} for n in contenders}
            extra["hf_peft_lora"]["adapter_effect_rel_diff"] = effect
            for n, step in contenders.items():
                extra[n]["peak_bytes"] = peak_live_bytes(step, *holders[n], warmup_steps=0)["total"]
        del contenders, holders, trainer, hf_peft, opt
        gc.collect()
    out = summary(times, args.warmup, size["batch"] * size["seq"], "fitlm_lora")
    loss_checks(out, losses, "fitlm_lora")
    return {n: s | extra[n] for n, s in out.items()}


def lora_table(lora: dict) -> str:
    """A report's LoRA part as a markdown table, with its command."""
    rows = [
        f"LoRA r {lora['r']}, alpha {lora['alpha']:g} on q/k/v/o_proj and the experts (fitlm: "
        f"{'/'.join(EXPERTS[lora['experts']][0])}; transformers {lora['hf_impl']} + PEFT: target_parameters "
        f"{', '.join(EXPERTS[lora['experts']][1])}); {lora['steps']} timed steps after {lora['warmup']}, "
        f"{lora['rounds']} rounds; ratio vs fitlm_lora",
        "",
        "| contender | step ms | step tokens/s | step ratio | step peak MiB | trainable params | loss diff vs fitlm_lora "
        "| adapter effect rel. diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s in lora["step"].items():
        effect = s.get("adapter_effect_rel_diff")
        rows.append(
            f"| {n} | {s['median_s'] * 1e3:.0f} | {s['tokens_per_s']:,.0f} | {s['ratio_vs_fitlm']:.2f} "
            f"| {s['peak_bytes'] / 2**20:.1f} | {s['trainable_params']:,} | {s['loss_max_abs_diff']:.1e} "
            f"| {'' if effect is None else f'{effect:.1e}'} |"
        )
    return "\n".join(rows) + f"\n\n`{lora['command']}`\n"
