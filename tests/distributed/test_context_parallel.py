"""Context parallel trains the same model as one process: cp2, dp2 x cp2 and tp2 x cp2 with document masks on
and off, and each under ZeRO-3 (FSDP2 over the dp x cp ranks) with them on. Each layout runs the real Trainer (meta build, loader, parallelize, step, evaluation)
inside a gloo world and its per-step losses, gradient norms, evaluation loss and final weights are compared with
`fitlm train` of the same config in one process. Unit checks of the split and the mask come first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fitlm.models.layers import band_mask, document_causal_mask
from fitlm.parallel.context_parallel import SequenceShard, zigzag_index
from tests.distributed.spawn import run_world
from tests.distributed.test_layouts import REFERENCE, STEPS, assert_same_training, layout_config

HALF = {"micro_batch_size": 2, "gradient_accumulation_steps": 2}  # two data-parallel replicas
BOTH, ON = (False, True), (True,)  # data.document_mask values a layout runs with
LAYOUTS = {  # world size -> (name, parallel, train, document masks)
    2: [
        ("cp2", {"context_parallel": 2}, REFERENCE, BOTH),
        ("cp2-zero3", {"context_parallel": 2, "zero_stage": 3}, REFERENCE, ON),
    ],
    4: [
        ("dp2-cp2", {"data_parallel": 2, "context_parallel": 2}, HALF, BOTH),
        ("dp2-cp2-zero3", {"data_parallel": 2, "context_parallel": 2, "zero_stage": 3}, HALF, ON),
        ("tp2-cp2", {"tensor_parallel": 2, "context_parallel": 2}, REFERENCE, BOTH),
        # FSDP2 over the flattened dp x cp ranks beside tensor parallel's DTensors (2-D sharding)
        ("tp2-cp2-zero3", {"tensor_parallel": 2, "context_parallel": 2, "zero_stage": 3}, REFERENCE, ON),
    ],
}


def test_head_tail_chunks_partition_the_sequence_and_balance_causal_work():
    t, cp = 24, 3
    parts = [zigzag_index(t, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(t))
    work = [int((p + 1).sum()) for p in parts]  # keys read by each rank's queries under causal attention
    assert len(set(work)) == 1, work  # 100 each; three contiguous pieces would read 36, 100 and 164
    with pytest.raises(ValueError, match="multiple of 6"):
        zigzag_index(20, cp, 0)


def test_a_sequence_length_the_chunks_cannot_split_is_refused_naming_the_key():
    from fitlm.config import ConfigError, validate_dict

    cfg = {
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 128, "max_seq_len": 64},
        "data": {"train": "unused", "seq_length": 30},
        "parallel": {"context_parallel": 2},
    }
    with pytest.raises(ConfigError, match=r"data.seq_length: 30 .* multiple of 4"):
        validate_dict(cfg)


@pytest.mark.parametrize("window", [None, 5])
def test_shard_mask_is_the_full_mask_at_the_ranks_rows_and_gathered_keys(window):
    t, cp = 16, 2
    doc = torch.tensor([[0] * 3 + [1] * 9 + [2] * 4, [0] * 16])
    full = document_causal_mask(doc)[:, 0] & band_mask(t, t, 0, window, doc.device)  # [B,T,T]
    key_index = torch.cat([zigzag_index(t, cp, r) for r in range(cp)])
    for rank in range(cp):
        index = zigzag_index(t, cp, rank)
        got = SequenceShard(index, key_index, doc).mask(window)[:, 0]  # [B,T/C,T] over gathered keys
        assert torch.equal(got, full[:, index][:, :, key_index])
        plain = SequenceShard(index, key_index, None).mask(window)  # [T/C,T]
        assert torch.equal(plain, band_mask(t, t, 0, window, doc.device)[index][:, key_index])


# Every family's attention under context parallel: sliding windows (Gemma 3: a second RoPE table; Phi-3),
# soft-capped eager attention (Gemma 2), q/k norms and a free head_dim (Qwen3), learned positions (GPT-2).
FAMILIES = {
    "qwen3": {"arch": "qwen3", "head_dim": 24},
    "gemma3": {
        "arch": "gemma3",
        "head_dim": 24,
        "sliding_window": 6,
        "rope_local_theta": 1e4,
        "layer_types": ["sliding", "full"],
    },
    "gemma2": {
        "arch": "gemma2",
        "head_dim": 24,
        "sliding_window": 6,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcap": 50.0,
        "final_logit_softcap": 30.0,
    },
    "phi3": {"arch": "phi3", "sliding_window": 10},
    "gpt2": {"arch": "gpt2", "num_kv_heads": None},
}


def family_worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    """One forward and backward of each family's tiny model, split over the cp group and whole (in every rank):
    the summed loss and every gradient (summed over the group) must agree."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import copy
    from datetime import timedelta

    import torch.distributed as dist

    from fitlm.config import ModelConfig
    from fitlm.models.layers import document_position_ids
    from fitlm.models.loss import cross_entropy_sum
    from fitlm.parallel.context_parallel import ContextParallel, apply_context_parallel
    from fitlm.parallel.mesh import exit_process
    from fitlm.registry import build_model

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))  # [B, T]
    labels = torch.roll(ids, -1, 1)
    doc = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 24])
    results = {}
    for name, overrides in cases.items():
        torch.manual_seed(0)
        ref = build_model(
            ModelConfig(
                **{
                    "hidden_size": 64,
                    "num_layers": 2,
                    "num_heads": 4,
                    "num_kv_heads": 2,
                    "intermediate_size": 128,
                    "vocab_size": 128,
                    "max_seq_len": 32,
                    **overrides,
                }
            )
        )
        model = copy.deepcopy(ref)
        cp = ContextParallel(dist.group.WORLD, world, rank)
        apply_context_parallel(model, cp)
        for mask in (False, True):
            ref.zero_grad(), model.zero_grad()
            kw = {"document_ids": doc} if mask else {}
            want = cross_entropy_sum(ref(ids, **kw), labels)
            want.backward()
            batch = {
                "input_ids": ids,
                "labels": labels,
                "document_ids": doc,
                "position_ids": document_position_ids(doc),
            }
            local_ids, local_labels, local, shard = cp.split(batch, mask, torch.device("cpu"))
            with cp.using(shard):
                got = cross_entropy_sum(model(local_ids, **local), local_labels)
                got.backward()
            total = got.detach().clone()
            dist.all_reduce(total)
            grads = {}
            for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
                dist.all_reduce(p.grad)
                # relative to rtol 1e-4 plus atol 1e-6: the key biases' true gradient is 0 (softmax ignores a
                # constant added to every key's score), what both runs get is rounding noise
                grads[pname] = (p.grad - q.grad).abs().max().item() / (1e-6 + 1e-4 * q.grad.abs().max().item())
            worst = max(grads, key=grads.get)
            results[f"{name}-dm{int(mask)}"] = {
                "want": want.item(),
                "got": total.item(),
                "grad_rel": grads[worst],
                "worst": worst,
            }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    exit_process(0)


