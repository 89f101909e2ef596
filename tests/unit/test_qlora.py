"""QLoRA's 4-bit base (fitlm.memory.nf4, fitlm.finetune.qlora): torchao's NF4 codes against the QLoRA paper's
code book and an independent blockwise quantizer; the QLoRA forward against the same network on the
dequantized weights; which weights can be stored; resume from a checkpoint that leaves the base out."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from fitlm.config import validate_dict
from fitlm.memory import nf4
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import read_metrics, tiny_config

# NormalFloat4: the 16 quantiles of N(0, 1) scaled to [-1, 1], as Dettmers et al. (2023), appendix E, list them.
PAPER_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]
MODEL = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256, "tie_embeddings": False}
QLORA = {"method": "qlora", "lora": {"r": 4, "alpha": 8.0, "target_modules": ["all-linear"]}}


def reference_nf4(w: torch.Tensor) -> torch.Tensor:
    """Blockwise NF4 without double quantization, written from the paper: per 64 weights the absmax, each
    weight to its nearest code, back to weight."""
    blocks = w.float().reshape(-1, nf4.BLOCK)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    levels = torch.tensor(PAPER_NF4)
    codes = (blocks / absmax).unsqueeze(-1).sub(levels).abs().argmin(-1)
    return (levels[codes] * absmax).reshape(w.shape)


def test_codes_are_the_papers_and_dequantize_as_an_independent_blockwise_quantizer():
    torch.manual_seed(0)
    w = torch.randn(256, 512).to(nf4.STORED_DTYPE)
    q = nf4._nf4()[1](w, nf4.BLOCK, 256)
    # torchao keeps the code book in the weights' dtype: the paper's values to bf16's 8 significant bits
    assert q.nf4.tolist() == pytest.approx(PAPER_NF4, rel=2**-8, abs=1e-12)
    ours, ref = q.get_original_weight().float(), reference_nf4(w)
    absmax = w.float().reshape(-1, nf4.BLOCK).abs().amax(1, keepdim=True).expand(-1, nf4.BLOCK).reshape(w.shape)
    # The only difference: double quantization stores each absmax in 8 bits, so a weight near the midpoint of
    # two codes may round to the neighbour, and every weight moves by its scale's rounding (< 1% here).
    close = (ours - ref).abs() <= 0.01 * absmax
    assert close.float().mean() > 0.99
    assert ((ours - ref).abs() <= 0.32 * absmax).all()  # at most the widest code gap (1 - 0.696) + the rounding
    assert nf4.nf4_bytes(w.numel()) / (2 * w.numel()) == pytest.approx(0.258, abs=1e-3)  # 4.126 bits / weight
    held = sum(
        t.numel() * t.element_size()
        for t in (q.quantized_data, q.quantized_scalers, q.quantization_factor, q.scaler_mean, q.nf4)
    )
    assert held == nf4.nf4_bytes(w.numel())  # every byte the tensor holds


@pytest.mark.parametrize(
    "shape,shards,want",
    [
        ((256, 256), 1, 256),
        ((256, 256), 2, 256),
        ((128, 256), 4, 128),
        ((64, 64), 1, 64),
        ((32, 64), 1, None),
        ((96, 100), 1, None),
        ((256, 256), 3, None),
        ((256,), 1, None),
    ],
)
def test_a_weight_is_stored_in_nf4_only_when_each_shard_holds_whole_groups(shape, shards, want):
    assert nf4.scaler_block(shape, shards) == want


# Qwen3-MoE with 8 experts, top 2, a dense block (1) between routed ones; expert width 128 so each expert is whole
# groups (fitlm.memory.nf4.stacked_scaler_block): tests/unit/test_qlora_experts.py's model
MOE = {
    "arch": "qwen3_moe",
    "hidden_size": 64,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "mlp_only_layers": [1],
    "tie_embeddings": False,
}


def trainer(corpus, out, **sections) -> Trainer:
    train = {"max_steps": 2, "eval_interval": 0, "peak_tflops": 1.0, **sections.pop("train", {})}
    model, finetune = sections.pop("model", MODEL), sections.pop("finetune", QLORA)
    return Trainer(validate_dict(tiny_config(corpus, out, model=model, finetune=finetune, train=train, **sections)))


@contextlib.contextmanager
def dequantized(model: nn.Module):
    """The same network with every NF4 weight replaced by its dequantized values (fp32 Parameters), inside the
    block (swapped in place: torchao cannot deep-copy a tensor of groups other than 256)."""
    stored = {m: m.weight for m in model.modules() if nf4.is_nf4(getattr(m, "weight", None))}
    for m, w in stored.items():
        m.weight = nn.Parameter(w.get_original_weight().float(), requires_grad=False)
    try:
        yield model
    finally:
        for m, w in stored.items():
            m.weight = w


def logits_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits of x and the gradients of their mean log-sum-exp (every parameter that gets one)."""
    model.zero_grad(set_to_none=True)
    logits = model(x)
    logits.logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_qlora_forward_equals_the_network_on_the_dequantized_base(tiny_corpus, tmp_path):
    t = trainer(tiny_corpus, tmp_path / "run")
    model = t.pm.model
    stored = [n for n, p in model.named_parameters() if nf4.is_nf4(p)]
    assert len(stored) == 2 * 7 and not any(n.startswith(("lm_head", "model.embed")) for n in stored)
    batches = iter(t.loader)
    t.train_step(1, batches)  # B is no longer zero: the adapters take part
    x = torch.randint(0, 512, (2, 32))
    ours, our_grads = logits_and_grads(model, x)
    with dequantized(model):
        theirs, their_grads = logits_and_grads(model, x)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # stated tolerance: equal up to fp32 rounding
    # backward too: the adapters' gradients are those of the dequantized network
    assert our_grads and our_grads.keys() == their_grads.keys()
    for n, g in our_grads.items():
        torch.testing.assert_close(g, their_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    t.release_lock()


@pytest.mark.process
@pytest.mark.parametrize("model", [MODEL, MOE], ids=["llama", "qwen3_moe"])  # the MoE: its 4-bit experts too
def test_resume_quantizes_the_base_again_and_continues_exactly(tiny_corpus, tmp_path, model):
    from fitlm.checkpoint.store import list_checkpoints

    ckpt, small = (
        {"interval": 2, "keep_last": 2},
        {"max_steps": 4, "micro_batch_size": 2, "gradient_accumulation_steps": 1},
    )
    trainer(tiny_corpus, tmp_path / "whole", model=model, train=small, checkpoint=ckpt).fit()
    step2 = dict(list_checkpoints(tmp_path / "whole" / "checkpoints"))[2]
    trainer(
        tiny_corpus, tmp_path / "resumed", model=model, train=small, checkpoint={**ckpt, "resume": str(step2)}
    ).fit()

    def losses(out):
        return [(r["step"], r["loss"]) for r in read_metrics(out) if "loss" in r]

    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")[2:]
    # without its base a QLoRA checkpoint is not a model: `fitlm ckpt merge` says how to get the one at its step
    from fitlm.checkpoint.errors import CheckpointError
    from fitlm.checkpoint.merge import merge_checkpoint

    with pytest.raises(CheckpointError, match="QLoRA checkpoint.*checkpoint.resume=.*train.max_steps=2"):
        merge_checkpoint(step2, tmp_path / "merged.safetensors")
    assert not (tmp_path / "merged.safetensors").exists()
