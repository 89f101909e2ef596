"""Memory options: each trains, and matches its reference (fitlm.memory, fitlm.models.loss)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fitlm.config import TrainConfig, validate_dict
from fitlm.memory.offload import HostAdamW
from fitlm.memory.tracking import peak_live_bytes
from fitlm.models.loss import IGNORE_INDEX, chunked_cross_entropy_sum, cross_entropy_sum
from fitlm.step.optim import build_optimizer, scale_for_batch
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import read_metrics, tiny_config


def make_trainer(tiny_corpus, path, **sections) -> Trainer:
    return Trainer(validate_dict(tiny_config(tiny_corpus, path / "out", **sections)))


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def losses(trainer: Trainer) -> list[float]:
    return [r["loss"] for r in trainer.fit().history]


SHORT = {"max_steps": 4, "eval_interval": 0}


@pytest.fixture(scope="module")
def fp32_losses(tiny_corpus, tmp_path_factory):
    return losses(make_trainer(tiny_corpus, tmp_path_factory.mktemp("fp32"), train=SHORT))


@pytest.mark.process
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_precision_levels_train_close_to_fp32(tiny_corpus, tmp_path, fp32_losses, level):
    trainer = make_trainer(tiny_corpus, tmp_path, train=SHORT, memory={"mixed_precision": level})
    model = trainer.pm.model
    stored = torch.bfloat16 if level == "O3" else torch.float32
    assert {p.dtype for p in model.parameters()} == {stored}
    # O2/O3 compute every op in half: the blocks' outputs (the saved activations) are bf16; O1 mixes.
    seen = []
    model.model.layers["0"].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    got = losses(trainer)
    assert got == pytest.approx(fp32_losses, rel=2e-3)
    assert got != fp32_losses  # it really computed in half
    assert seen[0] == (torch.float32 if level == "O1" else torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {stored}  # the master copy stays fp32 under O2


def test_o2_gives_fp32_gradients_to_fp32_parameters(tiny_corpus, tmp_path):
    trainer = make_trainer(tiny_corpus, tmp_path, memory={"mixed_precision": "O2"})
    trainer.step.forward_backward([next(iter(trainer.loader))])
    g = grads(trainer.pm.model)
    assert g and all(t.dtype == torch.float32 for t in g.values())
    assert set(trainer.pm.model.state_dict()) == set(make_trainer(tiny_corpus, tmp_path / "b").pm.model.state_dict())


@pytest.mark.process
def test_fp16_overflow_skips_exactly_that_step_and_recovers(tiny_corpus, tmp_path):
    trainer = make_trainer(
        tiny_corpus,
        tmp_path,
        train={"max_steps": 6, "eval_interval": 0},
        memory={
            "mixed_precision": "O2",
            "half_dtype": "fp16",
            "loss_scaling": {"initial_scale": 1024.0, "growth_interval": 2},
        },
    )
    model = trainer.pm.model
    real_forward_backward, calls, snapshots = trainer.step.forward_backward, [], {}

    def forward_backward(batches):
        loss = real_forward_backward(batches)
        calls.append(1)
        snapshots[len(calls)] = {k: v.clone() for k, v in model.state_dict().items()}  # weights before this step
        if len(calls) == 3:  # an overflow in one gradient element of step 3
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        return loss

    trainer.step.forward_backward = forward_backward
    history = trainer.fit().history
    after = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = [r for r in read_metrics(tmp_path / "out") if "loss" in r]
    assert [r["skipped"] for r in metrics] == [False, False, True, False, False, False]
    # dynamic schedule: 1024, grows after 2 clean steps, halves on the overflow, grows again after 2
    assert [r["loss_scale"] for r in metrics] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0]
    assert metrics[2]["grad_norm"] == float("inf") and metrics[-1]["skipped_steps"] == 1
    # step 3 changed nothing, the neighbouring steps did
    assert all(torch.equal(snapshots[3][k], snapshots[4][k]) for k in after)
    assert not all(torch.equal(snapshots[2][k], snapshots[3][k]) for k in after)
    assert not all(torch.equal(snapshots[4][k], after[k]) for k in after)
    assert history[-1]["loss"] < history[0]["loss"]


def test_static_loss_scale_stays_fixed_and_still_skips(tiny_corpus, tmp_path):
    from fitlm.config import MemoryConfig
    from fitlm.memory.loss_scale import LossScaler

    scaler = LossScaler(MemoryConfig(mixed_precision="O1", half_dtype="fp16", loss_scale=128.0), torch.device("cpu"))
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([128.0, 256.0, float("nan")])
    assert scaler.unscale_and_check([p], lambda t: t) is True
    scaler.update(True)
    assert scaler.scale == 128.0 and scaler.skipped_steps == 1
    p.grad = torch.tensor([128.0, 256.0, 384.0])
    assert scaler.unscale_and_check([p], lambda t: t) is False
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    bf16 = LossScaler(MemoryConfig(mixed_precision="O2", half_dtype="bf16"), torch.device("cpu"))
    assert not bf16.enabled and bf16.scale == 1.0


def peak_of(trainer, batch) -> int:
    def step():
        trainer.step.forward_backward([batch])
        trainer.step.optimizer_step()

    return peak_live_bytes(step, trainer.pm.modules, trainer.step.optimizer)["total"]


@pytest.mark.process
@pytest.mark.parametrize("memory", [{"recompute": "selective"}, {"recompute": "full", "recompute_every_n_layers": 2}])
def test_recompute_modes_give_equal_gradients_and_lower_the_peak(tiny_corpus, tmp_path, memory):
    plain = make_trainer(tiny_corpus, tmp_path / "a")
    other = make_trainer(tiny_corpus, tmp_path / "b", memory=memory)
    batch = next(iter(plain.loader))
    assert other.step.forward_backward([batch]).item() == pytest.approx(
        plain.step.forward_backward([batch]).item(), rel=1e-6
    )
    ga, gb = grads(plain.pm.model), grads(other.pm.model)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-7)
    full = make_trainer(tiny_corpus, tmp_path / "c", memory={"recompute": "full"})
    assert peak_of(full, batch) < peak_of(other, batch) < peak_of(plain, batch)


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


class NewTensorsOfShape(TorchDispatchMode):
    """Counts op outputs shaped like `like` (either orientation) that do not share its storage."""

    def __init__(self, like: torch.Tensor):
        super().__init__()
        self.shapes = {tuple(like.shape), tuple(like.shape[::-1])}
        self.ptr, self.count = like.untyped_storage().data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, torch.Tensor)
                and tuple(t.shape) in self.shapes
                and t.untyped_storage().data_ptr() != self.ptr
            ):
                self.count += 1
        return out


def test_chunked_loss_equals_plain_without_whole_logits(tiny_corpus, tmp_path):
    plain = make_trainer(tiny_corpus, tmp_path / "a")
    chunked = make_trainer(tiny_corpus, tmp_path / "b", memory={"loss_chunk_size": 32})
    batch = next(iter(plain.loader))
    batch["labels"][0, :10] = -100
    la = plain.step.forward_backward([batch])
    with LargestTensor() as seen:
        lb = chunked.step.forward_backward([batch])
    assert lb.item() == pytest.approx(la.item(), rel=1e-6)
    ga, gb = grads(plain.pm.model), grads(chunked.pm.model)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-6)
    vocab, tokens = 512, batch["input_ids"].numel()
    assert seen.largest < tokens * vocab  # never a whole [tokens, vocab] logits tensor
    assert seen.largest >= 32 * vocab  # but one chunk's


def test_chunked_loss_with_a_frozen_head_keeps_no_weight_gradient_buffer():
    """LoRA freezes the head: the hidden gradient is still exact, and no fp32 [V, C] buffer is made or kept."""
    torch.manual_seed(0)
    h = torch.randn(2, 24, 16, requires_grad=True)
    w = torch.randn(300, 16)  # frozen
    y = torch.randint(0, 300, (2, 24))
    cross_entropy_sum(h @ w.t(), y).backward()
    ref = h.grad.clone()
    h.grad = None
    with NewTensorsOfShape(w) as seen:
        out = chunked_cross_entropy_sum(h, w, y, 8)
        assert all(t.shape != w.shape for t in out.grad_fn.saved_tensors if t is not None)
        out.backward()
    assert seen.count == 0  # no [300, 16] gradient accumulator (views of w itself do not count)
    torch.testing.assert_close(h.grad, ref, rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_matches_in_bf16_and_without_grad():
    torch.manual_seed(0)
    h = torch.randn(3, 20, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    y = torch.randint(0, 40, (3, 20))
    ref = cross_entropy_sum(h @ w.to(torch.bfloat16).t(), y)
    ref.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    out = chunked_cross_entropy_sum(h, w, y, 7)
    out.backward()
    assert out.item() == pytest.approx(ref.item(), rel=1e-3)
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad.float(), gh.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, gw, rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        assert chunked_cross_entropy_sum(h, w, y, 7).item() == out.item()


@pytest.mark.process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunked_cross_entropy_equals_eager(dtype):
    torch.manual_seed(0)
    h = torch.randn(2, 30, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (2, 30))
    y[0, :5] = IGNORE_INDEX  # ignored rows inside a chunk
    grads = []
    for compiled in (False, True):
        out = chunked_cross_entropy_sum(h, w, y, 16, compiled=compiled)  # chunks of 16, 16, 16, 12 rows
        out.backward()
        grads.append((out.detach(), h.grad, w.grad))
        h.grad = w.grad = None
    for eager, fused in zip(*grads):
        torch.testing.assert_close(fused, eager, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


@pytest.mark.process
def test_compile_matches_eager(tiny_corpus, tmp_path, fp32_losses):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # no graph cached by an earlier test: this run must capture its own
    counters.clear()
    # One process: memory.compile takes the whole model, the chunked loss included (fitlm.memory.compile).
    compiled = make_trainer(tiny_corpus, tmp_path, train=SHORT, memory={"compile": True, "loss_chunk_size": 256})
    assert set(compiled.pm.model.state_dict()) == set(make_trainer(tiny_corpus, tmp_path / "b").pm.model.state_dict())
    assert losses(compiled) == pytest.approx(fp32_losses, rel=1e-5)
    # Compile really ran (eager equals eager otherwise), over the whole step's forward: one graph from the
    # token ids to the summed loss (per-block compile would capture a block graph and a loss graph), no
    # graph break, and one joint forward/backward compiled for it.
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["aot_autograd"]["total"] == 1, dict(counters["aot_autograd"])


def test_cpu_offload_equals_the_device_optimizer(tiny_corpus, tmp_path, fp32_losses):
    trainer = make_trainer(tiny_corpus, tmp_path, train=SHORT, memory={"cpu_offload": True})
    assert isinstance(trainer.step.optimizer, HostAdamW)
    assert losses(trainer) == fp32_losses  # same AdamW arithmetic, only where it runs differs
    assert not trainer.step.optimizer.state  # released before the final save
    trainer.step.forward_backward([next(iter(trainer.loader))])  # one more step fills them again
    trainer.step.optimizer_step()
    states = [v for s in trainer.step.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert states and all(v.device.type == "cpu" for v in states)
    # its state dict is keyed like torch's AdamW and loads back (checkpoints need that)
    sd = trainer.step.optimizer.state_dict()
    fresh = HostAdamW(trainer.step.optimizer.param_groups)
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["state"].keys() == sd["state"].keys()


def test_frozen_parameters_hold_no_grads_and_no_optimizer_state(tiny_corpus, tmp_path):
    trainer = make_trainer(tiny_corpus, tmp_path)
    model = trainer.pm.model
    frozen = [p for n, p in model.named_parameters() if n.startswith("model.layers.0.")]
    for p in frozen:
        p.requires_grad_(False)
    trainer.step.optimizer = build_optimizer([model], trainer.cfg.train)
    before = [p.clone() for p in frozen]
    trainer.step.forward_backward([next(iter(trainer.loader))])
    trainer.step.optimizer_step()
    assert all(p.grad is None for p in frozen)
    assert not any(id(p) in {id(q) for q in trainer.step.optimizer.state} for p in frozen)
    assert all(torch.equal(a, b) for a, b in zip(before, frozen))
    assert len(trainer.step.optimizer.state) == sum(1 for p in model.parameters() if p.requires_grad)
    # and memory measurement copes with frozen parameters (torch's tracker would hook their grads)
    peak = peak_of(trainer, next(iter(trainer.loader)))
    assert peak > sum(p.numel() * 4 for p in model.parameters())


def test_accumulation_note_and_sqrt_lr_scaling():
    cfg = TrainConfig(micro_batch_size=4, gradient_accumulation_steps=4, lr=1e-3, min_lr=1e-4, warmup_steps=100)
    same, note = scale_for_batch(cfg, data_parallel=2)
    assert same is cfg
    assert "global batch 32 sequences" in note and "4× the reference batch 8" in note
    assert "lr 0.002" in note and "train.lr_scaling=sqrt" in note
    scaled, note = scale_for_batch(cfg.model_copy(update={"lr_scaling": "sqrt"}), data_parallel=2)
    assert scaled.lr == pytest.approx(2e-3) and scaled.min_lr == pytest.approx(2e-4) and scaled.warmup_steps == 200
    tuned = cfg.model_copy(update={"lr_scaling": "sqrt", "lr_reference_batch": 32})
    assert scale_for_batch(tuned, data_parallel=2) == (tuned, None)
    assert scale_for_batch(TrainConfig(micro_batch_size=4), data_parallel=1)[1] is None


def test_out_of_memory_names_the_phase_and_the_remedies(tiny_corpus, tmp_path):
    from fitlm.train.oom import TrainingOutOfMemory

    trainer = make_trainer(tiny_corpus, tmp_path, train=SHORT)

    def out_of_memory(batches):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    trainer.step.forward_backward = out_of_memory
    with pytest.raises(TrainingOutOfMemory) as e:
        trainer.fit()
    message = str(e.value)
    assert "out of memory on rank 0 during forward/backward" in message
    assert "Remedies, by memory saved:" in message and "fitlm plan CONFIG --search" in message


@pytest.mark.parametrize("phase", ["data loading", "checkpoint save"])
def test_out_of_memory_in_host_phases_names_the_phase_and_its_advice(tiny_corpus, tmp_path, phase):
    from fitlm.train.oom import TrainingOutOfMemory

    trainer = make_trainer(tiny_corpus, tmp_path, train=SHORT)

    def out_of_memory(*args, **kwargs):
        raise MemoryError("host allocation failed")

    if phase == "data loading":
        trainer.loader = type("Exhausted", (), {"__iter__": lambda self: iter(out_of_memory, None)})()
    else:
        trainer.checkpointer.after_step = out_of_memory
    with pytest.raises(TrainingOutOfMemory) as e:
        trainer.fit()
    message = str(e.value)
    assert f"out of memory on rank 0 during {phase}" in message
    assert ("data.prefetch" if phase == "data loading" else "checkpoint.async_save") in message
    assert "docs/troubleshooting.md" in message


def _live_after_forward(recompute: str) -> tuple[float, torch.Tensor]:
    """Live bytes per parameter right after an O2 forward of 8 Linears, and the first layer's gradient."""
    from fitlm.config import MemoryConfig
    from fitlm.memory.precision import apply_precision
    from fitlm.memory.tracking import tracker_for

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    n = sum(p.numel() for p in model.parameters())
    apply_precision(model, MemoryConfig(mixed_precision="O2", recompute=recompute), sharded=False)
    x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
    tracker = tracker_for([model], None)
    with tracker:
        out = model(x).float().sum()
        live = sum(v for dev in tracker.get_tracker_snapshot().values() for k, v in dev.items() if k == "Total")
        out.backward()
    return live / n, model[0].weight.grad


