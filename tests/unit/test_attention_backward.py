"""memory.attention_backward: matmul -- SDPA's forward, a blocked matmul backward -- and matmul_saved -- blocked
matmuls both ways, the probabilities kept. Checked against torch's own SDPA (matmul's forward exactly, matmul_saved's
to fp32 rounding, both gradients to fp32 rounding, and in bf16 no further from an fp64 reference than SDPA's own),
with every mask fitlm builds, grouped-query heads, rows that are not a multiple of the block, autocast (O1) and a
compiled whole model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitlm.config import ModelConfig
from fitlm.memory.attention_backward import ATTENDS, apply_attention_backward
from fitlm.models import matmul_attention as ab
from fitlm.models.layers import SelfAttention, additive_mask, band_mask, causal_attention, document_causal_mask
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


KINDS = ["matmul", "matmul_saved"]
FUNCTIONS = {"matmul": ab.FlashMatmulAttention, "matmul_saved": ab.SavedMatmulAttention}

CASES = {
    "causal": {},
    "document mask": {"attn_mask": "doc"},
    "sliding window": {"window": 48},
    "window and document mask": {"window": 48, "attn_mask": "doc"},
    "scale": {"scale": 0.3},
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 2)], ids=["gqa2", "mha", "gqa3"])
def test_fp32_forward_and_gradients_equal_sdpa(kind, case, heads):
    q, k, v, grad = _inputs(h=heads[0], k=heads[1])
    kw = dict(CASES[case])
    if kw.get("attn_mask") == "doc":  # the additive form every block shares (layers.shared_mask)
        kw["attn_mask"] = additive_mask(_doc_mask(q.shape[0], q.shape[2]), q.dtype)
    ref = _grads(causal_attention, q, k, v, grad, **kw)
    got = _grads(ATTENDS[kind], q, k, v, grad, **kw)
    if kind == "matmul":
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)  # the same flash forward, bit for bit
    for name, a, b in zip("oqkv", got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=f"{kind} {name}")


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_output_and_gradients_are_as_close_to_fp64_as_sdpas_own(kind):
    q, k, v, grad = _inputs(t=256, d=64)
    exact = _grads(causal_attention, *(x.double() for x in (q, k, v, grad)))
    half = [x.bfloat16() for x in (q, k, v, grad)]
    sdpa = _grads(causal_attention, *half)
    ours = _grads(ATTENDS[kind], *half)
    for i, name in enumerate("oqkv"):
        scale = exact[i].abs().max()
        err_sdpa = float((sdpa[i].double() - exact[i]).abs().max() / scale)
        err_ours = float((ours[i].double() - exact[i]).abs().max() / scale)
        assert err_ours <= 1.5 * err_sdpa + 1e-3, (name, err_ours, err_sdpa)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_skip_the_keys_after_their_last_row(kind):
    """Each 128-row block multiplies by the keys up to its last row only: the GEMMs total the causal triangle's
    blocks (here 3 blocks: 1 + 2 + 3 key blocks), not 3 x 3 (matmul_saved's forward too)."""
    q, k, v, grad = _inputs(b=1, h=2, k=2, t=3 * ab.BLOCK_ROWS, d=8)
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    widths = []
    real_matmul = torch.Tensor.__matmul__

    def spy(a, b):
        if a.shape[-1] == 8:  # q kᵀ and dO vᵀ: [.., rows, D] @ [.., D, keys]
            widths.append(b.shape[-1])
        return real_matmul(a, b)

    torch.Tensor.__matmul__ = spy
    try:
        ATTENDS[kind](q, k, v).backward(grad)
    finally:
        torch.Tensor.__matmul__ = real_matmul
    assert sorted(set(widths)) == [ab.BLOCK_ROWS, 2 * ab.BLOCK_ROWS, 3 * ab.BLOCK_ROWS], widths
    assert len(widths) == 6  # per block, q kᵀ (matmul: recomputed in backward; matmul_saved: in forward) and dO vᵀ


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_evaluation_and_softcap_go_to_sdpa(kind, monkeypatch):
    calls = []
    monkeypatch.setattr(FUNCTIONS[kind], "apply", lambda *a: calls.append(a) or causal_attention(*a[:3]))
    q, k, v, _ = _inputs(t=16)
    attend = ATTENDS[kind]
    with torch.no_grad():
        attend(q, k, v)  # evaluation: no gradient wanted
    attend(q[:, :, -1:].requires_grad_(), k, v, q_start=15)  # one new token after a cache
    attend(q.requires_grad_(), k, v, softcap=30.0)  # Gemma 2's capped scores: eager path
    assert not calls
    attend(q, k, v)
    assert len(calls) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_autocast_runs_in_the_autocast_dtype_like_sdpa(kind):
    q, k, v, grad = _inputs(t=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(causal_attention, q, k, v, grad)
        got = _grads(ATTENDS[kind], q, k, v, grad)
    assert got[0].dtype == ref[0].dtype == torch.bfloat16
    torch.testing.assert_close(
        got[0], ref[0], rtol=0 if kind == "matmul" else 0.02, atol=0 if kind == "matmul" else 0.01
    )
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.02)


def _model(attention_backward: str):
    cfg = ModelConfig(
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
        vocab_size=128,
        max_seq_len=160,
        tie_embeddings=False,
    )
    torch.manual_seed(0)
    model = build_model(cfg)
    return apply_attention_backward(model, attention_backward)


@pytest.mark.process
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["eager", "compiled", "selective recompute", "full recompute"])
def test_a_model_trains_alike_with_either_attention(mode, kind):
    from fitlm.memory.recompute import apply_recompute

    ids = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(3))
    docs = torch.tensor([[0] * 70 + [1] * 90, [0] * 160])
    grads = {}
    for name in ("sdpa", kind):
        model = _model(name)
        assert all(
            (layer.attend is ATTENDS.get(name, causal_attention))
            for layer in model.modules()
            if isinstance(layer, SelfAttention)
        )
        if mode.endswith("recompute"):
            apply_recompute(model, mode.split()[0], 1)
        run = torch.compile(model, dynamic=False) if mode == "compiled" else model
        logits = run(ids, document_ids=docs)
        F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(grads[kind][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_band_mask_matches_the_window_rule():
    """The window mask the attend builds is layers.band_mask's."""
    m = band_mask(5, 5, 0, 2, torch.device("cpu"))
    assert m.tolist() == [[j <= i and j > i - 2 for j in range(5)] for i in range(5)]


@pytest.mark.parametrize("kind", KINDS)
def test_config_refuses_it_with_context_parallel_and_names_the_fix(kind):
    from fitlm.config import ConfigError, validate_dict

    with pytest.raises(
        ConfigError,
        match=rf"memory\.attention_backward: {kind} .* context_parallel=2 .* set "
        r"memory\.attention_backward: sdpa",
    ):
        validate_dict({"parallel": {"context_parallel": 2}, "memory": {"attention_backward": kind}})
    with pytest.raises(ConfigError, match="memory.attention_backward"):
        validate_dict({"memory": {"attention_backward": "flash"}})
    assert validate_dict({"memory": {"attention_backward": kind}}).memory.attention_backward == kind
