"""Pipeline parallel on CPU/gloo: every schedule reproduces the single-process run (loss, grad norm, weights).

Each world is spawned once per module (spawning costs seconds); its workers run all cases and write
their numbers to JSON, and the parametrized tests below judge them one case at a time.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from fitlm.config import ModelConfig, ParallelConfig, validate_dict
from fitlm.models.loss import count_targets, cross_entropy_sum
from fitlm.parallel.apply import parallelize
from fitlm.parallel.mesh import ParallelContext, context_on_mesh, exit_process
from fitlm.parallel.pipeline import (
    Pipeline,
    build_schedule,
    build_stage_modules,
    clip_grad_norm_pp,
    gather_full_state_dict,
    pipeline_eval,
    pipeline_problems,
    pipeline_step,
    split_layers,
    sync_tied_grads,
    tag_tied_copies,
)
from fitlm.parallel_dims import MESH_DIMS
from fitlm.registry import build_model
from fitlm.step.optim import param_groups
from fitlm.step.train_step import TrainStep
from tests.distributed import spawn

STEPS, LR, WD, CLIP = 3, 1e-3, 0.1, 1.0
MODELS = {
    "llama": dict(
        arch="llama", hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=4, vocab_size=128, max_seq_len=32
    ),
    # gpt2 with a tied head: the first and last stage each hold a copy and must stay equal.
    "gpt2": dict(
        arch="gpt2", hidden_size=64, num_heads=4, num_layers=4, vocab_size=128, max_seq_len=32, tie_embeddings=True
    ),
}
# (case id, arch, pp, schedule, micro_batch_num, accumulation micro batches per optimizer step, dp)
CASES_2 = [
    (f"{a}-{s}-m{m}", a, 2, s, m, 1, 1) for a in MODELS for s in ("gpipe", "1f1b", "interleaved_1f1b") for m in (2, 4)
] + [
    ("llama-1f1b-m2-accum2", "llama", 2, "1f1b", 2, 2, 1),
    # through the Pipeline class that fitlm.parallel.apply and the trainer use
    ("gpt2-interleaved_1f1b-m2-class", "gpt2", 2, "interleaved_1f1b", 2, 2, 1),
]
# The trainer's own step (TrainStep over parallelize) with 4 accumulation micro batches and document masks; one
# micro_batch_num=1 case, which only the whole step's chunk count (1 × 4 >= 2 stages) makes a valid layout.
TRAIN_STEP_CASES = [
    ("llama-1f1b-m2-accum4-trainstep", "llama", 2, "1f1b", 2, 4, 1),
    ("gpt2-interleaved_1f1b-m1-accum4-trainstep", "gpt2", 2, "interleaved_1f1b", 1, 4, 1),
]
CASES_4 = [
    ("gpt2-1f1b-m4-pp4", "gpt2", 4, "1f1b", 4, 1, 1),
    ("llama-gpipe-m4-pp4", "llama", 4, "gpipe", 4, 1, 1),
    # pp2 x dp2, FSDP2 on each stage: DTensor grads in the clip, sync and state-dict gather
    ("gpt2-interleaved_1f1b-m2-dp2-fsdp", "gpt2", 2, "interleaved_1f1b", 2, 1, 2),
]


def batch(rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed [rows,16] batch whose -100s fall unevenly, so a per-chunk mean would differ from the token mean."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (rows, 16), generator=g)
    labels = torch.randint(0, 128, (rows, 16), generator=g)
    labels[0, :11] = -100
    labels[2, 4:] = -100
    return ids, labels


def make_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**MODELS[arch]))


def adamw(groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)


def reference(arch: str, rows: int) -> dict:
    """The single-process loop: token-weighted mean over the whole batch, global clip, AdamW."""
    model = make_model(arch)
    opt = adamw(param_groups(model, WD))
    ids, labels = batch(rows)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = cross_entropy_sum(model(ids), labels) / count_targets(labels)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        final = float(cross_entropy_sum(model(ids), labels))
    return {"loss": losses, "norm": norms, "eval": final, "state": model.state_dict()}


def run_case(cid: str, rank: int, arch: str, pp: int, schedule: str, m: int, accum: int, dp: int) -> dict:
    if cid.endswith("-trainstep"):
        return run_train_step(rank, arch, pp, schedule, m, accum)
    group, dp_rank = dist.group.WORLD, 0
    if dp > 1:
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        group, rank, dp_rank = mesh["pp"], mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    if cid.endswith("-class"):
        return run_pipeline_class(rank, arch, pp, schedule, m, accum)
    stages = build_stage_modules(make_model(arch), rank, pp, schedule)
    if dp > 1:
        for _, mod in stages:
            for block in mod.model.layers.values():
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
            fully_shard(mod, mesh=mesh["dp"], reshard_after_forward=False)
        tag_tied_copies(stages)  # fully_shard replaced the Parameters
    sched = build_schedule(stages, group, m, schedule_name=schedule)
    opt = adamw(param_groups([mod for _, mod in stages], WD))
    params = [p for _, mod in stages for p in mod.parameters()]
    ids, labels = batch(4 * dp)
    total = count_targets(labels)  # the whole step's targets over all dp ranks, known before the step
    ids, labels = ids.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank]  # this dp rank's rows
    losses, norms = [], []
    for _ in range(STEPS):
        # FSDP averages gradients over dp (gloo has no PREMUL_SUM for divide factor 1): pre-scale by dp.
        loss = sum(pipeline_step(sched, i, lab, total / dp) for i, lab in zip(ids.chunk(accum), labels.chunk(accum)))
        if dp > 1:
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss = loss / dp  # each rank returned dp x its share
        sync_tied_grads(stages, group)
        norms.append(float(clip_grad_norm_pp(params, CLIP, group)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    out = {"loss": losses, "norm": norms, "blocks": [sorted(mod.model.layers.keys(), key=int) for _, mod in stages]}
    out["eval"] = float(pipeline_eval(sched, ids, labels))  # forward only, after the updates
    if dp > 1:
        dist.all_reduce(t := torch.tensor(out["eval"]), group=mesh["dp"].get_group())
        out["eval"] = float(t)
    return compare(out, gather_full_state_dict(stages, group), arch, 4 * dp)


def compare(out: dict, full: dict | None, arch: str, rows: int) -> dict:
    if full is not None:
        ref = reference(arch, rows)
        out["ref_loss"], out["ref_norm"], out["ref_eval"] = ref["loss"], ref["norm"], ref["eval"]
        out["keys_match"] = list(full) == list(ref["state"])
        out["max_diff"] = max(float((full[k] - v).abs().max()) for k, v in ref["state"].items() if k in full)
    return out


def run_pipeline_class(rank: int, arch: str, pp: int, schedule: str, m: int, accum: int) -> dict:
    """The trainer's calls, in its order (see fitlm/train/trainer.py)."""
    ctx = SimpleNamespace(
        group=lambda dim: dist.group.WORLD,
        pp=pp,
        pp_rank=rank,
        dp_rank=0,
        tp_rank=0,
        device=torch.device("cpu"),
        is_main=rank == 0,
    )
    cfg = SimpleNamespace(parallel=ParallelConfig(pipeline_parallel=pp, pipeline_schedule=schedule, micro_batch_num=m))
    pipe = Pipeline(make_model(arch), cfg, ctx)
    pipe.build_schedule(pipe.stage_modules)
    opt = adamw(param_groups([mod for _, mod in pipe.stages], WD))
    ids, labels = batch()
    n_targets = count_targets(labels)
    losses, norms = [], []
    for _ in range(STEPS):
        loss_sum = sum(pipe.step(i, lab, 1.0 / n_targets) for i, lab in zip(ids.chunk(accum), labels.chunk(accum)))
        params = [p for mod in pipe.stage_modules for p in mod.parameters() if p.grad is not None]
        norms.append(float(pipe.clip_grad_norm(params, CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss_sum) / n_targets)
    out = {
        "loss": losses,
        "norm": norms,
        "eval": float(pipe.eval_step(ids, labels)),
        "blocks": [sorted(mod.model.layers.keys(), key=int) for mod in pipe.stage_modules],
    }
    return compare(out, pipe.gather_full_state_dict(), arch, 4)


def doc_batches(accum: int) -> list[dict[str, torch.Tensor]]:
    """batch(8) as `accum` micro batches, with two documents per row (the second starts at r + 3, where positions
    restart) and its uneven -100s: a per-micro-batch or per-chunk mean would differ from the step's token mean."""
    ids, labels = batch(8)
    start = torch.arange(8)[:, None] + 3  # [8,1]
    t = torch.arange(16)[None, :]  # [1,16]
    document_ids = (t >= start).long()  # [8,16]
    position_ids = torch.where(t >= start, t - start, t)  # [8,16]
    parts = [x.chunk(accum) for x in (ids, labels, position_ids, document_ids)]
    keys = ("input_ids", "labels", "position_ids", "document_ids")
    return [dict(zip(keys, rows)) for rows in zip(*parts)]


@contextlib.contextmanager
def schedule_runs(runs: list[int]):
    """Append each training schedule run's chunk count to `runs` (torch's step(); eval runs are not counted)."""
    originals = {cls: cls.step for cls in (PipelineScheduleSingle, PipelineScheduleMulti)}

    def counted(original):
        def step(self, *args, **kwargs):
            if self._has_backward:
                runs.append(self._n_microbatches)
            return original(self, *args, **kwargs)

        return step

    for cls, original in originals.items():
        cls.step = counted(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.step = original


def train_steps(cfg, ctx: ParallelContext) -> dict:
    """STEPS optimizer steps of TrainStep on doc_batches, then the eval sum; the schedule runs of each step."""
    torch.manual_seed(0)
    pm = parallelize(build_model(cfg.model), cfg, ctx)
    step, batches = TrainStep.create(cfg, ctx, pm), doc_batches(cfg.train.gradient_accumulation_steps)
    out: dict = {"loss": [], "norm": [], "runs": []}
    for _ in range(STEPS):
        runs: list[int] = []
        with schedule_runs(runs):
            out["loss"].append(float(step.forward_backward(batches)))
        out["runs"].append(runs)
        out["norm"].append(float(step.optimizer_step()[0]))
    out["eval"] = sum(float(step.eval_sums(b)[0]) for b in batches)
    return {**out, "state": pm.full_state_dict()}


def run_train_step(rank: int, arch: str, pp: int, schedule: str, m: int, accum: int) -> dict:
    """The pipelined TrainStep on two ranks against the same TrainStep in one process (rank 0 alone)."""
    sections = {
        "model": MODELS[arch],
        "data": {"seq_length": 16, "document_mask": True},
        "train": {
            "micro_batch_size": 8 // accum,
            "gradient_accumulation_steps": accum,
            "lr": LR,
            "weight_decay": WD,
            "grad_clip": CLIP,
            "warmup_steps": 0,
        },
    }
    try:  # a layout the old per-micro-batch chunk rule refused must fail only its own tests
        cfg = validate_dict(
            {**sections, "parallel": {"pipeline_parallel": pp, "pipeline_schedule": schedule, "micro_batch_num": m}}
        )
        mesh = init_device_mesh("cpu", cfg.parallel.dims.mesh_shape, mesh_dim_names=MESH_DIMS)
        out = train_steps(cfg, context_on_mesh(mesh, cfg.parallel.dims, torch.device("cpu")))
    except ValueError as e:
        return {"error": str(e)}
    full = out.pop("state")
    if full is not None:
        ref = train_steps(validate_dict(sections), ParallelContext())
        out.update(
            ref_loss=ref["loss"],
            ref_norm=ref["norm"],
            ref_eval=ref["eval"],
            keys_match=list(full) == list(ref["state"]),
            max_diff=max(float((full[k] - v).abs().max()) for k, v in ref["state"].items() if k in full),
        )
    return out


def worker(rank: int, world: int, port: int, cases: list, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 cores, 2+ processes
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {cid: run_case(cid, rank, *rest) for cid, *rest in cases}
    try:  # fewer chunks than pipeline ranks is refused, naming the key
        build_schedule(build_stage_modules(make_model("llama"), rank, world, "1f1b"), dist.group.WORLD, world - 1)
        results["too_few_chunks"] = "no error"
    except ValueError as e:
        results["too_few_chunks"] = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    exit_process(0)  # not a normal exit (an exception above is reported by the spawn wrapper instead)


def run_world(world: int, cases: list, out_dir, timeout: float = 150.0) -> list[dict]:
    return spawn.run_world(worker, __name__, world, cases, out_dir, timeout, f"pipeline world of {world}")


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_world(2, CASES_2 + TRAIN_STEP_CASES, tmp_path_factory.mktemp("pp2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_world(4, CASES_4, tmp_path_factory.mktemp("pp4"))


def check(results: list[dict], cid: str) -> None:
    r0, dp = results[0][cid], next(c[-1] for c in CASES_2 + CASES_4 if c[0] == cid)
    for r in results:  # every pp rank logs the same loss and norm
        assert r[cid]["loss"] == pytest.approx(r0["ref_loss"], rel=1e-5), cid
        assert r[cid]["norm"] == pytest.approx(r0["ref_norm"], rel=1e-5), cid
        assert r[cid]["eval"] == pytest.approx(r0["ref_eval"], rel=1e-5), cid
    assert r0["keys_match"], "gathered state dict keys differ from the unsplit model's"
    # Weights after Adam steps: Adam amplifies fp32 reduction-order noise (gpt2 interleaved + FSDP reaches
    # 1.3e-5 here), so the bound is test_layouts' 1e-4; the losses and norms above stay at 1e-5 relative.
    assert r0["max_diff"] < 1e-4, r0["max_diff"]
    # Each block lives on exactly one stage (of each dp replica).
    blocks = sorted(int(b) for r in results for stage in r[cid]["blocks"] for b in stage)
    assert blocks == sorted(list(range(4)) * dp)


@pytest.mark.parametrize("cid", [c[0] for c in CASES_2])
def test_pp2_matches_single_process(world2, cid):
    check(world2, cid)


@pytest.mark.parametrize("cid", [c[0] for c in CASES_4])
def test_pp4_matches_single_process(world4, cid):
    check(world4, cid)


@pytest.mark.parametrize("cid, m, accum", [(c[0], c[4], c[5]) for c in TRAIN_STEP_CASES])
def test_one_schedule_run_per_optimizer_step(world2, cid, m, accum):
    """All accumulation micro batches of a step go through one schedule run of m × accum chunks (the pipeline
    fills and drains once per step), not one run of m chunks per micro batch."""
    for r in world2:
        assert "error" not in r[cid], r[cid]["error"]
        assert r[cid]["runs"] == [[m * accum]] * STEPS, r[cid]["runs"]


@pytest.mark.parametrize("cid", [c[0] for c in TRAIN_STEP_CASES])
def test_train_step_through_the_pipeline_matches_one_process(world2, cid):
    """TrainStep's pipelined step: the whole step's token-weighted mean (document masks, -100s), its clipped
    gradient norm, the eval sum and the weights after STEPS updates equal the same step in one process."""
    r0 = world2[0][cid]
    assert "error" not in r0, r0["error"]
    for r in world2:
        assert r[cid]["loss"] == pytest.approx(r0["ref_loss"], rel=1e-5)
        assert r[cid]["norm"] == pytest.approx(r0["ref_norm"], rel=1e-5)
        assert r[cid]["eval"] == pytest.approx(r0["ref_eval"], rel=1e-5)
    assert r0["keys_match"] and r0["max_diff"] < 1e-4, r0["max_diff"]


def test_interleaved_places_two_stages_per_rank(world2):
    assert world2[0]["llama-interleaved_1f1b-m2"]["blocks"] == [["0"], ["2"]]
    assert world2[1]["llama-interleaved_1f1b-m2"]["blocks"] == [["1"], ["3"]]


def test_too_few_micro_batches_refused(world2, world4):
    for res in (world2, world4):
        assert "parallel.micro_batch_num" in res[0]["too_few_chunks"]


# --------------------------------------------------------------------------- single process


def test_split_layers_balanced_and_explicit():
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert split_layers(7, 1) == [range(0, 7)]
    assert split_layers(6, 2, [1, 5]) == [range(0, 1), range(1, 6)]


@pytest.mark.parametrize("args", [(3, 4, None), (6, 2, [2, 3]), (6, 2, [6, 0]), (6, 3, [3, 3]), (4, 0, None)])
def test_split_layers_rejects(args):
    with pytest.raises(ValueError, match="stage"):
        split_layers(*args)


def test_stage_modules_own_their_parts():
    model = make_model("gpt2")
    ((s0, first),) = build_stage_modules(model, 0, 2, "1f1b")
    ((s1, last),) = build_stage_modules(model, 1, 2, "1f1b")
    assert (s0, s1) == (0, 1) and len(model.model.layers) == 4  # the full model is left intact
    assert first.model.embed_tokens is not None and first.model.embed_positions is not None
    assert first.lm_head is None and first.model.norm is None and list(first.model.layers) == ["0", "1"]
    assert last.model.embed_tokens is None and last.lm_head is not None and list(last.model.layers) == ["2", "3"]
    assert set(first.state_dict()) | set(last.state_dict()) == set(model.state_dict())
    # The last stage's tied head copy is treated like the embedding: no weight decay, as in the unsplit model.
    decay, no_decay = param_groups(last, 0.1)
    assert any(p is last.lm_head.weight for p in no_decay["params"])
    assert not any(p is last.lm_head.weight for p in decay["params"])
    hidden = first(torch.zeros(2, 5, dtype=torch.long))  # [B,T,C] hidden states in, logits out
    assert hidden.shape == (2, 5, 64) and last(hidden).shape == (2, 5, 128)


def test_interleaved_needs_enough_layers():
    with pytest.raises(ValueError, match="model.num_layers"):
        build_stage_modules(make_model("llama"), 0, 4, "interleaved_1f1b")


@pytest.mark.parametrize(
    "model_kw, par_kw, mbs, key",
    [
        ({"num_layers": 2}, {"pipeline_parallel": 4, "micro_batch_num": 4}, None, "parallel.pipeline_parallel"),
        ({}, {"pipeline_parallel": 2, "micro_batch_num": 1}, None, "parallel.micro_batch_num"),
        (
            {"num_layers": 3},
            {"pipeline_parallel": 2, "micro_batch_num": 2, "pipeline_schedule": "interleaved_1f1b"},
            None,
            "parallel.pipeline_schedule",
        ),
        (
            {},
            {"pipeline_parallel": 2, "micro_batch_num": 5, "pipeline_schedule": "interleaved_1f1b"},
            10,
            "parallel.micro_batch_num",
        ),
        ({}, {"pipeline_parallel": 2, "micro_batch_num": 4}, 6, "train.micro_batch_size"),
    ],
)
def test_pipeline_problems(model_kw, par_kw, mbs, key):
    problems = pipeline_problems(ModelConfig(**model_kw), ParallelConfig(**par_kw), mbs)
    assert len(problems) == 1 and problems[0].startswith(key), problems


def test_pipeline_problems_accepts_good_layouts():
    assert pipeline_problems(ModelConfig(num_layers=4), ParallelConfig(pipeline_parallel=2, micro_batch_num=2), 8) == []
    assert (
        pipeline_problems(
            ModelConfig(num_layers=4),
            ParallelConfig(pipeline_parallel=2, micro_batch_num=2, pipeline_schedule="interleaved_1f1b"),
            4,
        )
        == []
    )
    assert pipeline_problems(ModelConfig(num_layers=1), ParallelConfig(micro_batch_num=3), 8) == []  # pp = 1


def test_pipeline_problems_count_chunks_over_the_whole_step():
    """The step's one schedule run holds micro_batch_num × gradient_accumulation_steps chunks: that is what must
    reach pipeline_parallel (and divide into interleaved rounds)."""
    model = ModelConfig(num_layers=8)
    assert pipeline_problems(model, ParallelConfig(pipeline_parallel=2, micro_batch_num=1), 2, accumulation=4) == []
    assert (
        pipeline_problems(
            model,
            ParallelConfig(pipeline_parallel=2, micro_batch_num=5, pipeline_schedule="interleaved_1f1b"),
            10,
            accumulation=2,
        )
        == []
    )
    (msg,) = pipeline_problems(model, ParallelConfig(pipeline_parallel=4, micro_batch_num=1), 2, accumulation=2)
    assert msg.startswith(
        "parallel.micro_batch_num: 1 × train.gradient_accumulation_steps=2 = 2 is below parallel.pipeline_parallel=4"
    )
    assert "set parallel.micro_batch_num >= 2" in msg
