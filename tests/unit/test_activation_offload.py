"""memory.activation_offload (fitlm.memory.activation_offload): saved tensors moved out and back give the
same losses and gradients, every large saved activation goes through the hooks and no weight does.

A CPU device has no other memory, so these tests run the hooks with host == device: each pack is a real
copy into a new buffer and each unpack a copy back, which is what the CUDA path does minus the streams."""

from __future__ import annotations

import copy

import pytest
import torch

from fitlm.config import MemoryConfig, ModelConfig
from fitlm.memory import activation_offload
from fitlm.memory.activation_offload import (
    ActivationOffloader,
    OffloadStats,
    apply_activation_offload,
    is_weight,
    offload_mode,
    offload_saved_tensors,
    offloads,
)
from fitlm.memory.precision import apply_precision
from fitlm.memory.recompute import apply_recompute, transformer_blocks
from fitlm.models.loss import cross_entropy_sum
from fitlm.registry import build_model

TINY = ModelConfig(
    arch="llama",
    hidden_size=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    vocab_size=96,
    max_seq_len=16,
    tie_embeddings=False,
)
CPU = torch.device("cpu")
# Between the small saved tensors (norm statistics [2, 16, 1] fp32: 128 B) and the activations and weights
# ([2, 16, 32] fp32: 4 KiB; q_proj 4 KiB), so both the size rule and the weight rule are exercised.
MIN_BYTES = 1024


class Copier(ActivationOffloader):
    """Host == device, and a note of every tensor that was moved (its storage)."""

    def __init__(self):
        super().__init__(CPU, host=CPU, min_bytes=MIN_BYTES)
        self.moved: list[int] = []

    def _to_host(self, t):
        self.moved.append(t.untyped_storage().data_ptr())
        return super()._to_host(t)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = build_model(TINY)
    ids = torch.randint(0, TINY.vocab_size, (2, 16))  # [B, T]
    labels = torch.randint(0, TINY.vocab_size, (2, 16))
    return model, ids, labels


