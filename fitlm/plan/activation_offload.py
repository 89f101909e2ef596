"""memory.activation_offload in the plan: which saved activations leave the device, what stays, what it costs.

The runtime (fitlm.memory.activation_offload) moves the tensors the forward saves for backward to pinned host
memory on a side stream and brings each block's back just before its backward. So, on an accelerator:
  - `true`/`blocks`: every decoder block's saved tensors go to the host except a working set of two blocks
    (the one being computed, whose tensors are still on the device or already fetched back, and the next one,
    prefetched); with recompute that is the block inputs recompute keeps (the rebuilt block's working set is on
    the device anyway). Context parallel's gathered K/V are saved tensors of the block and move with it.
  - `model`: also the tensors saved outside the blocks (embedding output, final norm); the logits path stays:
    its loss backward needs logits, log-softmax and their gradient on the device together.
  - the half weight copies the matmuls save (O1) stay: they are the parameters' casts, shared by the chunks.
  - the runtime leaves tensors under 1 MiB in place (copy latency for nothing); the plan moves them all, which
    is what happens once a block's [B, T, h] tensors are past that size (any long-context run): at toy sizes
    (a few thousand tokens of a narrow model) the plan overstates what leaves the device.
Host memory rises by what left the device (plan/host.py counts it per rank at the step). Time: each offloaded
byte crosses the host link down in forward and up in backward (Device.host_link_gbs, PCIe), overlapped with
that pass's compute; only what does not fit under it is exposed.
On the `cpu` device the tensors are in host memory already: the runtime does nothing, nor does the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitlm.plan.setup import Setup
from fitlm.plan.terms import Feature, Stage, TimeContext, Timed

RESIDENT_BLOCKS = 2  # the block being computed and the one prefetched


@dataclass(frozen=True)
class Offload:
    """Device bytes left of the blocks' and outside tensors, and the bytes moved to the host."""

    blocks: float
    outside: float
    host: float


def offload(s: Setup, blocks: float, layers: int, outside: float) -> Offload:
    """Split the saved tensors of `layers` blocks (`blocks` bytes in all, in-flight chunks included) and those
    outside the blocks (`outside`) into what stays on the device and what the host holds."""
    mode = s.offload_mode
    if mode == "none" or layers == 0:
        return Offload(blocks, outside, 0.0)
    stay = blocks * min(layers, RESIDENT_BLOCKS) / layers
    moved_outside = outside if mode == "model" else 0.0
    return Offload(stay, outside - moved_outside, blocks - stay + moved_outside)


def note(s: Setup) -> str | None:
    """What the plan says about offload on this device, when the config asks for it."""
    if not s.act_offload:
        return None
    if s.device_kind == "cpu":
        return (
            "memory.activation_offload: on the cpu device the saved activations are in host memory already; "
            "the runtime moves nothing and the plan is unchanged"
        )
    return None


def copy_s(s: Setup, host_bytes: float, host_link_gbs: float, compute_s: float) -> float:
    """Exposed seconds per step of the copies: every micro batch sends its offloaded bytes down during its
    forward (a third of the compute) and fetches them back during its backward (two thirds)."""
    if host_bytes <= 0:
        return 0.0
    one_way = s.accum * host_bytes / (host_link_gbs * 1e9)
    return max(0.0, one_way - compute_s / 3) + max(0.0, one_way - 2 * compute_s / 3)


def relocate(st: Stage, blocks: float, outside: float) -> tuple[float, float, float]:
    moved = offload(st.s, blocks, st.layers, outside)
    return moved.blocks, moved.outside, moved.host


def time(tc: TimeContext) -> Timed:
    s = tc.s
    host = tc.peak().host_activations if s.offload_mode != "none" else 0.0
    return Timed({"activation_offload_copies": copy_s(s, host, tc.dev.host_link_gbs, tc.compute_s)})


FEATURE = Feature("activation offload", relocate=relocate, time=time)
