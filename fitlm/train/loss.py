"""Token-summed cross-entropy, so that accumulation can divide by the tokens of the whole step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token losses over labels != -100, computed in fp32.

    logits: [B, T, V] in any dtype; labels: [B, T].

    Tensor-parallel logits (a DTensor sharded on V) must be passed inside
    `fitlm.parallel.tensor_parallel.loss_context(model)`, and the `.backward()` run there too: the
    loss is then computed on the vocab shards. The result is always a plain tensor, equal on every rank.
    """
    try:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    except RuntimeError as e:
        if isinstance(logits, DTensor) and "mixed torch.Tensor and DTensor" in str(e):
            raise RuntimeError("cross_entropy_sum got vocab-sharded tensor-parallel logits outside loss_parallel: "
                               "compute the loss and call .backward() inside "
                               "fitlm.parallel.tensor_parallel.loss_context(model)") from e
        raise
    # Differentiable DTensor -> plain tensor, so callers can add, log and backprop it as usual.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def count_targets(labels: torch.Tensor) -> int:
    return int((labels != IGNORE_INDEX).sum())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T` computed `chunk` rows at a time.

    The forward pass also computes both gradients chunk by chunk, so at no point does more than one
    [chunk, V] block of logits exist (the plain path keeps [N, V] logits, their fp32 copy and
    their gradient). Backward only scales the stored gradients by the incoming scalar.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int):  # hidden [N,C], weight [V,C], labels [N]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]  # [c,C]
            y = labels[start:start + chunk]  # [c]
            valid = y != IGNORE_INDEX
            if not bool(valid.any()):
                continue
            logits = (h @ weight.t()).float()  # [c,V], in the compute dtype then fp32 like the plain path
            lse = torch.logsumexp(logits, dim=-1)  # [c]
            target = torch.where(valid, y, 0)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            total += ((lse - picked) * valid).sum()
            if need_grad:
                # d(sum CE)/d logits = softmax - onehot, zero on ignored rows.
                grad = torch.exp(logits - lse[:, None])
                grad[torch.arange(grad.shape[0], device=grad.device), target] -= 1.0
                grad *= valid[:, None]
                grad = grad.to(h.dtype)  # [c,V] as the plain path's backward would see it
                grad_hidden[start:start + chunk] = grad @ weight
                grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None


def chunked_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              chunk_size: int) -> torch.Tensor:
    """Same value and gradients as `cross_entropy_sum(hidden @ weight.T, labels)`, without whole logits.

    hidden: [B, T, C]; weight: [V, C] (the output layer); labels: [B, T].
    """
    weight = weight.to(hidden.dtype)  # O2 casts parameters for compute; the cast's backward keeps fp32 grads
    return _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, 1), weight, labels.flatten(), chunk_size)
