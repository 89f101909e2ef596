"""Host memory of ZeRO-3 over gloo (issue #17): what a CPU rank holds besides its shard.

On a CPU device the device is the host, so every gathered unit is host memory. One 2-rank gloo world checks:
- O2 LoRA stores the frozen base in half under ZeRO-3 too, and trains bit-identically to the fp32-stored base
  (FSDP2 casts to the half param_dtype before gathering either way);
- every FSDP2 unit gathers in place (`InPlaceAllGather`), and the frozen embedding and head are no units (streamed);
- the final save's gather of a sharded weight holds its output once (gloo's all-gather holds it twice).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from fitlm.parallel.gather import handed_over
from tests.distributed.spawn import run_world
from tests.e2e.helpers import tiny_config

MiB = 2**20
GATHERED = 64 * MiB  # above glibc's largest mmap threshold (32 MiB): its pages come and go with the tensor


def _o2_lora_run(cfg: dict, frozen_in_half_rule) -> dict:
    import fitlm.finetune.apply as apply_mod
    from fitlm.config import validate_dict
    from fitlm.parallel.data_parallel import InPlaceAllGather
    from fitlm.train.trainer import Trainer

    rule, apply_mod.stores_frozen_in_half = (
        apply_mod.stores_frozen_in_half,
        frozen_in_half_rule or apply_mod.stores_frozen_in_half,
    )
    try:
        trainer = Trainer(validate_dict(cfg))
    finally:
        apply_mod.stores_frozen_in_half = rule
    model = trainer.pm.modules[0]
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    groups = [g for m in units for g in m._get_fsdp_state()._fsdp_param_groups]
    batches = iter(trainer.loader)
    losses = [trainer.train_step(step, batches).loss.item() for step in (1, 2)]
    trainer.release_lock()
    return {
        "losses": losses,
        "frozen": sorted({str(p.dtype) for n, p in model.named_parameters() if not p.requires_grad}),
        "trained": sorted({str(p.dtype) for n, p in model.named_parameters() if p.requires_grad}),
        "in_place": all(isinstance(g._all_gather_comm, InPlaceAllGather) for g in groups)
        and len(groups) > 2,  # the blocks and the root
        # The frozen tables are no FSDP2 units: their rows stay sharded and are streamed (fitlm.parallel.streamed_vocab).
        "tables_streamed": [
            not hasattr(m, "_get_fsdp_state") and str(m.weight.placements) == "(Shard(dim=0),)"
            for m in (model.model.embed_tokens, model.lm_head)
        ],
    }


def _save_gather_growth() -> tuple[int, bool]:
    """VmHWM growth while `fitlm.parallel.gather._full` gathers a Shard(0) DTensor of GATHERED bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fitlm.hardware import host_peak_rss, reset_host_peak
    from fitlm.parallel.gather import _full

    mesh = init_device_mesh("cpu", (2,))
    local = torch.full((GATHERED // 4 // 2,), float(dist.get_rank()))
    t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    dist.barrier()
    reset_host_peak()
    before = host_peak_rss()
    full = _full(t)
    growth = host_peak_rss() - before
    n = local.numel()
    return growth, bool((full[:n] == 0).all() and (full[n:] == 1).all())


def worker(rank: int, world: int, port: int, cfgs: dict, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    from fitlm.parallel.mesh import exit_process

    dist.init_process_group("gloo")
    # The rule before ZeRO-2/3 stored the frozen base in half: fp32 under FSDP2.
    fp32_base = lambda cfg: cfg.memory.mixed_precision == "O2" and not cfg.parallel.dims.fsdp_sharded  # noqa: E731
    out = {"half": _o2_lora_run(cfgs["half"], None), "fp32": _o2_lora_run(cfgs["fp32"], fp32_base)}
    out["save_growth"], out["save_values"] = _save_gather_growth()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    exit_process(0)


def test_zero3_lora_o2_half_base_in_place_gathers(tiny_corpus, tmp_path):
    cfgs = {
        name: tiny_config(
            tiny_corpus,
            tmp_path / name,
            parallel={"data_parallel": 2, "zero_stage": 3},
            memory={"mixed_precision": "O2"},
            finetune={"method": "lora", "lora": {"r": 4, "alpha": 8, "target_modules": ["all-linear"]}},
            train={
                "micro_batch_size": 2,
                "gradient_accumulation_steps": 1,
                "max_steps": 2,
                "eval_interval": 0,
                "observe": {"tensorboard": False},
            },
        )
        for name in ("half", "fp32")
    }
    ranks = run_world(worker, __name__, 2, cfgs, tmp_path, timeout=240, what="ZeRO-3 host memory")
    for r in ranks:
        half, fp32 = r["half"], r["fp32"]
        assert half["frozen"] == ["torch.bfloat16"] and fp32["frozen"] == ["torch.float32"]
        assert half["trained"] == fp32["trained"] == ["torch.float32"]  # the adapters keep fp32 masters
        assert half["losses"] == fp32["losses"]  # bit-equal: the gathers carry the same half values
        assert half["in_place"]
        assert half["tables_streamed"] == [True, True]
        # One output's pages (plus the rank's own slice copied in); gloo's all-gather held a second, flat one.
        assert r["save_values"]
        assert r["save_growth"] < 1.5 * GATHERED, f"gathering {GATHERED // MiB} MiB grew {r['save_growth'] // MiB} MiB"


def test_handed_over_frees_each_group_when_the_next_is_asked_for():
    groups = handed_over(iter([{"a": torch.zeros(2)}, None, {"b": torch.ones(2)}]))
    first = next(groups)
    assert list(first) == ["a"]
    assert next(groups) is None and first == {}  # the consumer's reference no longer keeps the block
    last = next(groups)
    assert list(last) == ["b"]