def test_every_family_attends_the_same_under_context_parallel(tmp_path):
    (got, *_) = run_world(family_worker, __name__, 2, FAMILIES, tmp_path, 240, "context-parallel family workers")
    assert len(got) == 2 * len(FAMILIES)
    for key, r in got.items():
        assert r["got"] == pytest.approx(r["want"], rel=1e-5), key
        assert r["grad_rel"] <= 1.0, (key, r)


def worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # 2 cores, up to 4 processes
    import torch.distributed as dist

    from fitlm.config import validate_dict
    from fitlm.parallel.mesh import exit_process
    from fitlm.train.trainer import Trainer

    results = {}
    for name, cfg in cases.items():
        trainer = Trainer(validate_dict(cfg))
        batches, losses, norms = iter(trainer.loader), [], []
        for step in range(1, STEPS + 1):
            out = trainer.train_step(step, batches)
            losses.append(out.loss.item())
            norms.append(out.grad_norm.item())
        eval_loss = trainer.evaluate()
        weights = trainer.pm.full_state_dict()  # collective; on rank 0 only
        if weights is not None:
            torch.save(weights, Path(out_dir) / f"{name}.pt")
        trainer.release_lock()
        results[name] = {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss}
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    exit_process(0)  # not a normal exit: see fitlm.parallel.mesh.exit_process


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_context_parallel_layouts_equal_single_process(tiny_corpus, tmp_path, single_process_reference, world):
    cases = {}
    for name, parallel, train, masks in LAYOUTS[world]:
        for mask in masks:
            cases[f"{name}-dm{int(mask)}"] = layout_config(  # the reference's config, as the layout tests
                tiny_corpus,
                tmp_path,
                f"{name}-dm{int(mask)}",
                parallel,
                {"observe": {"tensorboard": False}, **train},
                data={"document_mask": mask},
            )
    ranks = run_world(worker, __name__, world, cases, tmp_path, 420, f"context-parallel workers ({world} ranks)")
    for key in cases:
        got = dict(ranks[0][key], weights=torch.load(tmp_path / f"{key}.pt"))
        for other in ranks[1:]:  # every rank logged the same step losses
            assert other[key]["losses"] == got["losses"], key
        assert_same_training(got, single_process_reference(key.endswith("dm1")))
