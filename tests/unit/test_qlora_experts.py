"""QLoRA on an MoE model's stacked experts (fitlm.finetune.qlora, fitlm.memory.nf4's stacked storage): each
projection one NF4 tensor [E·out, in] whose experts are whole blocks and groups, read one expert at a time; the
forward and the adapters' gradients against the same network on the dequantized experts; which stacked shapes
can be stored; the parameter bytes against LoRA's on a model whose experts dominate."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from fitlm.finetune.expert_lora import expert_modules
from fitlm.memory import nf4
from fitlm.models.experts import PROJECTIONS
from tests.unit.test_qlora import MOE, logits_and_grads, trainer


@contextlib.contextmanager
def dequantized(model: nn.Module):
    """The same network with each stacked NF4 projection replaced by its dequantized values (fp32), read as plain
    stacked tensors (`take` off), inside the block."""
    saved = {}
    for experts in expert_modules(model).values():
        saved[experts] = (experts.take, {p: getattr(experts, p) for p in PROJECTIONS})
        for p, w in saved[experts][1].items():
            if nf4.is_nf4(w):
                full = w.get_original_weight().float().reshape(experts.stacked_shape(p))  # [E·out, in] -> [E, out, in]
                setattr(experts, p, nn.Parameter(full, requires_grad=False))
        experts.take = None
    try:
        yield model
    finally:
        for experts, (take, weights) in saved.items():
            experts.take = take
            for p, w in weights.items():
                setattr(experts, p, w)


@pytest.mark.parametrize(
    "shape,shards,want",
    [
        ((8, 128, 64), 1, 128),  # one expert: 8192 weights, 128 scales, one group of 128
        ((8, 64, 128), 1, 128),
        ((4, 256, 256), 1, 256),
        ((8, 128, 64), 2, 128),  # ZeRO-2/3 over 2 ranks: 4 whole experts a rank
        ((8, 128, 64), 8, 128),
        ((6, 128, 64), 4, None),  # 6 experts over 4 ranks: a rank's rows would cut an expert
        ((8, 32, 64), 1, None),  # 2048 weights an expert: 32 scales, not a whole group of 64
        ((128, 64), 1, None),  # a Linear's weight is `scaler_block`'s
    ],
)
def test_stacked_experts_are_stored_only_when_each_expert_holds_whole_groups(shape, shards, want):
    assert nf4.stacked_scaler_block(shape, shards) == want


def test_one_expert_of_the_stacked_codes_is_that_expert_quantized_alone():
    torch.manual_seed(0)
    w = torch.randn(4, 128, 64).to(nf4.STORED_DTYPE)
    q = nf4._nf4()[1](nf4._rows(w), nf4.BLOCK, 128)
    assert tuple(q.shape) == nf4.stored_shape(w.shape) == (4 * 128, 64)
    whole = q.get_original_weight().reshape(w.shape)
    for e in range(4):
        alone = nf4.expert(q, e, 4)
        assert tuple(alone.shape) == (128, 64)
        # the codes are a slice: dequantizing expert e alone gives the stacked tensor's row e exactly
        torch.testing.assert_close(alone.get_original_weight(), whole[e], rtol=0, atol=0)
    torch.testing.assert_close(nf4.round_trip(w, 128), whole.float(), rtol=0, atol=0)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "gate_proj", "up_proj", "down_proj"]])
def test_qlora_experts_forward_and_gradients_equal_the_network_on_the_dequantized_experts(
    tiny_corpus, tmp_path, targets
):
    finetune = {"method": "qlora", "lora": {"r": 4, "alpha": 8.0, "target_modules": targets}}
    t = trainer(tiny_corpus, tmp_path / "run", model=MOE, finetune=finetune)
    model = t.pm.model
    stored = {n for n, p in model.named_parameters() if nf4.is_nf4(p)}
    # every block's q and o (k and v, [32, 64], are not a whole group of 64 scales) and its MLP's three weights:
    # stacked experts in the routed blocks, Linears in the dense one; never the router
    attention = {f"model.layers.{i}.self_attn.{p}.weight" for i in range(3) for p in ("q_proj", "o_proj")}
    dense = {f"model.layers.1.mlp.{p}.weight" for p in PROJECTIONS}
    experts = {f"model.layers.{i}.mlp.experts.{p}" for i in (0, 2) for p in PROJECTIONS}
    assert stored == attention | dense | experts
    t.train_step(1, iter(t.loader))  # B is no longer zero: the adapters take part
    x = torch.randint(0, 512, (2, 32))
    ours, our_grads = logits_and_grads(model, x)
    with dequantized(model):
        theirs, their_grads = logits_and_grads(model, x)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)  # one dequantization, two matmul orders
    assert our_grads and our_grads.keys() == their_grads.keys()
    assert any("lora_B_down_proj" in n for n in our_grads) == ("down_proj" in targets)
    for n, g in our_grads.items():
        torch.testing.assert_close(g, their_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    t.release_lock()
