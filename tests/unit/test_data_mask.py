"""Document masking: block-causal attention, per-document positions, and the model's outputs under it."""

from __future__ import annotations

import pytest
import torch

from fitlm.config import ModelConfig
from fitlm.models.layers import document_causal_mask, document_position_ids
from fitlm.registry import build_model

V = 96


def make(arch: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, hidden_size=32, num_layers=2, num_heads=4, vocab_size=V, max_seq_len=64, **kw)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def rand_ids(t: int, seed: int) -> torch.Tensor:
    return torch.randint(3, V, (t,), generator=torch.Generator().manual_seed(seed))


def test_mask_never_crosses_a_document_boundary():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 9, 9]])
    mask = document_causal_mask(doc)
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool  # broadcasts over (sharded) heads
    for b in range(2):
        for i in range(8):
            for j in range(8):
                assert bool(mask[b, 0, i, j]) == (j <= i and bool(doc[b, i] == doc[b, j])), (b, i, j)
    assert mask.diagonal(dim1=-2, dim2=-1).all()  # every query sees itself: no empty softmax row
    assert document_position_ids(doc).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_logits_of_a_document_ignore_its_neighbours(arch):
    model = make(arch)
    a, b, b2 = rand_ids(7, 1), rand_ids(9, 2), rand_ids(9, 3)
    c = rand_ids(5, 4)
    doc = torch.tensor([[0] * 7 + [1] * 9 + [2] * 5])
    with torch.no_grad():
        x1 = model(torch.cat([a, b, c])[None], document_ids=doc)
        x2 = model(torch.cat([a, b2, c])[None], document_ids=doc)  # only the middle document changed
        alone_c = model(c[None])  # the last document on its own, at positions 0..4
        alone_b = model(b[None])
        unmasked = model(torch.cat([a, b, c])[None])
    torch.testing.assert_close(x1[:, :7], x2[:, :7], rtol=0, atol=1e-6)
    torch.testing.assert_close(x1[:, 16:], x2[:, 16:], rtol=0, atol=1e-6)  # the document after it is untouched
    assert not torch.allclose(x1[:, 7:16], x2[:, 7:16])
    torch.testing.assert_close(x1[:, 16:], alone_c, rtol=1e-5, atol=1e-5)  # = run as its own sequence
    torch.testing.assert_close(x1[:, 7:16], alone_b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[:, 16:], alone_c, atol=1e-4)  # without masking, neighbours leak


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_one_document_per_row_equals_the_unmasked_path(arch):
    model = make(arch, **({"num_kv_heads": 2} if arch == "llama" else {}))
    ids = torch.stack([rand_ids(12, 5), rand_ids(12, 6)])
    with torch.no_grad():
        plain = model(ids)
        masked = model(ids, document_ids=torch.full_like(ids, 3))
        hs = model.hidden_states(ids, document_ids=torch.zeros_like(ids))
    torch.testing.assert_close(plain, masked, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.lm_head(hs), plain, rtol=1e-5, atol=1e-5)


def test_explicit_positions_and_gradients_flow():
    model = make("llama").train()
    ids = rand_ids(10, 7)[None]
    doc = torch.tensor([[0] * 4 + [1] * 6])
    pos = document_position_ids(doc)
    a = model(ids, position_ids=pos, document_ids=doc)
    b = model(ids, document_ids=doc)  # positions default to restarting per document
    torch.testing.assert_close(a, b)
    a.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_document_ids_refused_with_a_filled_cache_and_bad_shape():
    model = make("llama")
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        model(rand_ids(4, 8)[None], kv_cache=cache)
        with pytest.raises(ValueError, match="KV cache"):
            model(rand_ids(2, 9)[None], kv_cache=cache, document_ids=torch.zeros(1, 2, dtype=torch.long))
        with pytest.raises(ValueError, match="document_ids has shape"):
            model(rand_ids(4, 8)[None], document_ids=torch.zeros(1, 3, dtype=torch.long))
