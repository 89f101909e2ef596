"""Activation offload (memory.activation_offload): the tensors the forward saves for backward go to host
memory, and come back when backward needs them.

`blocks` (or `true`) hooks every decoder block's call, `model` the whole stage's call (embedding,
final norm, output layer and, with memory.loss_chunk_size, the loss that runs inside forward; the plain
loss on whole logits runs after the call, in fitlm.step.train_step, and stays on the device). Inside
a hooked call torch's saved-tensor hooks see every tensor autograd keeps; each one worth moving is
copied to the host and replaced by a small record, and the record is copied back on first use in
backward. Left in place: tensors under `MIN_BYTES` (copy latency, no memory to speak of), weights
(a parameter, FSDP2's unsharded parameters, O2's half casts and views of any of these: backward needs
them anyway, and copying them would move the model every step), tensor subclasses (DTensor) and
tensors not on the device.

On CUDA the host copies are pinned and made on a side stream, so they overlap compute; when
backward first touches a hooked call's tensors, the tensors of the call before it (the next one
backward reaches) are copied back ahead of use on that stream. On a CPU device the device *is* host
memory: `apply_activation_offload` installs nothing and training is unchanged (there is no memory to
gain). The hooks themselves run on any device through `offload_saved_tensors`, which the tests use
with host == device (a real copy each way).

With recompute the checkpoint keeps only each block's inputs (`selective` also keeps matmul outputs,
inside the checkpoint, out of these hooks' reach): those inputs are what is offloaded. Under a whole
model torch.compile graph nothing would be gained -- its backward takes every saved tensor back at
once -- so memory.compile goes per block when offload is on (`compiles_whole_model`), and a whole-model
graph compiled by hand is refused; per-block compile works (the hooks' entry and exit are graph breaks at
the block's boundary, its body stays one graph).

Hooks nest innermost-wins, so tensors saved under another saved-tensor hook stay where that hook puts
them: O2's recast (fitlm.memory.precision) hooks each Linear's own call, so with activation offload on
the recast is off (`recasts_in_backward(..., offload=True)`) and the half casts are saved, and kept on
the device, like any weight. A tensor several blocks save (the
RoPE tables cos, sin [B, T, D]) is copied once per save: small next to a block input [B, T, C].
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from fitlm.memory.compile import compiled_whole
from fitlm.memory.recompute import transformer_blocks

# 1 MiB. A long-context block's activations are tens of MiB each ([B, T, C] at T = 4096, C = 4096 in
# bf16 is 32 MiB), while what falls below this (norm statistics [B, T, 1], attention's log-sum-exp
# [B, H, T], masks, indices) costs more in copy latency than it frees.
MIN_BYTES = 1 << 20


def offload_mode(value: bool | str) -> str | None:
    """memory.activation_offload as a mode: None (off), "blocks" (also `true`) or "model"."""
    if value is False:
        return None
    if value is True:
        return "blocks"
    if value in ("blocks", "model"):
        return str(value)
    raise ValueError(f"memory.activation_offload={value!r}: use false, true, blocks or model")


@dataclass
class OffloadStats:
    """Running counts since the hooks were installed (not reset per step)."""

    offloaded: int = 0  # saved tensors moved to host memory
    offloaded_bytes: int = 0
    reloaded: int = 0  # unpacks of moved tensors in backward
    prefetched: int = 0  # of those, copied back ahead of their use
    weights: int = 0  # saved parameters (or views / casts of them) left in place
    small: int = 0  # saved tensors under min_bytes left in place


class _Saved:
    """What autograd holds instead of an offloaded tensor: its host copy and, once prefetched, the
    device copy and the event that says it has arrived."""

    __slots__ = ("host", "group", "device_copy", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, group: int):
        self.host, self.group = host, group
        self.device_copy: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None


def is_weight(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or a dtype cast of one (O2, fitlm.memory.precision) or a view of that.

    FSDP2's unsharded parameters are nn.Parameters too, so ZeRO-3 re-gathers them in backward as usual
    instead of us keeping a host copy of every weight."""
    base = t if t._base is None else t._base  # a view's _base is the tensor it was taken from
    if isinstance(base, nn.Parameter):
        return True
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return False
    source = fn.next_functions[0][0]  # AccumulateGrad of the cast's input when that input is a leaf
    return isinstance(getattr(source, "variable", None), nn.Parameter)


