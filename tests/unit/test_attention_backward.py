"""memory.attention_backward: matmul -- SDPA's forward, a blocked matmul backward. Checked against torch's own
SDPA (its forward exactly, its gradients to fp32 rounding, and in bf16 no further from an fp64 reference than
SDPA's own bf16 backward), with every mask fitlm builds, grouped-query heads, rows that are not a multiple of
the block, autocast (O1) and a compiled whole model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitlm.config import ModelConfig
from fitlm.memory.attention_backward import apply_attention_backward
from fitlm.models import matmul_attention as ab
from fitlm.models.layers import SelfAttention, _band_mask, additive_mask, causal_attention, document_causal_mask
from fitlm.registry import build_model


def _inputs(b=2, h=4, k=2, t=200, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # [B,T,H,D] transposed, as SelfAttention hands them over (not contiguous)
    q = torch.randn(b, t, h, d, generator=g).transpose(1, 2).to(dtype)
    kk = torch.randn(b, t, k, d, generator=g).transpose(1, 2).to(dtype)
    v = torch.randn(b, t, k, d, generator=g).transpose(1, 2).to(dtype)
    grad = torch.randn(b, h, t, d, generator=g).to(dtype)
    return q, kk, v, grad


def _grads(fn, q, k, v, grad, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, **kw)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _doc_mask(b, t, seed=1):
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(b, t, generator=g) < 0.03
    starts[:, 0] = True
    return document_causal_mask(starts.long().cumsum(1))  # bool [B,1,T,T]


CASES = {
    "causal": {},
    "document mask": {"attn_mask": "doc"},
    "sliding window": {"window": 48},
    "window and document mask": {"window": 48, "attn_mask": "doc"},
    "scale": {"scale": 0.3},
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 2)], ids=["gqa2", "mha", "gqa3"])
def test_fp32_forward_equals_sdpa_and_gradients_to_rounding(case, heads):
    q, k, v, grad = _inputs(h=heads[0], k=heads[1])
    kw = dict(CASES[case])
    if kw.get("attn_mask") == "doc":  # the additive form every block shares (layers.shared_mask)
        kw["attn_mask"] = additive_mask(_doc_mask(q.shape[0], q.shape[2]), q.dtype)
    ref = _grads(causal_attention, q, k, v, grad, **kw)
    got = _grads(ab.attend, q, k, v, grad, **kw)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)  # the same flash forward, bit for bit
    for name, a, b in zip("qkv", got[1:], ref[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=f"d{name}")


def test_bf16_gradients_are_as_close_to_fp64_as_sdpas_own():
    q, k, v, grad = _inputs(t=256, d=64)
    exact = _grads(causal_attention, *(x.double() for x in (q, k, v, grad)))
    half = [x.bfloat16() for x in (q, k, v, grad)]
    sdpa = _grads(causal_attention, *half)
    ours = _grads(ab.attend, *half)
    for i, name in enumerate("oqkv"):
        scale = exact[i].abs().max()
        err_sdpa = float((sdpa[i].double() - exact[i]).abs().max() / scale)
        err_ours = float((ours[i].double() - exact[i]).abs().max() / scale)
        assert err_ours <= 1.5 * err_sdpa + 1e-3, (name, err_ours, err_sdpa)


def test_blocks_skip_the_keys_after_their_last_row():
    """Each 128-row block multiplies by the keys up to its last row only: the backward's GEMMs total the
    causal triangle's blocks (here 3 blocks: 1 + 2 + 3 key blocks), not 3 x 3."""
    q, k, v, grad = _inputs(b=1, h=2, k=2, t=3 * ab.BLOCK_ROWS, d=8)
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = ab.attend(q, k, v)
    widths = []
    real_matmul = torch.Tensor.__matmul__

    def spy(a, b):
        if a.shape[-1] == 8:  # q kᵀ and dO vᵀ: [.., rows, D] @ [.., D, keys]
            widths.append(b.shape[-1])
        return real_matmul(a, b)

    torch.Tensor.__matmul__ = spy
    try:
        out.backward(grad)
    finally:
        torch.Tensor.__matmul__ = real_matmul
    keys_seen = sorted(set(widths))
    assert keys_seen == [ab.BLOCK_ROWS, 2 * ab.BLOCK_ROWS, 3 * ab.BLOCK_ROWS], widths


def test_decoding_evaluation_and_softcap_go_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(ab.FlashMatmulAttention, "apply", lambda *a: calls.append(a) or causal_attention(*a[:3]))
    q, k, v, _ = _inputs(t=16)
    with torch.no_grad():
        ab.attend(q, k, v)  # evaluation: no gradient wanted
    ab.attend(q[:, :, -1:].requires_grad_(), k, v, q_start=15)  # one new token after a cache
    ab.attend(q.requires_grad_(), k, v, softcap=30.0)  # Gemma 2's capped scores: eager path
    assert not calls
    ab.attend(q, k, v)
    assert len(calls) == 1


def test_autocast_runs_in_the_autocast_dtype_like_sdpa():
    q, k, v, grad = _inputs(t=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(causal_attention, q, k, v, grad)
        got = _grads(ab.attend, q, k, v, grad)
    assert got[0].dtype == ref[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.02)


def _model(attention_backward: str):
    cfg = ModelConfig(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                      vocab_size=128, max_seq_len=160, tie_embeddings=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    return apply_attention_backward(model, attention_backward)


@pytest.mark.parametrize("mode", ["eager", "compiled", "selective recompute", "full recompute"])
def test_a_model_trains_alike_with_either_backward(mode):
    from fitlm.memory.recompute import apply_recompute

    ids = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(3))
    docs = torch.tensor([[0] * 70 + [1] * 90, [0] * 160])
    grads = {}
    for kind in ("sdpa", "matmul"):
        model = _model(kind)
        assert all((layer.attend is ab.attend) == (kind == "matmul")
                   for layer in model.modules() if isinstance(layer, SelfAttention))
        if mode.endswith("recompute"):
            apply_recompute(model, mode.split()[0], 1)
        run = torch.compile(model, dynamic=False) if mode == "compiled" else model
        logits = run(ids, document_ids=docs)
        F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        grads[kind] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["matmul"][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_band_mask_matches_the_window_rule():
    """The window mask the attend builds is layers._band_mask's (guards the import it relies on)."""
    m = _band_mask(5, 5, 0, 2, torch.device("cpu"))
    assert m.tolist() == [[j <= i and j > i - 2 for j in range(5)] for i in range(5)]


def test_config_refuses_it_with_context_parallel_and_names_the_fix():
    from fitlm.config import ConfigError, validate_dict

    with pytest.raises(ConfigError, match=r"memory\.attention_backward: matmul .* context_parallel=2 .* set "
                                          r"memory\.attention_backward: sdpa"):
        validate_dict({"parallel": {"context_parallel": 2}, "memory": {"attention_backward": "matmul"}})
    with pytest.raises(ConfigError, match="memory.attention_backward"):
        validate_dict({"memory": {"attention_backward": "flash"}})
    assert validate_dict({"memory": {"attention_backward": "matmul"}}).memory.attention_backward == "matmul"
