"""The planner's interface to a feature: the named terms a memory or parallel feature adds to a rank's peak and to
the step time. The analytic engine (fitlm.plan.analytic) counts the model itself (its blocks' saved tensors, the
parameters and their states) and only sums what the features listed in fitlm.plan.features return; the
throughput model (fitlm.plan.throughput) does the same with their seconds.

A rank's peak is the largest of three moments, and a term says in which it exists:
  - "loss": the end of forward, logits alive;
  - "backward": the first block's backward, logits freed and the block regathered or rebuilt;
  - "forward_backward": both of those (the larger of the two is the forward/backward peak);
  - "step": the optimizer step;
  - "rollout": GRPO's sampling, before the step's forward (fitlm.plan.grpo: the KV cache, the sampling logits);
  - "always": all of them (buffers, a frozen reference copy).
Its component (params, grads, optimizer, activations, logits, other) is where the report shows it; a named term
is listed among that component's parts. A term with `shown` names a share of bytes the engine counts already
(e.g. context parallel's gathered K/V among the blocks' saved tensors) or shows another size than it adds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fitlm.plan.setup import Setup

if TYPE_CHECKING:
    from fitlm.config import Config
    from fitlm.parallel.layout import Layout
    from fitlm.plan.analytic import Breakdown
    from fitlm.plan.devices import Device

Moment = Literal["loss", "backward", "forward_backward", "step", "rollout", "always"]
Component = Literal["params", "grads", "optimizer", "activations", "logits", "other"]
MOMENTS: dict[str, tuple[str, ...]] = {  # which peak candidates a term's moment belongs to
    "loss": ("loss",),
    "backward": ("backward",),
    "forward_backward": ("loss", "backward"),
    "step": ("step",),
    "rollout": ("rollout",),
    "always": ("loss", "backward", "step", "rollout"),
}


@dataclass(frozen=True)
class Term:
    component: Component
    name: str | None  # listed among the component's parts under this name (None: counted, not listed)
    bytes: float  # what it adds to the component at its moment
    moment: Moment = "forward_backward"
    shown: float | None = None  # the size listed, where it is not `bytes` (a share of what is counted already)
    in_blocks: bool = False  # a share of the blocks' saved tensors: activation offload moves it with them


@dataclass(frozen=True)
class Stage:
    """One pipeline rank (the first stage, or the last) as the engine sees it before the features' terms."""

    s: Setup
    first: bool
    tokens: float  # tokens of one micro batch (one chunk under pipeline parallel) on this rank
    layers: int  # blocks this rank holds
    in_flight: float  # micro batches (chunks) whose saved tensors are alive at the peak
    has_logits: bool  # this rank computes the loss
    dense: float  # parameters counted by the engine (those no feature counts itself), before ZeRO
    trained: float  # trainable ones among them


@dataclass(frozen=True)
class Owned:
    """Parameters a feature counts itself: `dense` and `dense_trained` leave the engine's count (they are this
    feature's before it splits them), and `n` of them (`trained` trainable) are held by the rank, with their
    gradients and optimizer states counted as `as_setup` shards them."""

    dense: float
    dense_trained: float
    n: float
    trained: float
    as_setup: Setup
    nf4: tuple[float, float] = (0.0, 0.0)  # QLoRA's NF4 parameters among the `n`, and their bytes on the rank


@dataclass(frozen=True)
class Timed:
    """What a feature adds to a step on a device: seconds on the critical path by report key, and seconds of
    gradient traffic that overlaps the backward pass as data parallel's does."""

    critical: dict[str, float] = field(default_factory=dict)
    overlapped: float = 0.0


@dataclass(frozen=True)
class TimeContext:
    """What a feature's time terms may read: the variant, the device, the compute seconds of a step, the peak's
    breakdown (for bytes that move) and the ring cost and link bandwidth the base layout uses."""

    s: Setup
    dev: "Device"
    compute_s: float
    peak: Callable[[], "Breakdown"]  # the variant's breakdown (computed when a feature asks: it is not free)
    ring: Callable[[str, float, int, float], float]
    bandwidth: Callable[[int, int], float]  # (group size, stride in the mesh) -> bytes/s
    latency_s: float


@dataclass(frozen=True)
class Axis:
    """A knob `plan --search` turns for this feature: the Setup field and its values for one base layout."""

    knob: str
    values: list


def _none(*_args) -> tuple:
    return ()


@dataclass(frozen=True)
class Feature:
    """A memory or parallel feature as the planner sees it; every hook is optional."""

    name: str
    memory: Callable[[Stage], Iterable[Term]] = _none  # its terms of a rank's peak
    owned: Callable[[Setup, bool], Owned | None] = lambda s, first: None  # parameters it counts itself
    time: Callable[[TimeContext], Timed] = lambda tc: Timed()
    axis: Callable[["Config", "Layout"], Axis | None] = lambda cfg, lay: None  # what plan --search tries
    # Saved tensors that leave the device: (stage, the blocks' saved bytes, those outside the blocks) -> what stays
    # of each and what the host holds (activation offload)
    relocate: Callable[[Stage, float, float], tuple[float, float, float]] | None = None


def sum_terms(terms: Iterable[Term], moment: str, component: str) -> float:
    """Bytes the terms add to `component` at the peak candidate `moment` ("loss", "backward" or "step")."""
    return sum(t.bytes for t in terms if t.component == component and moment in MOMENTS[t.moment])


def only(terms: Iterable[Term], moment: str) -> float:
    """Bytes of the terms that exist at `moment` ("loss" or "backward") and at no other: what tells the two
    forward/backward peak candidates apart."""
    return sum(t.bytes for t in terms if t.moment == moment)


def named(terms: Iterable[Term], moment: str, component: str, offloaded: float = 1.0) -> dict[str, float]:
    """The named parts of `component` at `moment`; shares of the blocks' saved tensors scaled by `offloaded`, the
    fraction of them activation offload leaves on the device."""
    out: dict[str, float] = {}
    for t in terms:
        if t.name and t.component == component and moment in MOMENTS[t.moment]:
            size = t.bytes if t.shown is None else t.shown
            out[t.name] = out.get(t.name, 0.0) + size * (offloaded if t.in_blocks else 1.0)
    return out