class ActivationOffloader:
    """The pack/unpack pair of the saved-tensor hooks, with the streams and bookkeeping they need.

    `device`: where training runs; `host`: where saved tensors go (the CPU; the tests pass host == device).
    Every entry into and exit from a hooked call starts a new group; backward meets groups in reverse
    order, so the first unpack in a group prefetches the nearest earlier group that still has tensors.
    Forward and backward never run at the same time in one process, so no lock is needed.
    """

    def __init__(self, device: torch.device, host: torch.device = torch.device("cpu"), min_bytes: int = MIN_BYTES):
        self.device, self.host, self.min_bytes = device, host, min_bytes
        self.stats = OffloadStats()
        self.group = 0
        # group -> its offloaded records still held by some autograd graph (a graph freed without
        # backward drops its records, and with them these entries)
        self._groups: dict[int, weakref.WeakSet[_Saved]] = {}
        cuda = device.type == "cuda" and host.type == "cpu"
        self.stream = torch.cuda.Stream(device) if cuda else None  # side stream for copies both ways

    def next_group(self) -> None:
        self.group += 1
        # Forget the oldest groups once empty (all unpacked, or their graph freed): amortised O(1).
        while self._groups:
            oldest = next(iter(self._groups))
            if self._groups[oldest]:
                break
            del self._groups[oldest]

    def pack(self, t: torch.Tensor) -> torch.Tensor | _Saved:
        if is_weight(t):
            self.stats.weights += 1
            return t
        if type(t) is not torch.Tensor or t.device.type != self.device.type:
            return t
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes:
            self.stats.small += 1
            return t
        saved = _Saved(self._to_host(t), self.group)
        self._groups.setdefault(self.group, weakref.WeakSet()).add(saved)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += nbytes
        return saved

    def unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        if self._groups.pop(saved.group, None) is not None:  # backward has reached this group
            self._prefetch(before=saved.group)
        self.stats.reloaded += 1
        if saved.device_copy is None:  # not prefetched, or unpacked a second time
            t, ready = self._to_device(saved.host)
        else:
            t, ready = saved.device_copy, saved.ready
            saved.device_copy = saved.ready = None  # autograd owns it now; freed when backward is done with it
        if ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(ready)
            t.record_stream(compute)  # allocated on the side stream: not reused while compute still reads it
        return t

    def _prefetch(self, before: int) -> None:
        for group in reversed(self._groups):
            records = self._groups[group]
            if group < before and records:
                for saved in list(records):
                    if saved.device_copy is None:
                        saved.device_copy, saved.ready = self._to_device(saved.host)
                        self.stats.prefetched += 1
                return

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            return t.to(self.host, copy=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is written by queued compute
        with torch.cuda.stream(self.stream):
            host = t.to(self.host, non_blocking=True)  # non-blocking to the CPU allocates pinned memory, same strides
        t.record_stream(self.stream)  # t's memory is not handed out again before the copy has read it
        return host

    def _to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self.stream is None:
            return host.to(self.device, copy=True), None
        # The side stream also made the host copy, so this one starts after it has finished. The pinned
        # host buffer stays valid until the copy is done: torch's pinned allocator records the copy's event.
        with torch.cuda.stream(self.stream):
            return host.to(self.device, non_blocking=True), self.stream.record_event()


_OFFLOADER = "_fitlm_activation_offloader"


def offload_saved_tensors(stage: nn.Module, mode: bool | str, offloader: ActivationOffloader) -> nn.Module:
    """Run `stage`'s blocks (`blocks`, `true`) or the whole stage (`model`) under `offloader`'s hooks, on any device.

    Module hooks rather than a wrapped forward, so the hooks surround whatever forward the module has
    when called (the chunked loss replaces the stage's forward after this). In "model" mode the blocks
    are hooked too, only to mark group boundaries for prefetch."""
    resolved = offload_mode(mode)
    if resolved is None:
        return stage
    hooks = saved_tensors_hooks(offloader.pack, offloader.unpack)
    open_regions: list[nn.Module] = []  # hooked calls in progress, innermost last

    def enter(module: nn.Module, args) -> None:
        if compiled_whole(stage):
            raise ValueError(
                "memory.activation_offload with memory.compile compiling the whole model: its one backward graph "
                "takes every saved tensor back at once, so nothing is saved. Set memory.recompute (compile then "
                "goes per block), or turn one of memory.compile and memory.activation_offload off."
            )
        offloader.next_group()
        hooks.__enter__()
        open_regions.append(module)

    def leave(module: nn.Module, args, output) -> None:
        if open_regions and open_regions[-1] is module:  # not when its entry never ran (an earlier hook raised)
            open_regions.pop()
            hooks.__exit__(None, None, None)
            offloader.next_group()  # what the caller saves next is not this call's

    for region in ([stage] if resolved == "model" else []) + transformer_blocks(stage):
        region.register_forward_pre_hook(enter)
        region.register_forward_hook(leave, always_call=True)
    setattr(stage, _OFFLOADER, offloader)
    return stage


def offloads(mode: bool | str, device: torch.device) -> bool:
    """Whether `apply_activation_offload` hooks anything: the option is on and the device is not host memory
    (what other features that hook saved tensors, such as O2's recast, need to know)."""
    return offload_mode(mode) is not None and device.type != "cpu"


def apply_activation_offload(stage: nn.Module, mode: bool | str, device: torch.device) -> nn.Module:
    """Apply after recompute and before compile and data parallel (fitlm.parallel.apply).

    On a CPU device this is a no-op by design: the device's memory is host memory, nothing is moved."""
    if not offloads(mode, device):
        return stage
    return offload_saved_tensors(stage, mode, ActivationOffloader(device))
