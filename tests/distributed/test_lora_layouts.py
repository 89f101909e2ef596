"""LoRA and layer freezing under tensor and pipeline parallel train the same model as one process.

Each layout runs the real Trainer (meta build, loader, parallelize, steps, the final save with its merge and
PEFT adapter export) inside one gloo world; its losses, gradient norms, merged model and adapter are
compared with the same config in a one-rank world. LoRA targets every linear, so both the column-parallel
(q/k/v, gate/up: A replicated, B sharded) and the row-parallel (o, down: A sharded, B replicated) adapters
are exercised."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.spawn import run_world
from tests.e2e.helpers import tiny_config

STEPS = 3
# The one-process runs the layouts are held against: name -> (finetune block, model block).
REFERENCES = {
    "lora": ({"method": "lora", "lora": {"r": 4, "alpha": 8.0, "target_modules": ["all-linear"]}}, {}),
    "freeze": ({"method": "freeze", "freeze_layers": 0.5}, {}),  # block 0 frozen
    # tied embeddings (the shipped configs' default): the head is the embedding, on the first and last stage
    "lora-tied": (
        {"method": "lora", "lora": {"r": 4, "alpha": 8.0, "target_modules": ["all-linear"]}},
        {"tie_embeddings": True},
    ),
    "freeze-tied": ({"method": "freeze", "freeze_layers": 0.5}, {"tie_embeddings": True}),
    "freeze-embeddings": ({"method": "freeze", "freeze_layers": 0.5, "freeze_embeddings": True}, {}),
    # Phi-3 under tensor parallel: the fused projections are split, so adapters go on o_proj and down_proj.
    "lora-phi3": (
        {"method": "lora", "lora": {"r": 4, "alpha": 8.0, "target_modules": ["o_proj", "down_proj"]}},
        {"arch": "phi3"},
    ),
}
PP2 = {"pipeline_parallel": 2, "micro_batch_num": 2}
REPLICA = {"micro_batch_size": 4, "gradient_accumulation_steps": 2}  # the reference's batch
HALF = {"micro_batch_size": 2, "gradient_accumulation_steps": 2}  # two data-parallel replicas, same global batch
# layout name -> (reference, parallel block, train block)
FAST = {
    "tp2-lora": ("lora", {"tensor_parallel": 2}, REPLICA),
    "pp2-lora": ("lora", PP2, REPLICA),
    # sequence parallel's norms are new Parameters: the frozen block's must stay frozen
    "tp2-sp-freeze": ("freeze", {"tensor_parallel": 2, "sequence_parallel": True}, REPLICA),
    "pp2-freeze": ("freeze", PP2, REPLICA),
    "pp2-lora-tied": ("lora-tied", PP2, REPLICA),
}
SLOW_WORLDS = {
    2: {
        "tp2-freeze-embeddings": ("freeze-embeddings", {"tensor_parallel": 2}, REPLICA),
        "tp2-sp-lora": ("lora", {"tensor_parallel": 2, "sequence_parallel": True}, REPLICA),
        "tp2-lora-phi3": ("lora-phi3", {"tensor_parallel": 2}, REPLICA),
    },
    4: {
        "dp2-tp2-lora": ("lora", {"data_parallel": 2, "tensor_parallel": 2}, HALF),
        "dp2-zero3-tp2-lora": ("lora", {"data_parallel": 2, "tensor_parallel": 2, "zero_stage": 3}, HALF),
        "tp2-pp2-lora": ("lora", {"tensor_parallel": 2, **PP2}, REPLICA),
        "tp2-pp2-lora-tied": ("lora-tied", {"tensor_parallel": 2, **PP2}, REPLICA),
        "tp2-pp2-freeze-tied": ("freeze-tied", {"tensor_parallel": 2, **PP2}, REPLICA),
    },
}


def train_and_save(cfg: dict) -> dict:
    """STEPS steps of the real Trainer, then its final save (collective: the merge and the PEFT export of the
    gathered blocks on rank 0)."""
    from fitlm.run_config import run_config
    from fitlm.train.trainer import Trainer

    trainer = Trainer(run_config(cfg)[0])  # as the CLI reads it (a model section that is init_from alone too)
    batches = iter(trainer.loader)
    outs = (trainer.train_step(step, batches) for step in range(1, STEPS + 1))  # read as each step ends
    losses, norms = zip(*[(out.loss.item(), out.grad_norm.item()) for out in outs])
    trainer.save_final_model()
    trainer.release_lock()
    return {
        "losses": list(losses),
        "grad_norms": list(norms),
        "placements": adapter_placements(trainer.pm.modules),
        "nf4": nf4_local_bytes(trainer.pm.modules),
    }


def nf4_local_bytes(modules: list) -> dict[str, int]:
    """Parameter name -> bytes this rank holds of each QLoRA NF4 weight (its shard's codes, scales and factors,
    and the code table and mean every shard keeps), as torchao stores them."""
    from torch.distributed.tensor import DTensor

    from fitlm.memory.nf4 import is_nf4

    parts = ("quantized_data", "quantized_scalers", "quantization_factor", "nf4", "scaler_mean")
    out = {}
    for module in modules:
        for name, p in module.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if is_nf4(local):
                out[name] = sum(getattr(local, part).nbytes for part in parts)
    return out


def worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # 2 cores, up to 4 processes
    import torch.distributed as dist

    from fitlm.parallel.mesh import exit_process

    results = {name: train_and_save(cfg) for name, cfg in cases.items()}
    if dist.is_initialized():  # the one-rank reference runs without a process group
        dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    exit_process(0)  # not a normal exit: see fitlm.parallel.mesh.exit_process


def adapter_placements(modules: list) -> dict[str, str]:
    """`q_proj.lora_A` (leaf Linear + adapter part) -> its placement on the tensor-parallel mesh dim; every
    block shards alike, so one entry per leaf."""
    from torch.distributed.tensor import DTensor

    out = {}
    for module in modules:
        for name, p in module.named_parameters():
            names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
            if ".lora_" in name and isinstance(p, DTensor) and (p.device_mesh.ndim == 1 or "tp" in names):
                # (an expert adapter over (edp, ep) has no tensor-parallel placement)
                out[".".join(name.split(".")[-3:-1])] = str(
                    p.placements[names.index("tp")] if p.device_mesh.ndim > 1 else p.placements[0]
                )
    return out


def config(corpus: dict, root: Path, name: str, reference: str, parallel: dict, train: dict) -> dict:
    finetune, model = REFERENCES[reference]
    return tiny_config(
        corpus,
        root / name,
        parallel=parallel,
        finetune=finetune,
        model={"tie_embeddings": False, **model},
        train={"max_steps": STEPS, "eval_interval": 0, "observe": {"tensorboard": False}, **train},
    )


def saved(run: Path) -> dict:
    out = {"model": load_file(str(run / "model" / "model.safetensors"))}
    if (run / "adapter").is_dir():
        out["adapter"] = load_file(str(run / "adapter" / "adapter_model.safetensors"))
        out["adapter_config"] = json.loads((run / "adapter" / "adapter_config.json").read_text())
    return out


def assert_same_run(got: dict, want: dict, got_dir: Path, want_dir: Path) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=2e-5, abs=1e-5)
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4, abs=1e-5)
    a, b = saved(got_dir), saved(want_dir)
    assert a.keys() == b.keys()
    for part in ("model", "adapter"):
        if part not in b:
            continue
        assert a[part].keys() == b[part].keys(), part
        # Adam amplifies fp32 reduction-order noise: an adapter entry whose gradient is near 0 moves by up to
        # lr (1e-2) per step whatever the noise's size, so adapters are held to 5% of one step.
        atol = 5e-4 if part == "adapter" else 1e-4
        for name, tensor in b[part].items():
            torch.testing.assert_close(a[part][name], tensor, rtol=1e-4, atol=atol, msg=f"{part}: {name}")
    if "adapter_config" in b:  # the PEFT adapter is the one-process run's: same modules, rank and scaling
        assert a["adapter_config"] == b["adapter_config"]


def assert_sharded_like_the_base(placements: dict[str, str]) -> None:
    """Column-parallel bases: A replicated, B sharded on its output dim; row-parallel: A sharded on its input dim."""
    want = {"q_proj": ("R", "S(0)"), "gate_proj": ("R", "S(0)"), "o_proj": ("S(1)", "R"), "down_proj": ("S(1)", "R")}
    for linear, (a, b) in want.items():
        if f"{linear}.lora_A" in placements:
            assert (placements[f"{linear}.lora_A"], placements[f"{linear}.lora_B"]) == (a, b), linear
    assert any(key.startswith(("o_proj", "down_proj")) for key in placements), placements


def check_layouts(corpus: dict, tmp_path: Path, world: int, cases: dict) -> None:
    layouts = {name: config(corpus, tmp_path, name, *case) for name, case in cases.items()}
    refs = {ref: config(corpus, tmp_path, ref, ref, {}, REPLICA) for ref in {case[0] for case in cases.values()}}
    single = run_world(worker, __name__, 1, refs, tmp_path, 300, "one-process LoRA/freeze references")[0]
    ranks = run_world(worker, __name__, world, layouts, tmp_path, 420, f"LoRA/freeze layouts ({world} ranks)")
    for name, (ref, parallel, _) in cases.items():
        for other in ranks[1:]:  # every rank logged the same step losses
            assert other[name]["losses"] == ranks[0][name]["losses"], name
        assert_same_run(ranks[0][name], single[ref], tmp_path / name, tmp_path / ref)
        if parallel.get("tensor_parallel", 1) > 1 and ref.startswith("lora"):
            assert_sharded_like_the_base(ranks[0][name]["placements"])


def test_lora_and_freeze_under_tensor_and_pipeline_parallel_equal_one_process(tiny_corpus, tmp_path):
    check_layouts(tiny_corpus, tmp_path, 2, FAST)


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW_WORLDS))
def test_more_lora_and_freeze_layouts_equal_one_process(tiny_corpus, tmp_path, world):
    check_layouts(tiny_corpus, tmp_path, world, SLOW_WORLDS[world])


def collectives_worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    """One adapted Linear [6, 8] (r 2) per style on a 2-rank mesh: the forward's collectives and its output."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    from fitlm.finetune.lora import add_lora
    from fitlm.parallel.lora_parallel import LoraColwiseParallel, LoraRowwiseParallel
    from fitlm.parallel.mesh import exit_process

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, style in (("colwise", LoraColwiseParallel()), ("rowwise", LoraRowwiseParallel())):
        torch.manual_seed(0)
        linear = torch.nn.Linear(8, 6, bias=False)
        add_lora(linear, 2, 1.0, 0.0)
        torch.nn.init.normal_(linear.lora_B.weight)  # a trained adapter: B is no longer zero
        x = torch.randn(3, 8)
        want = linear(x)  # [3, 6]
        parallelize_module(linear, mesh, style)
        with CommDebugMode() as comm:
            got = linear(x.chunk(world, -1)[rank] if name == "rowwise" else x)  # row-parallel reads its input shard
        shard = want if name == "rowwise" else want.chunk(world, -1)[rank]  # column-parallel gives its out shard
        results[name] = {
            "collectives": {str(op): n for op, n in comm.get_comm_counts().items()},
            "equal": torch.allclose(got, shard, atol=1e-6),
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    exit_process(0)


def test_adapters_add_no_collective_to_their_base_linear(tmp_path):
    """Column-parallel: none in forward; row-parallel: the base's one all-reduce carries the adapter's partial sums."""
    for rank in run_world(collectives_worker, __name__, 2, {}, tmp_path, 120, "LoRA collective count"):
        assert rank["colwise"] == {"collectives": {}, "equal": True}
        assert rank["rowwise"]["equal"]
        assert list(rank["rowwise"]["collectives"].values()) == [1], rank["rowwise"]
        assert "all_reduce" in next(iter(rank["rowwise"]["collectives"]))
