"""fitlm.models.layers.causal_attention at one query (a decode step) in half precision on a CPU: computed in fp32
and rounded once (SDPA's half kernel is several times slower there), with every mask form and option kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitlm.models.layers import additive_mask, causal_attention


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("window", [None, 4])
def test_one_query_attends_in_fp32(dtype, mask, window):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1, 16).to(dtype)  # [B,H,1,D]
    k, v = torch.randn(2, 2, 9, 16).to(dtype), torch.randn(2, 2, 9, 16).to(dtype)  # [B,K,S,D]: grouped query
    allowed = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    allowed[0, ..., :3] = False  # a batched slot's cells before its first token
    attn_mask = {None: None, "bool": allowed, "additive": additive_mask(allowed, dtype)}[mask]
    out = causal_attention(q, k, v, 8, attn_mask, window)
    ref = causal_attention(q.float(), k.float(), v.float(), 8, None if mask is None else allowed, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref.to(dtype), atol=0, rtol=0)  # fp32, rounded once
    # ... and what the half kernel computes, to half precision's rounding
    cells = allowed if mask else torch.ones_like(allowed)  # [B,1,1,S]
    if window is not None:
        cells = cells & (torch.arange(9) > 8 - window)
    half = F.scaled_dot_product_attention(q, k, v, attn_mask=cells, enable_gqa=True)
    torch.testing.assert_close(out, half, atol=2e-2, rtol=2e-2)
