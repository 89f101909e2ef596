"""Long context in the planner (issue 21): context parallel's activations and traffic, activation offload's
device and host bytes, `fitlm plan --max-seq`, and the search over both. Analytic only: no model is built.

Expected values are computed here from the model's shape (the gathered K/V: 2·B·K·T·D·e per layer), never by
calling the planner's own helpers for them."""

from __future__ import annotations

import json
from dataclasses import replace

from fitlm.config import validate_dict
from fitlm.plan.analytic import breakdown
from fitlm.plan.devices import CATALOG, Device, GiB
from fitlm.plan.report import plan
from fitlm.plan.search import best_per_layout, candidates
from fitlm.plan.setup import from_config, on_device
from fitlm.plan.throughput import timing
from tests.e2e.helpers import write_config

# A small GQA Llama: h64, 4 layers, 4 heads over 2 kv heads (head dim 16), vocab 512.
SMALL = {
    "arch": "llama",
    "hidden_size": 64,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 176,
    "vocab_size": 512,
    "max_seq_len": 512,
    "tie_embeddings": False,
}
GATHERED = "context parallel: gathered K/V (kept for backward)"
LLAMA_7B = {
    "arch": "llama",
    "hidden_size": 4096,
    "num_layers": 32,
    "num_heads": 32,
    "num_kv_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
}


def _cfg(seq: int = 512, model: dict | None = None, **sections):
    sections.setdefault("train", {}).update({"micro_batch_size": 1, "gradient_accumulation_steps": 1})
    return validate_dict({"model": {**SMALL, **(model or {})}, "data": {"seq_length": seq}, **sections})


def _device(memory: int, name: str = "custom") -> Device:
    return replace(CATALOG["a100-80g"], name=name, memory_bytes=memory, reserved_bytes=0)


def test_cp2_holds_at_most_0_6_of_one_process_activations_at_seq_512():
    for doc_mask in (True, False):
        one = breakdown(from_config(_cfg(data={"seq_length": 512, "document_mask": doc_mask})))
        cfg = _cfg(data={"seq_length": 512, "document_mask": doc_mask}, parallel={"context_parallel": 2})
        two = breakdown(from_config(cfg))
        assert two.activations <= 0.6 * one.activations, (two.activations, one.activations)
        assert two.logits <= 0.5 * one.logits  # the loss runs on this rank's T/C tokens
        # The full-length keys and values every layer keeps, fp32 at O0: 2 · B1 · K2 · T512 · D16 · 4 bytes · 4 layers.
        assert dict(two.activation_parts)[GATHERED] == 2 * 1 * 2 * 512 * 16 * 4 * 4
        other = dict(two.other_parts)
        # additive fp32 (B = 1): [T/C, T] of global positions with document masks; without, the chunks'
        # prefixes [c, (g+1)c] with c = T/2C = 128, g = 0 and 3 on rank 0: c·c·(2C+1) entries.
        want = 256 * 512 * 4 if doc_mask else 128 * 128 * 5 * 4
        assert other["context parallel: attention mask"] == want
        assert sum(other.values()) == two.other  # every byte of `other` named


def test_zero_shards_over_data_times_context_parallel():
    cfg = _cfg(parallel={"context_parallel": 2, "data_parallel": 2, "zero_stage": 3})
    sharded = breakdown(from_config(cfg))
    whole = breakdown(from_config(_cfg()))
    assert sharded.params == whole.params // 4 and sharded.optimizer == whole.optimizer // 4


def test_context_parallel_traffic_is_timed_over_the_cp_group():
    s = from_config(_cfg(parallel={"context_parallel": 2}))
    t = timing(s, CATALOG["h100-80g"])
    assert t.cp_comm_s > 0 and timing(replace(s, cp=1), CATALOG["h100-80g"]).cp_comm_s == 0
    # Full recompute gathers K and V again: 2 more all-gathers per layer beside the 2 gathers and 2 reduce-scatters.
    again = timing(replace(s, recompute="full"), CATALOG["h100-80g"]).cp_comm_s
    assert 1.4 * t.cp_comm_s < again < 1.6 * t.cp_comm_s


def test_max_seq_reports_a_length_that_fits_and_the_next_one_does_not():
    cfg = _cfg(model={"max_seq_len": 65536}, parallel={"context_parallel": 2})
    s = from_config(cfg)
    dev = _device(64 * 2**20)
    found = plan(cfg, dev, 2, longest=True)["max_seq"]
    length, step = found["length"], found["multiple_of"]
    assert step == 4 and length % step == 0 and found["limited_by"] == "memory"
    assert breakdown(replace(s, seq=length)).total <= dev.usable_bytes < breakdown(replace(s, seq=length + step)).total
    assert found["per_device_total"] <= dev.usable_bytes < found["next_per_device_total"]
    # Monotone: more memory, a longer sequence; context parallel over 2 ranks fits a longer one than 1 rank.
    assert plan(cfg, _device(128 * 2**20), 2, longest=True)["max_seq"]["length"] > length
    single = plan(_cfg(model={"max_seq_len": 65536}), dev, 1, longest=True)["max_seq"]["length"]
    assert single < length


