"""The stacked experts' two paths: torch's grouped matmul where `grouped_mm_supported` says the device and dtype
have it, the per-expert loop elsewhere; same outputs and gradients (on CPU, where the grouped kernel runs
a matmul per expert as the loop does, to float rounding: a last-bit difference where a kernel sums in another
order), and the selection itself, decided by device, capability and torch's version."""

from __future__ import annotations

import pytest
import torch

import fitlm.models.experts as moe
from fitlm.models.experts import GroupedExperts, _expert_loop, grouped_mm_supported

CPU, CUDA, META = torch.device("cpu"), torch.device("cuda"), torch.device("meta")


def run(experts: GroupedExperts, x: torch.Tensor, counts: list[int], path) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the gradients (x, gate, up, down) of sum(out · g) through `path` (None: the module's forward)."""
    experts.zero_grad()
    x = x.detach().clone().requires_grad_()
    w = (experts.gate_proj, experts.up_proj, experts.down_proj)
    y = experts(x, counts) if path is None else path(x, counts, *w)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)).sum().backward()
    return y.detach(), [x.grad, *(p.grad for p in w)]


COUNTS = [[5, 0, 7, 3, 9], [0, 0, 0, 0, 12], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize("counts", COUNTS)
def test_cpu_forward_equals_the_loop(counts):
    torch.manual_seed(0)
    experts = GroupedExperts(5, 16, 8, init_std=0.2)
    x = torch.randn(sum(counts), 16)
    y, grads = run(experts, x, counts, None)
    y_ref, grads_ref = run(experts, x, counts, _expert_loop)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-7)
    for g, ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-7)
    assert all(g[i].abs().sum() == 0 for g in grads[1:] for i, c in enumerate(counts) if not c)  # no row, no gradient


def test_cpu_grouped_path_under_autocast_computes_in_its_dtype():
    torch.manual_seed(1)
    experts = GroupedExperts(3, 16, 8, init_std=0.2)
    x, counts = torch.randn(9, 16), [4, 0, 5]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = experts(x, counts)
        ref = _expert_loop(x, counts, experts.gate_proj, experts.up_proj, experts.down_proj)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref)


def test_an_expanded_output_gradient_reaches_the_grouped_backward():
    experts = GroupedExperts(2, 8, 4, init_std=0.2)
    x = torch.randn(5, 8, requires_grad=True)
    experts(x, [2, 3]).sum().backward()  # the gradient of sum() has strides 0: made contiguous for the kernel
    assert x.grad is not None and experts.down_proj.grad is not None


def test_selection_on_cpu_and_traced():
    recent = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 11)
    assert grouped_mm_supported(CPU, torch.float32) is recent
    assert grouped_mm_supported(CPU, torch.bfloat16) is recent
    assert not grouped_mm_supported(CPU, torch.int64)
    # torch.compile and the planner's fake tensors: the op's shape function takes bf16 only
    assert not grouped_mm_supported(CPU, torch.float32, traced=True)
    assert grouped_mm_supported(CPU, torch.bfloat16, traced=True) is recent
    assert not grouped_mm_supported(META, torch.bfloat16)


@pytest.mark.parametrize(
    "version,capability,dtype,expected",
    [
        ("2.13.0+cu128", (9, 0), torch.bfloat16, True),
        ("2.13.0+cu128", (8, 0), torch.bfloat16, True),
        ("2.13.0+cu128", (7, 5), torch.bfloat16, False),  # Turing: no kernel
        ("2.13.0+cu128", (9, 0), torch.float32, False),  # the kernels take bf16
        ("2.13.0+cu128", (9, 0), torch.float16, False),
        ("2.8.0+cu126", (9, 0), torch.bfloat16, True),  # torch 2.8: Hopper only
        ("2.8.0+cu126", (8, 0), torch.bfloat16, False),
        ("2.8.0+cu126", (10, 0), torch.bfloat16, False),
    ],
)
def test_selection_on_cuda_by_capability_and_version(monkeypatch, version, capability, dtype, expected):
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert grouped_mm_supported(CUDA, dtype) is expected


