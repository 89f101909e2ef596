"""Expert parallel trains an MoE model as one process does: `fitlm train` under torchrun (gloo), same data, seed and
global batch of 8 sequences; losses, gradient norms, eval loss and final weights equal (ep2, ep2 + ZeRO-3, ep2 with
recompute, ep2 on a tied model, dp4 with ep2 where two ranks hold each expert shard, and ep4, one expert a rank),
and beside ZeRO-1, context parallel and tensor parallel (tp2 without expert parallel too), with the auxiliary loss
on: there one row a micro batch, so the ranks' micro batches hold the one process's rows (transformers' aux loss
is a mean per micro batch, which a data split of larger micro batches changes; the other runs leave it off).
Then the all-to-all dispatcher at its edges, against the one-rank dispatch on the same tokens, and a checkpoint
written under ep2 (with ZeRO-1, with tensor parallel) resumed by one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.spawn import run_world
from tests.distributed.test_family_layouts import FAMILIES
from tests.distributed.test_layouts import assert_same_training, run_shared, selected

MOE = FAMILIES["qwen3_moe"]  # 4 experts of 2 per token, a dense block among the sparse ones, aux loss off
FAST_BIAS = {"router_bias_update_rate": 0.05}  # large enough for the bias to change routing within the run
HALF = {"micro_batch_size": 2, "gradient_accumulation_steps": 2}  # two data-parallel ranks
QUARTER = {"micro_batch_size": 1, "gradient_accumulation_steps": 2}  # four
REFERENCE = {"micro_batch_size": 4, "gradient_accumulation_steps": 2}
TWO_EXPERTS = {"num_experts": 2, "num_experts_per_tok": 1}  # one expert a rank under ep2, two replicas of it
# The auxiliary loss on: transformers' aux loss is a mean per micro batch, so the ranks' micro batches must hold the
# one process's rows. One row a micro batch gives that (the loader deals rank r the rows r, r + dp, ...).
AUX = {"num_layers": 3, "mlp_only_layers": [1], "router_aux_loss_coef": 0.1}  # sparse, dense, sparse
ROW = {"micro_batch_size": 1, "gradient_accumulation_steps": 4}  # two data-parallel ranks, one row a micro batch
ROW_REFERENCE = {"micro_batch_size": 1, "gradient_accumulation_steps": 8}
LAYOUTS = {  # name: (parallel, train, memory, model overrides)
    "ep2": ({"data_parallel": 2, "expert_parallel": 2}, HALF, {}, {}),
    "ep2-zero3": ({"data_parallel": 2, "zero_stage": 3, "expert_parallel": 2}, HALF, {}, {}),
    "ep2-recompute": ({"data_parallel": 2, "expert_parallel": 2}, HALF, {"recompute": "full"}, {}),
    "ep2-tied": ({"data_parallel": 2, "expert_parallel": 2}, HALF, {}, {"tie_embeddings": True}),
    # two replicas of each expert shard (edp 2): FSDP2 shards the experts over them too (ZeRO-2 and 3)
    "dp4-ep2-zero2": ({"data_parallel": 4, "zero_stage": 2, "expert_parallel": 2}, QUARTER, {}, {}),
    "dp4-ep2-zero3": ({"data_parallel": 4, "zero_stage": 3, "expert_parallel": 2}, QUARTER, {}, {}),
    # fewer experts than the ranks that shard them: FSDP2 splits each expert's rows (dim 1), not the experts
    "dp4-ep2-zero3-two-experts": (
        {"data_parallel": 4, "zero_stage": 3, "expert_parallel": 2},
        QUARTER,
        {},
        TWO_EXPERTS,
    ),
    "dp4-zero3-two-experts": ({"data_parallel": 4, "zero_stage": 3}, QUARTER, {}, TWO_EXPERTS),
    "dp4-ep4": ({"data_parallel": 4, "expert_parallel": 4}, QUARTER, {}, {}),
    # aux-free balancing: every rank moves the same bias from the step's global expert loads
    "ep2-aux-free": ({"data_parallel": 2, "expert_parallel": 2}, HALF, {}, {"moe_balance": "aux_free", **FAST_BIAS}),
    # LoRA on attention and on every expert (fitlm.finetune.expert_lora): the adapters split with their experts
    "ep2-lora-experts": ({"data_parallel": 2, "expert_parallel": 2}, HALF, {}, {}),
    # ZeRO-1: the dense optimizer states sharded over dp, each rank stepping its own experts (fitlm.step.optim)
    "ep2-zero1-aux": ({"data_parallel": 2, "expert_parallel": 2, "zero_stage": 1}, ROW, {}, AUX),
    "ep2-zero1-aux-tied": (
        {"data_parallel": 2, "expert_parallel": 2, "zero_stage": 1},
        ROW,
        {},
        {**AUX, "tie_embeddings": True},
    ),
    # context parallel: each cp rank routes its part of every sequence; expert gradients summed over edp x cp, the
    # aux loss over the cp ranks' tokens together (fitlm.step.router_balance)
    "ep2-cp2-aux": ({"data_parallel": 2, "expert_parallel": 2, "context_parallel": 2}, ROW, {}, AUX),
    "ep2-cp2-aux-tied": (
        {"data_parallel": 2, "expert_parallel": 2, "context_parallel": 2},
        ROW,
        {},
        {**AUX, "tie_embeddings": True},
    ),
    "cp2-aux": ({"context_parallel": 2}, ROW_REFERENCE, {}, AUX),
    # tensor parallel: attention and the dense block's MLP split, each expert split on its width, the router whole
    "tp2-aux": ({"tensor_parallel": 2}, ROW_REFERENCE, {}, AUX),
    "tp2-sp-aux-tied": (
        {"tensor_parallel": 2, "sequence_parallel": True},
        ROW_REFERENCE,
        {},
        {**AUX, "tie_embeddings": True},
    ),
    "tp2-aux-free": ({"tensor_parallel": 2}, REFERENCE, {}, {"moe_balance": "aux_free", **FAST_BIAS}),
    "ep2-tp2-aux": ({"data_parallel": 2, "expert_parallel": 2, "tensor_parallel": 2}, ROW, {}, AUX),
    "ep2-tp2-sp-aux-tied": (
        {"data_parallel": 2, "expert_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True},
        ROW,
        {},
        {**AUX, "tie_embeddings": True},
    ),
    # experts split three ways: over ep, inside over tp, and by FSDP2 over their 2 replicas (edp): a 3-D DTensor
    "dp4-ep2-zero3-tp2": (
        {"data_parallel": 4, "zero_stage": 3, "expert_parallel": 2, "tensor_parallel": 2},
        QUARTER,
        {},
        {},
    ),
    # LoRA on attention (split with its Linears) and on the experts (split over ep, and with them over tp)
    "ep2-tp2-lora-experts": ({"data_parallel": 2, "expert_parallel": 2, "tensor_parallel": 2}, HALF, {}, {}),
}
FAST = ("ep2", "ep2-zero3", "ep2-aux-free", "ep2-lora-experts", "ep2-zero1-aux", "ep2-cp2-aux")
LORA = {
    "method": "lora",
    "lora": {
        "r": 4,
        "alpha": 8,
        "target_modules": ["q_proj", "v_proj", "experts.gate_proj", "experts.up_proj", "experts.down_proj"],
    },
}
FINETUNE = {"ep2-lora-experts": LORA, "ep2-tp2-lora-experts": LORA}


def _reference_name(model: dict, layout: str = "") -> str:
    suffix = ("-lora" if layout in FINETUNE else "") + ("-aux" if model.get("router_aux_loss_coef") else "")
    return (
        "single"
        + ("-tied" if model.get("tie_embeddings") else "")
        + ("-aux-free" if "moe_balance" in model else "")
        + (f"-e{model['num_experts']}" if "num_experts" in model else "")
    ) + suffix


@pytest.fixture(scope="module")
def ep_runs(request, tiny_corpus, tmp_path_factory) -> dict[str, dict]:
    cases = {}
    for params in selected(request, "test_expert_parallel_equals_single_process"):
        parallel, train, memory, model = LAYOUTS[params["layout"]]
        tune = {"finetune": FINETUNE[params["layout"]]} if params["layout"] in FINETUNE else {}
        cases[_reference_name(model, params["layout"])] = {
            "parallel": {},
            "train": ROW_REFERENCE if train["micro_batch_size"] == 1 else REFERENCE,
            "model": {**MOE, **model},
            **tune,
        }
        cases[params["layout"]] = {
            "parallel": parallel,
            "train": train,
            "memory": memory,
            "model": {**MOE, **model},
            **tune,
        }
    root = tmp_path_factory.mktemp("ep")
    return {**run_shared(tiny_corpus, root, cases), "_root": root} if cases else {}


@pytest.mark.parametrize("layout", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS])
def test_expert_parallel_equals_single_process(ep_runs, layout):
    name = _reference_name(LAYOUTS[layout][3], layout)
    reference = ep_runs[name]
    assert reference["losses"][-1] < reference["losses"][0]  # it trained
    assert_same_training(ep_runs[layout], reference)
    if LAYOUTS[layout][3].get("router_aux_loss_coef"):  # the logged aux loss and expert load, step for step
        assert ep_runs[layout]["balance"] == pytest.approx(reference["balance"], rel=1e-4, abs=1e-6)
    if "moe_balance" in LAYOUTS[layout][3]:  # the bias step for step (every rank logs rank 0's, all equal)
        from tests.e2e.helpers import read_metrics

        def bias(run):
            return [r["router_bias_max"] for r in read_metrics(ep_runs["_root"] / run) if "router_bias_max" in r]

        assert bias(layout) == pytest.approx(bias(name), abs=1e-7) and max(bias(name)) > 0


# -- the dispatcher at its edges: 2 ranks, 4 experts (2 a rank), 2 slots a token ------------------------------
EDGES = {
    # tokens per rank, and where the router sends them: "random", or every slot of every token to experts [a, b]
    "random": ((7, 5), "random"),
    "one-expert-gets-all": ((6, 6), (0, 1)),  # experts 2 and 3 (all of rank 1's) get no token
    "remote-experts-only": ((4, 3), (2, 3)),  # every token leaves its rank, rank 0's experts idle
    "fewer-tokens-than-ranks": ((1, 0), "random"),  # rank 1 has no token at all
}


def _edge_worker(rank: int, world: int, port: int, cases, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fitlm.models.experts import GroupedExperts
    from fitlm.models.moe import dispatch
    from fitlm.parallel.expert_parallel import ExpertParallelDispatch

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    results = {}
    for name, (sizes, route) in cases.items():
        torch.manual_seed(0)
        full = GroupedExperts(4, 8, 6, init_std=0.5)
        xs = [torch.randn(n, 8) for n in sizes]  # every rank draws every rank's tokens: the reference needs them all
        if route == "random":
            tops = [torch.stack([torch.randperm(4)[:2] for _ in range(n)]) if n else torch.zeros(0, 2) for n in sizes]
        else:
            tops = [torch.tensor([list(route)] * n) for n in sizes]
        tops = [t.long().reshape(-1, 2) for t in tops]
        ws = [torch.rand(n, 2) for n in sizes]
        # reference: one rank, all tokens, the full experts
        x_all = torch.cat(xs).requires_grad_()
        ref, ref_counts = dispatch(x_all, torch.cat(ws), torch.cat(tops), full)
        ref.square().sum().backward()
        local = GroupedExperts(4, 8, 6, init_std=0.5)  # the same experts, this rank's two of them
        for pname, p in full.named_parameters():
            w = distribute_tensor(p.detach().clone(), mesh, [Shard(0)], src_data_rank=None)
            setattr(local, pname, torch.nn.Parameter(w))
        x = xs[rank].clone().requires_grad_()
        out, counts = ExpertParallelDispatch(mesh.get_group(), world)(x, ws[rank], tops[rank], local)
        out.square().sum().backward()
        start = sum(sizes[:rank])
        mine = slice(start, start + sizes[rank])
        grad_w = local.gate_proj.grad.full_tensor()
        results[name] = {
            "out": torch.allclose(out, ref[mine], atol=1e-6, rtol=1e-5),
            "x_grad": torch.allclose(x.grad, x_all.grad[mine], atol=1e-6, rtol=1e-5),
            # every rank's tokens reach the expert: the sum over ranks of the routed counts is one process's
            "counts": counts.tolist(),
            "ref_counts": ref_counts.tolist(),
            "weight_grad": torch.allclose(grad_w, full.gate_proj.grad, atol=1e-5, rtol=1e-4),
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_dispatcher_edges_equal_one_rank(tmp_path):
    ranks = run_world(_edge_worker, __name__, 2, EDGES, tmp_path, timeout=300, what="expert-parallel dispatcher")
    for name in EDGES:
        for rank, res in enumerate(ranks):
            r = res[name]
            assert r["out"] and r["x_grad"], f"{name}: rank {rank}'s outputs or input gradients differ"
            assert r["weight_grad"], f"{name}: rank {rank}'s expert gradients differ from one rank's"
        summed = [a + b for a, b in zip(ranks[0][name]["counts"], ranks[1][name]["counts"])]
        assert summed == ranks[0][name]["ref_counts"], name


def _capacity_worker(rank: int, world: int, port: int, factors, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fitlm.models.experts import GroupedExperts
    from fitlm.models.moe import dispatch, kept_slots
    from fitlm.parallel.expert_parallel import ExpertParallelDispatch

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    results = {}
    for cf in factors:
        torch.manual_seed(0)
        full = GroupedExperts(4, 8, 6, init_std=0.5)
        sizes = (9, 6)
        xs = [torch.randn(n, 8) for n in sizes]
        # skewed: expert 0 in most tokens' top-2, so a capacity drops some of its slots
        tops = [torch.stack([torch.tensor([0, int(torch.randint(1, 4, ()))]) for _ in range(n)]) for n in sizes]
        ws = [torch.rand(n, 2) for n in sizes]
        x_all, top_all = torch.cat(xs).requires_grad_(), torch.cat(tops)  # one process: the ranks' tokens in order
        counts_all = torch.bincount(top_all.reshape(-1), minlength=4)
        ref_kept = kept_slots(counts_all, counts_all.tolist(), cf)
        ref, _ = dispatch(x_all, torch.cat(ws), top_all, full, ref_kept)
        ref.square().sum().backward()
        local = GroupedExperts(4, 8, 6, init_std=0.5)
        for pname, p in full.named_parameters():
            setattr(local, pname, torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])))
        ep = ExpertParallelDispatch(mesh.get_group(), world)
        x = xs[rank].clone().requires_grad_()
        counts = torch.bincount(tops[rank].reshape(-1), minlength=4)
        kept = ep.kept_slots(counts, counts.tolist(), cf)
        out, _ = ep(x, ws[rank], tops[rank], local, kept)
        out.square().sum().backward()
        start = sum(sizes[:rank])
        mine = slice(start, start + sizes[rank])
        results[str(cf)] = {
            "out": torch.allclose(out, ref[mine], atol=1e-6, rtol=1e-5),
            "x_grad": torch.allclose(x.grad, x_all.grad[mine], atol=1e-6, rtol=1e-5),
            "weight_grad": torch.allclose(local.gate_proj.grad.full_tensor(), full.gate_proj.grad, atol=1e-5),
            "dropped": int(counts.sum()) - sum(kept),
            "ref_dropped": int(counts_all.sum()) - sum(ref_kept),
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_capacity_under_expert_parallel_equals_one_process(tmp_path):
    """model.capacity_factor under ep2: each expert keeps its first C of the slots the ep group sends it, C from the
    group's tokens, earlier ranks' tokens first: what one process keeps of the ranks' tokens concatenated."""
    factors = (0.5, 1.0, 8.0)
    ranks = run_world(_capacity_worker, __name__, 2, factors, tmp_path, timeout=300, what="capacity dispatcher")
    for cf in map(str, factors):
        for rank, res in enumerate(ranks):
            r = res[cf]
            assert r["out"] and r["x_grad"] and r["weight_grad"], f"capacity {cf}: rank {rank} differs"
        assert ranks[0][cf]["dropped"] + ranks[1][cf]["dropped"] == ranks[0][cf]["ref_dropped"], cf
    assert ranks[0]["0.5"]["ref_dropped"] > 0 and ranks[0]["8.0"]["ref_dropped"] == 0


