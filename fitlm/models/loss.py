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
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    except RuntimeError as e:
        if isinstance(logits, DTensor) and "mixed torch.Tensor and DTensor" in str(e):
            raise RuntimeError(
                "cross_entropy_sum got vocab-sharded tensor-parallel logits outside loss_parallel: "
                "compute the loss and call .backward() inside "
                "fitlm.parallel.tensor_parallel.loss_context(model)"
            ) from e
        raise
    # Differentiable DTensor -> plain tensor, so callers can add, log and backprop it as usual.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def count_targets(labels: torch.Tensor) -> int:
    return int((labels != IGNORE_INDEX).sum())


def _chunk(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, need_grad: bool, grad_weight: torch.Tensor | None):
    """Summed CE of one chunk and, with `need_grad`, d(sum CE)/d h; the weight's gradient is accumulated in
    place into the fp32 `grad_weight` when given (None: a frozen head, as under LoRA, needs none).

    h [c,C], weight [V,C], y [c]. One [c,V] buffer, updated in place: logits -> shifted -> exp -> softmax
    -> gradient (the textbook logsumexp / exp(logits - lse) / one-hot / mask made four [c,V] passes more
    and held three such blocks at once): the eager form; memory.compile runs `_fused_chunk` instead.
    """
    valid = y != IGNORE_INDEX
    target = torch.where(valid, y, 0)[:, None]  # [c,1]
    logits = (h @ weight.t()).float()  # [c,V], in the compute dtype then fp32 like the plain path
    logits -= logits.amax(dim=-1, keepdim=True)  # shifted: every exp <= 1
    picked = logits.gather(1, target).squeeze(1)  # [c] shifted target logit
    probs = logits.exp_()
    norm = probs.sum(dim=-1)  # [c]; lse - target logit = log(norm) - picked
    total = ((norm.log() - picked) * valid).sum()
    if not need_grad:
        return total, None
    # d(sum CE)/d logits = softmax - onehot, zero on ignored rows.
    grad = probs.div_(norm[:, None])
    grad.scatter_add_(1, target, torch.full_like(target, -1.0, dtype=grad.dtype))
    grad *= valid[:, None]
    del logits, probs
    return total, _backprop(grad.to(h.dtype), h, weight, grad_weight)  # [c,V] as the plain path's backward sees it


def _fused_chunk(
    h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, need_grad: bool, grad_weight: torch.Tensor | None
):
    """`_chunk`'s arithmetic written for torch.compile (memory.compile): out of place, the one-hot as a
    comparison with the column index, so inductor fuses log-sum-exp, softmax, one-hot and mask into passes
    over the [c,V] logits that store nothing but the half gradient. Compiled, the in-place form's scatter
    and in-place chain keep inductor from fusing those passes, which makes it the slower of the two at large
    vocabularies (see bench/RESULTS.md, "Figures behind the code's design choices")."""
    valid = y != IGNORE_INDEX
    target = torch.where(valid, y, 0)[:, None]  # [c,1]
    logits = (h @ weight.t()).float()  # [c,V]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [c,1]
    total = ((lse - logits.gather(1, target)).squeeze(1) * valid).sum()
    if not need_grad:
        return total, None
    onehot = torch.arange(logits.shape[1], device=logits.device) == target  # [c,V], fused away
    grad = ((logits - lse).exp() - onehot.float()) * valid[:, None]
    return total, _backprop(grad.to(h.dtype), h, weight, grad_weight)


def _backprop(grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, grad_weight: torch.Tensor | None):
    """Given d(sum CE)/d logits [c,V]: accumulate the weight's gradient into `grad_weight` (when given) and
    return d(sum CE)/d h [c,C]."""
    if grad_weight is None:
        pass
    elif grad_weight.dtype == grad.dtype:
        grad_weight.addmm_(grad.t(), h)
    else:
        grad_weight += (grad.t() @ h).float()
    return grad @ weight


_compiled_chunk = None


def _chunk_fn(compiled: bool):
    global _compiled_chunk
    if not compiled:
        return _chunk
    if torch.compiler.is_compiling():
        # Traced into a whole-model graph (fitlm.memory.compile): fused there. Reading the global below
        # while tracing would guard on its lazy creation, and that guard fails (a recompile) once it exists.
        return _fused_chunk
    if _compiled_chunk is None:  # one compiled function for every model in the process
        _compiled_chunk = torch.compile(_fused_chunk, dynamic=False)
    return _compiled_chunk


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T` computed `chunk` rows at a time.

    The forward pass also computes both gradients chunk by chunk, so at no point does more than one
    [chunk, V] block of logits exist (the plain path keeps [N, V] logits, their fp32 copy and
    their gradient). Backward only scales the stored gradients by the incoming scalar.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, compiled: bool):  # hidden [N,C], weight [V,C], labels [N]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        step = _chunk_fn(compiled)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        # A frozen head (LoRA, freeze) gets no [V, C] fp32 gradient buffer: for a 128K vocabulary that is GiBs.
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for start in range(0, hidden.shape[0], chunk):
            loss, gh = step(
                hidden[start : start + chunk], weight, labels[start : start + chunk], need_grad, grad_weight
            )
            total += loss
            if need_grad:
                assert grad_hidden is not None  # (allocated when need_grad)
                grad_hidden[start : start + chunk] = gh
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_out.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_weight * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, compiled: bool = False
) -> torch.Tensor:
    """Same value and gradients as `cross_entropy_sum(hidden @ weight.T, labels)`, without whole logits.

    hidden: [B, T, C]; weight: [V, C] (the output layer); labels: [B, T]. `compiled`: each chunk's
    arithmetic runs through torch.compile (memory.compile), which fuses the [chunk, V] passes.
    """
    weight = weight.to(hidden.dtype)  # O2 casts parameters for compute; the cast's backward keeps fp32 grads
    return _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, 1), weight, labels.flatten(), chunk_size, compiled)