def test_selection_on_cpu_by_version(monkeypatch):
    for version, expected in (("2.8.0", False), ("2.10.0+cpu", False), ("2.11.0+cpu", True), ("2.14.0", True)):
        monkeypatch.setattr(torch, "__version__", version)
        assert grouped_mm_supported(CPU, torch.float32) is expected, version


def test_without_cuda_a_cuda_device_takes_the_loop(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not grouped_mm_supported(CUDA, torch.bfloat16)


def test_an_unsupported_device_or_dtype_runs_the_loop(monkeypatch):
    calls = []
    monkeypatch.setattr(moe, "grouped_mm_supported", lambda device, dtype, traced=False: False)
    monkeypatch.setattr(moe, "_grouped", lambda *a: calls.append(a))
    experts = GroupedExperts(2, 8, 4, init_std=0.2)
    x = torch.randn(5, 8)
    torch.testing.assert_close(experts(x, [2, 3]), _expert_loop(x, [2, 3], *experts.parameters()))
    assert not calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: compares torch's CUDA grouped matmul")
@pytest.mark.parametrize("counts", [[37, 0, 64, 5, 150, 1, 0, 99], [0] * 7 + [40]])
def test_cuda_grouped_path_equals_the_loop(counts):
    """On a GPU with the kernel (sm80+, bf16): the grouped path against the per-expert loop, forward and
    gradients, within bf16 rounding (different kernels, so not bit for bit)."""
    if not grouped_mm_supported(CUDA, torch.bfloat16):
        pytest.skip(
            f"torch {torch.__version__} has no CUDA grouped matmul for capability {torch.cuda.get_device_capability()}"
        )
    torch.manual_seed(0)
    experts = GroupedExperts(8, 256, 128, init_std=0.05).cuda().to(torch.bfloat16)
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    y, grads = run(experts, x, counts, None)
    y_ref, grads_ref = run(experts, x, counts, _expert_loop)
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    for g, ref, name in zip(grads, grads_ref, ("x", "gate_proj", "up_proj", "down_proj")):
        torch.testing.assert_close(g, ref, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{n}: {m}")
    # and under autocast over fp32 weights (O1): the grouped path casts to bf16 as F.linear does
    experts = experts.float()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, _ = run(experts, x.float(), counts, None)
        y_ref, _ = run(experts, x.float(), counts, _expert_loop)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)


def with_adapters(experts: GroupedExperts, r: int, targets=moe.PROJECTIONS) -> GroupedExperts:
    """`experts` with LoRA adapters on `targets` (fitlm.finetune.expert_lora), B drawn non-zero so they count."""
    from fitlm.finetune.expert_lora import attach

    for proj in targets:
        attach(experts, proj, r, scaling=2.0, dropout=0.0)
        with torch.no_grad():
            getattr(experts, f"lora_B_{proj}").normal_(0, 0.2)
    return experts


def lora_loop(experts: GroupedExperts):
    """The per-expert loop with each expert's A and B beside its weight (the reference the grouped path matches)."""
    from functools import partial

    return lambda x, counts, *w: _expert_loop(x, counts, *w, partial(experts._project, lora=experts._adapters()))


@pytest.mark.parametrize("targets", [moe.PROJECTIONS, ("down_proj",)])
@pytest.mark.parametrize("counts", COUNTS[:3])
def test_cpu_adapters_on_the_grouped_path_equal_the_loop(counts, targets, monkeypatch):
    torch.manual_seed(0)
    experts = with_adapters(GroupedExperts(5, 16, 8, init_std=0.2), r=4, targets=targets)
    calls = []
    grouped = moe._grouped
    monkeypatch.setattr(moe, "_grouped", lambda *a, **k: calls.append(1) or grouped(*a, **k))  # (which path ran)
    x = torch.randn(sum(counts), 16)
    y, grads = run(experts, x, counts, None)
    assert calls, "the adapted experts did not take the grouped path"
    adapters = [getattr(experts, f"lora_{part}_{p}") for p in targets for part in "AB"]
    lora_grads = [a.grad.clone() for a in adapters]
    y_ref, grads_ref = run(experts, x, counts, lora_loop(experts))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    for g, ref in zip(grads + lora_grads, grads_ref + [a.grad for a in adapters]):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)
