"""Tensor parallel (Megatron-style) and sequence parallel, applied from outside with DTensor.

Every block is split the Megatron way: q/k/v and gate/up are column-parallel (each rank owns whole
heads / a slice of the MLP width, so attention and the activation run locally), o/down are
row-parallel (one all-reduce, or a reduce-scatter under sequence parallel, per sub-block). The token
embedding is vocab-parallel (rows sharded) and the head is column-parallel over the vocabulary; with
`loss_parallel` its logits stay sharded (`Shard(-1)`) and cross-entropy runs on the shards inside
`loss_context(model)`, so the [B, T, V] logits are never gathered.

Sequence parallel keeps the residual stream sharded on the sequence dim between sub-blocks: norms
(and gpt2's position embedding) work on [B, T/tp, C]; attention and MLP all-gather their input to the
full sequence. Without it the residual stream is replicated and the norms run redundantly.

A LoRA-adapted Linear shards its adapter with it (fitlm.parallel.lora_parallel: column-parallel keeps A
replicated and shards B on `out`, row-parallel shards A on `in` and reduces the adapter's partial sums in
the base's one all-reduce). Frozen parameters (LoRA's base, `finetune.method: freeze`) stay frozen.

MoE models: attention and the dense blocks' MLPs split as above; a routed block's experts split inside each
expert on their width (fitlm.parallel.expert_tensor_parallel, `SplitExperts`), its router replicated.

Every other parameter becomes a DTensor (replicated ones too) and every gradient is given its parameter's
placement, so clipping, optimizers and FSDP2 see one kind of tensor per mesh. A pipeline stage (modules set to
None, blocks deleted) is parallelised the same way and still sends and receives [B, T, C].

Order in the trainer: `apply_tensor_parallel` first, then recompute, compile, then FSDP on the "dp"
mesh dim. Training only: the model's KV cache is sized for all heads, so generation with a TP model
is not supported (gather a full state dict and load it in one process).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from fitlm.config import ModelConfig
from fitlm.models.moe import MoEFeedForward
from fitlm.parallel.expert_tensor_parallel import SplitExperts
from fitlm.parallel.lora_parallel import LoraColwiseParallel, LoraRowwiseParallel, has_adapter
from fitlm.parallel.tp_styles import FirstArgLayout, ReplicateParallel
from fitlm.parallel_dims import divisors

if TYPE_CHECKING:
    from fitlm.models.causal_lm import CausalLM

# Set on the model by apply_tensor_parallel; read by loss_context and tests.
TP_ATTR = "_fitlm_tensor_parallel"


def _has(module: nn.Module, path: str) -> bool:
    try:
        return isinstance(module.get_submodule(path), nn.Module)
    except AttributeError:
        return False


def _norm_style(sequence_parallel: bool, local_output: bool = False) -> ParallelStyle:
    # SP: the norm runs on its sequence shard; its output stays a Shard(1) DTensor for the next input hook,
    # or (`local_output`, a post-norm added to the residual stream) becomes the local shard again.
    return (
        SequenceParallel(use_local_output=local_output)
        if sequence_parallel
        else ReplicateParallel(Replicate(), Replicate())
    )


def tensor_parallel_plan(
    model: nn.Module, sequence_parallel: bool = False, loss_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """The plan for any registered family (its `tp_plan` roles), keyed by fully qualified module name.

    Modules a pipeline stage dropped (set to None) are left out.
    """
    model = cast("CausalLM", model)  # (a family's model)
    body = model.model
    act = Shard(1) if sequence_parallel else Replicate()  # residual stream layout between sub-blocks
    plan: dict[str, ParallelStyle] = {}
    if getattr(body, "embed_tokens", None) is not None:
        # Each rank looks up its vocab rows, zeros elsewhere; the partial sums are all-reduced (or
        # reduce-scattered onto sequence shards).
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if getattr(body, "embed_positions", None) is not None:
        # Small table: replicated; under SP each rank keeps its slice of the sequence (no communication).
        plan["model.embed_positions"] = ReplicateParallel(Replicate(), act)
    roles = model.config.family.tp_plan  # which module of a block plays which part (fitlm.models.family)
    for name, block in body.layers.items():
        p = f"model.layers.{name}."
        present = partial(_has, block)
        for path in filter(present, roles.norms):
            plan[p + path] = _norm_style(sequence_parallel)
        for path in filter(present, roles.post_norms):  # their output meets the local residual stream
            plan[p + path] = _norm_style(sequence_parallel, local_output=True)
        for path in filter(present, roles.inputs):
            routed = isinstance(block.get_submodule(path), MoEFeedForward)
            plan[p + path] = SplitExperts(act) if routed else FirstArgLayout(act, Replicate())
        # A LoRA-adapted Linear shards its adapter with it (fitlm.parallel.lora_parallel).
        for path in filter(present, roles.colwise):
            plan[p + path] = LoraColwiseParallel() if has_adapter(block.get_submodule(path)) else ColwiseParallel()
        for path in filter(present, roles.rowwise):
            rowwise = LoraRowwiseParallel if has_adapter(block.get_submodule(path)) else RowwiseParallel
            plan[p + path] = rowwise(output_layouts=act)
        for path in filter(present, roles.head_norms):
            # q/k [B,T,heads,D] are sharded over heads: a Replicate weight then gets Partial gradients,
            # which DTensor sums over the ranks (each rank saw only its own heads).
            plan[p + path] = ReplicateParallel(Shard(2), Shard(2))
    if getattr(body, "norm", None) is not None:
        plan["model.norm"] = _norm_style(sequence_parallel)
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, loss_parallel: bool = True
) -> nn.Module:
    """Shard `model` in place over the 1-D `tp_mesh` (e.g. `mesh["tp"]`); returns it.

    Every rank must hold the same weights beforehand (same seed, or the same checkpoint): sharded
    weights are scattered from and replicated ones broadcast from the mesh's first rank, but the
    SequenceParallel norms take each rank's own copy. With `loss_parallel` the model returns logits
    as a DTensor sharded on the vocabulary; compute the loss inside `loss_context(model)`.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D mesh (e.g. mesh['tp']), got {tp_mesh.ndim}-D")
    cfg = getattr(model, "config", None)
    if isinstance(cfg, ModelConfig):
        problems = tensor_parallel_problems(cfg, tp_mesh.size())
        if problems:
            raise ValueError("; ".join(problems))
    tied = _is_tied(model)
    model = cast("CausalLM", model)  # (a family's model)
    prepare = model.config.family.prepare_tensor_parallel if isinstance(cfg, ModelConfig) else None
    if prepare is not None:
        prepare(model)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel, loss_parallel))
    for name, p in model.named_parameters():
        # torch's SequenceParallel makes new Parameters that require grad: a frozen norm (LoRA, freeze) stays frozen.
        p.requires_grad_(name not in frozen)
    blocks = list(model.model.layers.values())
    if sequence_parallel and blocks:
        # A pipeline stage exchanges full-sequence hidden states [B, T, C], so the stage's blocks see
        # the same sequence length as the rotary table: slice on entry, gather on exit.
        if getattr(model.model, "embed_tokens", None) is None:
            parallelize_module(blocks[0], tp_mesh, FirstArgLayout(Replicate(), Shard(1), to_local=True))
        if getattr(model.model, "norm", None) is None:
            parallelize_module(
                blocks[-1],
                tp_mesh,
                PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True),
            )
    if tied:
        # parallelize_module gave each module its own new Parameter; both are Shard(0) of the same
        # [V, C] matrix, so sharing one again makes their gradients accumulate into one tensor.
        model.lm_head.weight = model.model.embed_tokens.weight
    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_post_accumulate_grad_hook(_grad_like_param)
    if sequence_parallel:
        model.register_forward_pre_hook(partial(_check_seq_len, tp_mesh.size()), with_kwargs=True)
    setattr(model, TP_ATTR, {"mesh": tp_mesh, "sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel})
    return model


def _grad_like_param(p: DTensor) -> None:
    """Give the gradient its parameter's placement, as FSDP2 also does for the parameters it owns.

    DTensor leaves two kinds of mismatch: the vocab-parallel embedding's gradient comes back
    Replicate (a full [V, C] on every rank; slicing it to Shard(0) costs no communication and frees
    it), and the sequence-parallel norms' gradients come back Partial (one small all-reduce). Left
    alone, optimizers, clipping and data-parallel gradient sync would each redo that work per use.
    """
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        p.grad = g.redistribute(placements=p.placements)


def _check_seq_len(tp: int, _mod: nn.Module, args: tuple, kwargs: dict) -> None:
    # Uneven sequence shards would fail deep inside (or hang a collective); say what to change instead.
    x = args[0] if args else kwargs.get("input_ids")
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] % tp:
        raise ValueError(
            f"parallel.sequence_parallel: the sequence length {x.shape[1]} is not divisible by "
            f"tensor_parallel={tp}; use a data.seq_length that is a multiple of {tp}"
        )


def _is_tied(model: nn.Module) -> bool:
    head, embed = getattr(model, "lm_head", None), getattr(model.model, "embed_tokens", None)
    return head is not None and embed is not None and head.weight is embed.weight


@contextlib.contextmanager
def _loss_parallel_ctx():
    # torch's loss_parallel() skips its cleanup when the body raises; always switch it off again.
    ctx = _torch_loss_parallel()
    ctx.__enter__()
    try:
        yield
    finally:
        ctx.__exit__(None, None, None)


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """The context both the loss and its `.backward()` must run in: `loss_parallel()` when `model`
    was tensor-parallelised with vocab-sharded logits, else a no-op."""
    inner = model if hasattr(model, TP_ATTR) else getattr(model, "module", model)  # DDP-style wrappers
    info = getattr(inner, TP_ATTR, None)
    if info and info["loss_parallel"] and getattr(inner, "lm_head", None) is not None:
        return _loss_parallel_ctx()
    return contextlib.nullcontext()


def tensor_parallel_problems(
    model_cfg: ModelConfig, tp: int, *, sequence_parallel: bool = False, seq_length: int | None = None
) -> list[str]:
    """Why `tp` cannot shard this model evenly (empty list: it can). Each message names the key,
    the arithmetic and the tensor_parallel values that work for the whole model."""
    if tp < 1:
        return [f"parallel.tensor_parallel: must be at least 1, got {tp}"]
    if tp == 1:
        return []
    if not model_cfg.spec.tensor_parallel:
        return [
            f"parallel.tensor_parallel: model.arch={model_cfg.arch!r} cannot be tensor-parallel yet; "
            f"set tensor_parallel to 1 and use data_parallel with zero_stage 3 to shard it"
        ]
    sizes = {
        "model.num_heads": model_cfg.num_heads,
        "model.num_kv_heads": model_cfg.kv_heads,
        "model.intermediate_size": model_cfg.ffn_size,
        "model.vocab_size": model_cfg.vocab_size,
    }
    if model_cfg.moe:  # the experts are split inside on their width, a shared expert as a dense MLP
        sizes["model.moe_intermediate_size"] = model_cfg.expert_ffn_size
        if model_cfg.shared_expert_intermediate_size:
            sizes["model.shared_expert_intermediate_size"] = model_cfg.shared_expert_intermediate_size
    if sequence_parallel and seq_length:
        sizes["data.seq_length"] = seq_length  # sequence shards must be equal for DTensor.from_local
    valid = [d for d in divisors(sizes["model.num_heads"]) if all(v % d == 0 for v in sizes.values())]
    out = []
    for key, value in sizes.items():
        if value % tp:
            out.append(
                f"parallel.tensor_parallel: {tp} does not divide {key}={value} ({value} % {tp} = {value % tp}); "
                f"tensor_parallel values that divide every sharded size of this model: {valid}"
            )
    return out