WRITERS = {  # layout a checkpoint is written under: (parallel, per-rank batch)
    "ep2": ({"data_parallel": 2, "expert_parallel": 2}, HALF),
    # the experts DTensors over the 2-D (edp, ep) mesh: each rank holds one of the 4 experts
    "dp4-ep2-zero3": ({"data_parallel": 4, "zero_stage": 3, "expert_parallel": 2}, QUARTER),
    # ZeRO-1: each rank writes the dense states it owns and its experts' (fitlm.step.optim)
    "ep2-zero1": ({"data_parallel": 2, "expert_parallel": 2, "zero_stage": 1}, HALF),
    # tensor parallel: attention as DTensors on "tp", the routed blocks' plain tensors beside them
    "ep2-tp2": ({"data_parallel": 2, "expert_parallel": 2, "tensor_parallel": 2}, HALF),
}


@pytest.mark.parametrize("writer", [pytest.param(w, marks=() if w == "ep2" else pytest.mark.slow) for w in WRITERS])
def test_checkpoint_from_ep2_resumes_in_one_process(tiny_corpus, tmp_path, writer):
    """A checkpoint written under dp2 x ep2 (experts as DTensors split over the ep ranks), under dp4 x ep2 with
    ZeRO-3 (split over ep, then sharded over their replicas), with ZeRO-1 or with tensor parallel, resumes in one
    process, which then trains on as the uninterrupted one-process run does."""
    from tests.e2e.helpers import fitlm, read_metrics, tiny_config, write_config

    def train(name, parallel, batch, checkpoint):
        cfg = tiny_config(
            tiny_corpus,
            tmp_path / name,
            model={**MOE, "tie_embeddings": False},
            parallel=parallel,
            checkpoint=checkpoint,
            train={"max_steps": 4, "eval_interval": 0, "eps": 1e-6, **batch},
        )
        proc = fitlm("train", write_config(tmp_path / f"{name}.yaml", cfg), "--json")
        assert proc.returncode == 0, proc.stderr[-4000:]
        return {r["step"]: r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r}

    ref = train("single", {}, REFERENCE, {"interval": 0})
    parallel, batch = WRITERS[writer]
    written = train(writer, parallel, batch, {"interval": 2})
    assert [written[s] for s in (1, 2)] == pytest.approx([ref[s] for s in (1, 2)], rel=2e-5, abs=1e-5)
    resumed = train("resumed", {}, REFERENCE, {"resume": str(tmp_path / writer / "checkpoints" / "step_00000002")})
    assert sorted(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == pytest.approx([ref[s] for s in (3, 4)], rel=2e-5, abs=1e-5)