def test_max_seq_says_when_model_max_seq_len_itself_fits():
    found = plan(_cfg(), CATALOG["a100-80g"], 1, longest=True)["max_seq"]
    assert found["length"] == 512 and found["limited_by"] == "model.max_seq_len"
    assert "model.max_seq_len" in found["note"] and found["next_per_device_total"] is None


def test_activation_offload_moves_block_activations_to_the_host_on_an_accelerator_only():
    base = _cfg(seq=512)
    off = _cfg(seq=512, memory={"activation_offload": True})
    dev = CATALOG["a100-80g"]
    before, after = plan(base, dev, 1), plan(off, dev, 1)
    moved = after["host_activation_bytes"]
    # 4 blocks' saved tensors, 2 of them left on the device (the block computed and the one prefetched).
    assert moved > 0 and after["per_device"]["activations"] == before["per_device"]["activations"] - moved
    assert after["host"]["per_rank"]["step"] == before["host"]["per_rank"]["step"] + moved
    assert after["host"]["parts"]["step"]["offloaded activations (pinned)"] == moved
    assert after["time_breakdown_s"]["activation_offload_copies"] >= 0
    model = plan(_cfg(seq=512, memory={"activation_offload": "model"}), dev, 1)
    assert model["host_activation_bytes"] > moved  # the embedding's and final norm's saved tensors too
    # On the cpu device the activations are in host memory already: nothing changes, and the plan says so.
    cpu = _device(64 * GiB, name="cpu")
    on_cpu, plain_cpu = plan(off, cpu, 1), plan(base, cpu, 1)
    assert on_cpu["per_device"] == plain_cpu["per_device"] and on_cpu["host_activation_bytes"] == 0
    assert on_cpu["host"]["per_rank"] == plain_cpu["host"]["per_rank"]
    assert any("cpu device" in note for note in on_cpu["notes"])


def test_offload_copies_are_timed_when_they_outlast_compute():
    s = on_device(from_config(_cfg(seq=512, memory={"activation_offload": True})), "a100-80g")
    slow_link = replace(CATALOG["a100-80g"], host_link_gbs=1e-3)
    assert timing(s, slow_link).offload_s > 0 and timing(replace(s, act_offload=False), slow_link).offload_s == 0


def test_search_splits_a_long_sequence_over_context_parallel_ranks():
    cfg = validate_dict(
        {
            "model": {**LLAMA_7B, "max_seq_len": 131072},
            "data": {"seq_length": 131072},
            "memory": {"mixed_precision": "O2"},
            "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 8},
        }
    )
    found = candidates(cfg, 4, CATALOG["h100-80g"])
    split = [c for c in found if c.setup.cp > 1]
    assert split and all(c.setup.pp == 1 and 131072 % (2 * c.setup.cp) == 0 for c in split)
    assert any(c.setup.cp > 1 for c in best_per_layout(found, 3))  # among the fastest layouts
    # Without activation offload, and with a host too small for it, one unsplit 128K sequence fits no device.
    small_host = replace(CATALOG["h100-80g"], host_memory_bytes=100 * 10**9)
    unsplit = [c for c in candidates(cfg, 4, small_host) if c.setup.cp == 1 and c.setup.tp == 1]
    assert not unsplit
    assert any(c.setup.act_offload for c in found)  # offload is searched on an accelerator


def test_plan_json_names_the_long_context_keys(tmp_path, capsys):
    from fitlm.cli import main

    cfg = _cfg(parallel={"context_parallel": 2}, memory={"activation_offload": True})
    path = write_config(tmp_path / "c.yaml", cfg.to_dict())
    assert main(["plan", str(path), "--device", "h100-80g", "--num-devices", "2", "--max-seq", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"].startswith("dp1×tp1×pp1×cp2")
    assert GATHERED in out["activation_parts"] and "context parallel: attention mask" in out["other_parts"]
    assert {"length", "multiple_of", "limit", "limited_by", "per_device_total", "note"} <= set(out["max_seq"])
    assert {"context_parallel_comm", "activation_offload_copies"} <= set(out["time_breakdown_s"])
    assert "host_activation_bytes" in out and "activation_offload=blocks" in out["memory_options"]


def test_search_offers_gradient_sync_choices_only_where_they_differ():
    from fitlm.plan.search import _sync_options

    assert _sync_options(3, 2, 4) == ("every_micro_batch", "last_micro_batch")
    assert _sync_options(3, 2, 4, pp=2) == ("auto",)  # one schedule run per step: reduced once either way
    assert _sync_options(3, 1, 4) == ("auto",) and _sync_options(0, 2, 4) == ("auto",)