def test_o2_casts_weights_again_in_backward_instead_of_keeping_them():
    recast, grad = _live_after_forward("none")
    kept, grad_kept = _live_after_forward("full")  # recompute owns saved tensors: casts are kept as before
    assert recast < 4.2 and kept > 5.8, (recast, kept)  # fp32 params (4 B) alone vs + half casts (2 B)
    assert torch.equal(grad, grad_kept)  # the same half weight, cast twice: identical gradients


@pytest.mark.process
def test_o2_training_is_unchanged_by_the_recast(tiny_corpus, tmp_path, monkeypatch):
    o2 = {"mixed_precision": "O2"}
    recast = losses(make_trainer(tiny_corpus, tmp_path / "a", train=SHORT, memory=o2))
    monkeypatch.setattr("fitlm.memory.precision.recasts_in_backward", lambda *a, **kw: False)
    assert losses(make_trainer(tiny_corpus, tmp_path / "b", train=SHORT, memory=o2)) == recast


def test_the_least_of_several_measured_steps_is_kept_with_its_own_module_rows():
    """gloo's worker thread can release a finished collective's buffer after the rank's next allocation
    (fitlm.memory.tracking.measured_steps_for): a step whose peak holds such a straggler must not be the one kept."""
    from fitlm.memory.tracking import measured_steps_for, track_step

    model = torch.nn.Linear(16, 16)
    straggler = iter([True, False, True])  # the first and last measured steps hold an extra 1 MiB at their peak

    def step():
        extra = torch.ones(262_144) if next(straggler, False) else None  # 1 MiB of fp32
        model(torch.ones(4, 16)).sum().backward()
        del extra

    def warmup():
        model(torch.ones(4, 16)).sum().backward()

    calls = iter([warmup, step, step, step])
    memory = track_step(lambda: next(calls)(), [model], None, warmup_steps=1, measured_steps=3)
    alone = track_step(warmup, [model], None, warmup_steps=1, measured_steps=1)
    assert memory.peak["total"] == alone.peak["total"] < 1 << 20, (memory.peak, alone.peak)
    assert memory.modules and all(row["forward_peak"] < 1 << 20 for row in memory.modules)
    assert measured_steps_for(True, torch.device("cpu")) == 3
    assert measured_steps_for(False, torch.device("cpu")) == 1
