"""The Qwen3-MoE, batches and training-step contenders that bench/moe.py and bench/moe_lora.py share.

Not a script. A transformers-made Qwen3-MoE saved and loaded into fitlm (`model.init_from`); fitlm's
`Trainer.train_step` beside the transformers model's own loss + router aux loss, clip and torch's AdamW, with
fitlm's hyper-parameters (LR, WD, BETAS, EPS, CLIP, AUX_COEF) on both sides.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from common import fitlm_config, median

SIZES = {
    # a small Qwen3-MoE: 16 experts, 4 per token, ~256 rows per expert at batch 4 x 256
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "moe_intermediate_size": 256,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "vocab_size": 2048,
        "batch": 4,
        "seq": 256,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 1024,
        "batch": 2,
        "seq": 32,
    },
}
HF_IMPLS = ("eager", "batched_mm", "grouped_mm")
LR, WD, BETAS, EPS, CLIP, AUX_COEF = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0, 0.001


@contextlib.contextmanager
def loop_path():
    """fitlm's GroupedExperts with the per-expert loop forced (the grouped matmul reported unsupported)."""
    import fitlm.models.experts as moe

    saved = moe.grouped_mm_supported
    moe.grouped_mm_supported = lambda device, dtype, traced=False: False
    try:
        yield
    finally:
        moe.grouped_mm_supported = saved


def hf_checkpoint(size: dict, out: Path) -> Path:
    """A seeded transformers Qwen3-MoE saved to `out` (fp32, eager-free sdpa attention, no cache)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = {k: v for k, v in size.items() if k not in ("batch", "seq")}
    cfg = AutoConfig.for_model(
        "qwen3_moe",
        **dims,
        max_position_embeddings=size["seq"],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        router_aux_loss_coef=AUX_COEF,
        output_router_logits=True,
        use_cache=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(out)
    return out


def hf_model(path: Path, impl: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.float().train()


def batches_for(cfg, n: int) -> list[dict]:
    """The first n batches fitlm's Trainer reads (same dataset, seed and loader)."""
    from fitlm.data.dataset import PackedDataset
    from fitlm.data.loader import SequenceLoader

    loader = SequenceLoader.from_config(
        PackedDataset(cfg.data.train), cfg.data, cfg.train.micro_batch_size, seed=cfg.train.seed, shuffle=True
    )
    return [next(loader) for _ in range(n)]


# --------------------------------------------------------------------------- contenders: the step


def fitlm_contender(ckpt: Path, data_dir: Path, out: Path, size: dict, loop: bool, finetune: dict | None = None):
    """(step() -> (token loss, aux loss), its Trainer); `finetune`: the config's finetune section (LoRA)."""
    from fitlm.models.hf import read_hf_config
    from fitlm.train.trainer import Trainer

    model = read_hf_config(ckpt).model_dump(exclude_unset=True) | {"init_from": str(ckpt)}
    train = {"lr_schedule": "constant", "lr": LR, "weight_decay": WD, "grad_clip": CLIP, "eps": EPS}
    train |= {"beta1": BETAS[0], "beta2": BETAS[1]}
    cfg = fitlm_config(
        model, data_dir, out, size["batch"], size["seq"], {"loss_chunk_size": 0}, finetune=finetune, **train
    )
    trainer = Trainer(cfg)
    batches = iter(trainer.loader)
    state = {"step": 0}

    def step():
        state["step"] += 1
        with loop_path() if loop else contextlib.nullcontext():
            o = trainer.train_step(state["step"], batches)
        return float(o.loss), float(trainer.step.balance.metrics.get("aux_loss", float("nan")))

    return step, trainer


def hf_contender(model, batches: list[dict]):
    """(step() -> (token loss, aux loss), optimizer): the model's own loss + coef · aux, clip, AdamW over the
    trainable parameters (all of them, or a PEFT model's adapters)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS, foreach=True)
    it = iter(range(10**9))

    def step():
        b = batches[next(it) % len(batches)]
        out = model(input_ids=b["input_ids"], labels=b["labels"], shift_labels=b["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = float(out.aux_loss.detach())
        return float(out.loss.detach()) - model.config.router_aux_loss_coef * aux, aux

    return step, opt


def summary(times: dict[str, list[list[float]]], warmup: int, tokens: int, ref: str) -> dict:
    """Per contender: the median time of each round's steps after `warmup`, tokens/s, and the median over rounds of
    its time / `ref`'s in the same round (a shared machine slows a round's contenders alike)."""
    out = {}
    for n, rounds in times.items():
        meds = [median(t[warmup:]) for t in rounds]
        ratios = [median(t[warmup:]) / median(f[warmup:]) for t, f in zip(rounds, times[ref])]
        out[n] = {
            "median_s": round(median(meds), 6),
            "tokens_per_s": round(tokens / median(meds), 1),
            "ratio_vs_fitlm": round(median(ratios), 3),
            "round_median_s": [round(m, 6) for m in meds],
        }
    return out


def timed(contenders: dict, steps: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """`steps` calls of every contender, interleaved call by call: (seconds per call, outputs) per contender."""
    import time

    per: dict[str, list[float]] = {n: [] for n in contenders}
    outs: dict[str, list] = {n: [] for n in contenders}
    for _ in range(steps):
        for name, call in contenders.items():
            t0 = time.perf_counter()
            outs[name].append(call())
            per[name].append(time.perf_counter() - t0)
    return per, outs


def loss_checks(step: dict, losses: dict[str, list[tuple[float, float]]], ref: str) -> None:
    """Add each contender's (token loss, aux loss) per step and their largest differences from `ref`'s to `step`."""
    for n in step:
        step[n]["losses"] = [[round(a, 6), round(b, 6)] for a, b in losses[n]]
        step[n]["loss_max_abs_diff"] = max(abs(a - fa) for (a, _), (fa, _) in zip(losses[n], losses[ref]))
        step[n]["aux_loss_max_abs_diff"] = max(abs(b - fb) for (_, b), (_, fb) in zip(losses[n], losses[ref]))
