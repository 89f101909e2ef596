"""Host memory per rank at load, step and save, and per node against the host's RAM.

Why: a run that fits its devices can still be killed by the host: every rank of a node starts at once, and
each holds the framework, the tensors it is loading and, where the device is the host (CPU training) or
states are offloaded, its share of the training state. fitlm's trainer builds the model on the meta device,
parallelizes it and allocates only this rank's share (fitlm.parallel.materialize); the weights arrive one
source tensor at a time (each rank reads a whole tensor in its file dtype and converts it to the training
dtype, then keeps its slice); the final save streams group by group (every rank gathers one block, or one
weight outside the blocks, rank 0 converts it to the file's layout and writes it, then frees it), after the
gradients and optimizer states are released (the last checkpoint holds them). So, per rank (bytes):

    load = runtime + parameters resident on the host + largest source tensor (file dtype) + its training-dtype copy
    step = runtime + training state resident on the host
    save = runtime + parameters resident on the host + largest gathered group, gathered + converted (rank 0;
           LoRA's merge converts to fp32; the other ranks of a sharded layout hold the gathered copy only)

`runtime` is the interpreter, torch and the accelerator runtime's host side (Device.host_runtime_bytes).
Resident on the host: everything on a CPU device (its peak, parameters at load); on an accelerator what
`memory.cpu_offload` keeps there (HostAdamW's states and fp32 master, or FSDP2's CPU shards, parameters
among them at load), and at the step the saved activations `memory.activation_offload` moved there (pinned;
fitlm.plan.activation_offload: on a CPU device none move). A node runs min(world, node size) ranks: its peak is the
sum of theirs, checked
against 90% of the host's RAM (the rest for the OS and the page cache the data is read through).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from fitlm.plan import finetune as ft
from fitlm.plan.analytic import Breakdown, model_states, param_bytes, rank_params
from fitlm.plan.devices import Device
from fitlm.plan.setup import Setup, block_kinds

HOST_USABLE = 0.9  # of the host's RAM; the rest for the OS and the page cache the packed data is read through
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class SourceTensor:
    """The largest tensor a load reads whole: elements, bytes per element in the file, and where that is known from."""

    numel: int
    file_bytes: int
    origin: str


def source_tensor(s: Setup) -> SourceTensor:
    """The largest source tensor of this run's initial weights: read from model.init_from's safetensors headers
    when they can be read, else from the config (an HF checkpoint in bf16; a seeded initialisation makes each
    module in fp32)."""
    linears = max((i * o for _, i, o in s.counts.linears), default=0)
    from_config = max(s.vocab * s.h, linears)
    init_from = s.cfg.model.init_from
    if not init_from:
        return SourceTensor(from_config, 4, "seeded initialisation (fp32, one module at a time)")
    try:
        from fitlm.models.streaming import hf_source

        specs = [reader.spec(name) for name, reader in hf_source(Path(init_from)).items()]
        dtype, shape = max(specs, key=lambda spec: _numel(spec[1]))
        return SourceTensor(
            _numel(shape),
            _DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 4),
            f"{init_from} (safetensors header: {str(dtype).removeprefix('torch.')} {list(shape)})",
        )
    except Exception:  # noqa: BLE001 - unreadable or not safetensors (GGUF, a hub name): plan from the config
        return SourceTensor(from_config, 2, f"{init_from} unread: assumed bf16 tensors of the config's shapes")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass(frozen=True)
class HostPeaks:
    """Bytes per rank (`save`: rank 0's) and per node at each moment, with their parts."""

    load: int
    step: int
    save: int
    save_other: int  # another rank of the node during the save
    ranks_per_node: int
    ram_bytes: int
    parts: dict[str, dict[str, int]]

    @property
    def usable_bytes(self) -> int:
        return int(self.ram_bytes * HOST_USABLE)

    @property
    def node(self) -> dict[str, int]:
        r = self.ranks_per_node
        return {"load": r * self.load, "step": r * self.step, "save": self.save + (r - 1) * self.save_other}

    @property
    def worst(self) -> tuple[str, int]:
        return max(self.node.items(), key=lambda kv: kv[1])

    @property
    def fits(self) -> bool:
        return self.worst[1] <= self.usable_bytes


def _is_host(dev: Device) -> bool:
    return dev.name == "cpu"


def host_peaks(s: Setup, mem: Breakdown, dev: Device, source: SourceTensor) -> HostPeaks:
    """The formulas of the module docstring for one planned variant (`mem` is its device breakdown)."""
    runtime = dev.host_runtime_bytes
    pb = param_bytes(s)
    fsdp_offload = s.offload and s.dims.fsdp_sharded
    params_at_load: float
    if _is_host(dev):  # the device is the host: the whole training state lives here
        params_at_load = mem.params
        state = mem.total + mem.host
    else:
        params_at_load = model_states(replace(s, offload=False), rank_params(s, True))[0] if fsdp_offload else 0
        state = mem.host
    state_at_save = params_at_load  # the trainer releases gradients and optimizer states before the save
    # O2 stores frozen weights in half (fitlm.finetune.apply.stores_frozen_in_half): under LoRA every weight
    # the load reads whole and the save gathers (the embedding, the head, a block's base) is frozen.
    stored = 2 if ft.frozen_in_half(s) and not ft.embeddings_train(s) else pb
    # `.to(param.dtype)` copies only when the dtypes differ (fp32 -> fp32 is the same tensor)
    convert = stored if stored != source.file_bytes else 0
    read = source.numel * (source.file_bytes + convert)
    # the largest block (an MoE model's routed one), or the largest weight outside them (embedding, head)
    group = max(max(one.counts.block_params for _, one in block_kinds(s)), s.vocab * s.h)
    gathered = group * stored
    converted = group * (4 if s.method == "lora" else stored)  # the LoRA merge gives the file fp32 weights
    sharded = s.dims.fsdp_sharded or s.tp > 1
    load = runtime + params_at_load + read
    step = runtime + state
    save = runtime + state_at_save + gathered + converted
    save_other = runtime + state_at_save + (gathered if sharded else 0)
    parts = {
        "load": {
            "runtime": runtime,
            "parameters on the host": int(params_at_load),
            "largest source tensor (file dtype)": source.numel * source.file_bytes,
            "its training-dtype copy": source.numel * convert,
        },
        "step": {
            "runtime": runtime,
            "training state on the host": int(state - mem.host_activations),
            "offloaded activations (pinned)": mem.host_activations,
        },
        "save": {
            "runtime": runtime,
            "parameters on the host": int(state_at_save),
            "largest group, gathered": gathered,
            "largest group, converted for the file": converted,
        },
    }
    ranks = min(s.world, dev.node_size)
    return HostPeaks(int(load), int(step), int(save), int(save_other), ranks, dev.host_memory_bytes, parts)


def host_report(h: HostPeaks, source: SourceTensor, ram_source: str) -> dict:
    """The plan JSON's `host` section."""
    moment, peak = h.worst
    return {
        "ram_bytes": h.ram_bytes,
        "usable_bytes": h.usable_bytes,
        "ram_source": ram_source,
        "ranks_per_node": h.ranks_per_node,
        "per_rank": {"load": h.load, "step": h.step, "save": h.save, "save_other_ranks": h.save_other},
        "per_node": h.node,
        "parts": h.parts,
        "peak_moment": moment,
        "fits": h.fits,
        "over_by_bytes": max(0, peak - h.usable_bytes),
        "source_tensor": {"numel": source.numel, "file_bytes_per_element": source.file_bytes, "from": source.origin},
        "formulas": {
            "load": "runtime + parameters on the host + largest source tensor x (file + training bytes)",
            "step": "runtime + training state on the host",
            "save": "runtime + parameters on the host + largest gathered group, gathered + converted (rank 0)",
            "node": "ranks per node x per rank (save: rank 0 + the others' gathered copies)",
        },
    }