def loss_and_grads(model, ids, labels):
    loss = cross_entropy_sum(model(ids), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def offload_stats(module) -> OffloadStats | None:
    """What `module`'s offload hooks have moved so far, or None where nothing is hooked."""
    offloader = getattr(module, activation_offload._OFFLOADER, None)
    return None if offloader is None else offloader.stats


def prepared(tiny, recompute="none", memory=None):
    model = copy.deepcopy(tiny[0])
    if memory is not None:
        apply_precision(model, memory, sharded=False)
    apply_recompute(model, recompute)
    return model


@pytest.mark.parametrize(
    "mode,recompute",
    [("blocks", "none"), ("model", "none"), ("blocks", "full"), ("model", "full"), ("blocks", "selective")],
)
def test_offload_gives_equal_losses_and_gradients(tiny, mode, recompute):
    _, ids, labels = tiny
    loss, grads = loss_and_grads(prepared(tiny, recompute), ids, labels)
    model, copier = prepared(tiny, recompute), Copier()
    offload_saved_tensors(model, mode, copier)
    got, got_grads = loss_and_grads(model, ids, labels)
    assert torch.equal(got, loss)
    assert grads.keys() == got_grads.keys() and all(torch.equal(got_grads[n], g) for n, g in grads.items())
    stats = offload_stats(model)
    assert stats is copier.stats and stats.offloaded > 0
    assert stats.reloaded == stats.offloaded  # every moved tensor came back, once
    assert 0 < stats.prefetched < stats.offloaded  # earlier calls' tensors were fetched ahead of use
    if recompute == "full":  # the checkpoint keeps each block's inputs, x [B, T, C] and cos, sin [B, T, D]
        in_blocks = 3 * TINY.num_layers
        assert stats.offloaded == in_blocks if mode == "blocks" else stats.offloaded > in_blocks  # + final norm, head
        assert stats.weights == (2 if mode == "model" else 0)  # the final norm's and the output layer's weights


def saved_by_blocks(model, ids, labels) -> tuple[int, set[int]]:
    """Independently of the offloader: how many large non-weight tensors the blocks save, and the storages of
    every parameter they save."""
    large, weights = [0], set()

    def pack(t):
        if is_weight(t) or isinstance(t, torch.nn.Parameter):
            weights.add(t.untyped_storage().data_ptr())
        elif t.numel() * t.element_size() >= MIN_BYTES:
            large[0] += 1
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    for block in transformer_blocks(model):
        block.register_forward_pre_hook(lambda *_: hooks.__enter__())
        block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    cross_entropy_sum(model(ids), labels).backward()
    return large[0], weights


def test_every_large_block_activation_goes_through_the_hooks_and_no_weight(tiny):
    _, ids, labels = tiny
    large, weight_storages = saved_by_blocks(prepared(tiny), ids, labels)
    model, copier = prepared(tiny), Copier()
    offload_saved_tensors(model, "blocks", copier)
    loss_and_grads(model, ids, labels)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(weight_storages) >= 7 * TINY.num_layers  # q, k, v, o, gate, up, down: the rule had work to do
    assert copier.stats.offloaded == len(copier.moved) == large > 0
    assert copier.stats.weights >= 7 * TINY.num_layers and copier.stats.small > 0
    assert not params & set(copier.moved)


def test_o2_half_weight_casts_stay_in_place(tiny, monkeypatch):
    """Where O2 keeps its half casts (fitlm.memory.precision.recasts_in_backward false), they are weights too."""
    _, ids, labels = tiny
    monkeypatch.setattr("fitlm.memory.precision.recasts_in_backward", lambda *a, **kw: False)
    model, copier = prepared(tiny, memory=MemoryConfig(mixed_precision="O2")), Copier()
    offload_saved_tensors(model, "blocks", copier)
    loss_and_grads(model, ids, labels)
    assert copier.stats.weights >= 7 * TINY.num_layers and copier.stats.offloaded > 0


def test_backward_uses_the_copies_it_brings_back(tiny):
    """The unpacked copies are what backward computes with: corrupt them and the gradients change."""
    _, ids, labels = tiny
    _, grads = loss_and_grads(prepared(tiny), ids, labels)

    class Zeroes(Copier):
        def _to_device(self, host):
            return torch.zeros_like(host), None

    model = prepared(tiny)
    offload_saved_tensors(model, "blocks", Zeroes())
    _, got = loss_and_grads(model, ids, labels)
    assert not torch.equal(got["model.layers.0.mlp.down_proj.weight"], grads["model.layers.0.mlp.down_proj.weight"])


def test_cpu_device_is_a_documented_no_op_and_bad_values_name_the_key(tiny):
    model = prepared(tiny)
    assert apply_activation_offload(model, True, CPU) is model
    assert offload_stats(model) is None
    assert all(not block._forward_pre_hooks for block in transformer_blocks(model))
    assert [offload_mode(v) for v in (False, True, "blocks", "model")] == [None, "blocks", "blocks", "model"]
    cuda = torch.device("cuda")
    assert not offloads(True, CPU) and offloads("model", cuda) and not offloads(False, cuda)
    with pytest.raises(ValueError, match="memory.activation_offload"):
        offload_mode("layers")


def test_whole_model_compile_is_refused(tiny):
    """One compiled graph's backward takes all its saved tensors back at once: nothing would be gained."""
    whole = prepared(tiny)
    offload_saved_tensors(whole, "model", Copier())
    whole.compile(backend="eager", dynamic=False)
    with pytest.raises(ValueError, match="memory.compile"):
        whole(tiny[1])


@pytest.mark.slow  # tracing a block forward and backward takes seconds on a loaded CPU
def test_per_block_compile_offloads_what_the_compiled_blocks_save(tiny):
    _, ids, labels = tiny
    loss, grads = loss_and_grads(prepared(tiny), ids, labels)
    model, copier = prepared(tiny), Copier()
    offload_saved_tensors(model, "blocks", copier)
    for block in transformer_blocks(model):
        block.compile(backend="aot_eager", dynamic=False)  # AOTAutograd: its own saved tensors, packed by our hooks
    got, got_grads = loss_and_grads(model, ids, labels)
    torch.testing.assert_close(got, loss)
    torch.testing.assert_close(got_grads, grads)
    assert copier.stats.offloaded > 0 and copier.stats.reloaded == copier.stats.offloaded


def test_parallelize_hooks_every_stage_after_recompute(tiny_corpus, tmp_path, monkeypatch):
    """The trainer's path (fitlm.parallel.apply): with the CPU no-op replaced by real copies, recompute's
    checkpoints hand their block inputs to the hooks and training runs on the copies."""
    from fitlm.config import validate_dict
    from fitlm.train.trainer import Trainer
    from tests.e2e.helpers import tiny_config

    offloaders: list[ActivationOffloader] = []

    def on_cpu(stage, mode, device):
        offloaders.append(ActivationOffloader(device, host=device, min_bytes=0))
        return offload_saved_tensors(stage, mode, offloaders[-1])

    monkeypatch.setattr("fitlm.parallel.apply.apply_activation_offload", on_cpu)
    memory = {"activation_offload": True, "recompute": "full"}
    cfg = tiny_config(tiny_corpus, tmp_path / "out", train={"max_steps": 2, "eval_interval": 0}, memory=memory)
    history = Trainer(validate_dict(cfg)).fit().history
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    (stats,) = [o.stats for o in offloaders]
    assert stats.offloaded > 0 and stats.reloaded == stats.offloaded and stats.weights == 0
