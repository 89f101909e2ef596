"""The bench/ scripts of issue #11 run end to end on their tiniest settings and keep their JSON contract.

No timing assertions: these only check that each script runs, prints exactly one JSON object with the
documented keys and sane values, and that the RESULTS.md tables can be printed back from the JSON.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

THROUGHPUT_KEYS = {
    "vocab_size",
    "fitlm_tokens_per_s",
    "hf_trainer_tokens_per_s",
    "fitlm_best_tokens_per_s",
    "hf_trainer_best_tokens_per_s",
    "loop_tokens_per_s",
    "fitlm_peak_bytes",
    "hf_trainer_peak_bytes",
    "gemm_peak_flops",
    "fitlm_best_mfu",
}


def run_script(name: str, *args) -> dict:
    """Run bench/<name> with --json; stdout must be exactly one JSON object."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), *map(str, args), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stdout[-2000:]
    return json.loads(lines[0])


def bench_module(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def throughput(tmp_path_factory) -> dict:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("bench") / "throughput.json"
    report = run_script(
        "train_throughput.py",
        "--sizes",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--batch",
        "2",
        "--seq",
        "32",
        "--rounds",
        "1",
        "--no-compile",
        "--fitlm-best",
        "O3,chunk=16",
        "--identical-chunk",
        "0",
        "--out",
        out,
    )
    assert json.loads(out.read_text()) == report
    return report


@pytest.mark.slow  # 30 s: the script trains both fitlm and the HF Trainer
def test_train_throughput_contract(throughput):
    (r,) = throughput["results"]
    assert THROUGHPUT_KEYS <= r.keys()
    assert r["vocab_size"] == bench_module("train_throughput").SIZES["tiny"]["vocab_size"]
    for key in THROUGHPUT_KEYS - {"vocab_size", "fitlm_best_mfu"}:
        assert r[key] > 0, key
    # MFU is defined, not bounded: a GEMM peak measured while other work shares the CPU can be low enough to
    # put it above 1, so the test checks the formula (tokens/s × FLOPs per token / the bf16 peak), not the speed.
    assert r["fitlm_best_mfu"] == pytest.approx(
        r["fitlm_best_tokens_per_s"] * r["flops_per_token"] / r["gemm_peak_flops"], rel=1e-4, abs=2e-6
    )  # stored to 6 places
    assert r["gemm_peak_dtype"] == "bf16" and r["gemm_peak_flops"] == throughput["gemm_peak_flops"]["bf16"]
    assert r["fitlm_best_settings"] == "O3 + chunked loss 16" and "compile" not in r["hf_trainer_best_settings"]
    assert len(r["fitlm_step_times_s"]) == len(r["hf_trainer_step_times_s"]) == 2


@pytest.mark.slow  # shares the 30 s fixture above
def test_train_throughput_markdown(throughput, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(throughput))
    proc = subprocess.run(
        [sys.executable, str(BENCH / "train_throughput.py"), "--markdown", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| tiny | 1,024 |" in proc.stdout and "peak live MiB" in proc.stdout
    assert "--sizes tiny" in proc.stdout  # the command that produced the numbers


@pytest.mark.process
def test_gemm_peak_tiny(tmp_path):
    report = run_script(
        "gemm_peak.py", "--sizes", "128", "--repeats", "1", "--dtypes", "fp32", "bf16", "--out", tmp_path / "g.json"
    )
    assert set(report["per_dtype"]) == {"fp32", "bf16"}
    assert all(d["peak_flops"] > 0 for d in report["per_dtype"].values())
    assert "machine" in report and (tmp_path / "g.json").exists()


@pytest.mark.process
def test_gpu_1b_dry_run(tmp_path):
    r = run_script("gpu_1b.py", "--dry-run", "--no-compile", "--out", tmp_path / "gpu.json")
    assert r["device"] == "cpu (dry run)" and r["model"]["vocab_size"] == 32000
    assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["params"] > 0
    assert all(x == x and x > 0 for x in r["loss_first_last"])  # finite, positive
    assert "plan" in r or "plan_error" in r


def test_scaling_markdown():
    scaling = bench_module("scaling")
    rows = [
        {"layout": "single", "kind": "none", "degree": 1, "processes": 1, "tokens_per_s": 1000.0, "step_time_s": 2.048},
        {"layout": "dp2 (DDP)", "kind": "dp", "degree": 2, "processes": 2, "tokens_per_s": 800.0, "step_time_s": 2.56},
        {"layout": "tp2", "kind": "tp", "degree": 2, "error": "boom"},
    ]
    report = scaling.summarize(
        {
            "benchmark": "scaling",
            "machine": {"cpus": 2},
            "global_batch": 8,
            "seq_length": 256,
            "steps": 4,
            "command": "python bench/scaling.py",
            "results": rows,
        }
    )
    dp = report["results"][1]
    assert dp["overhead_s"] == pytest.approx(0.512) and dp["scaling_efficiency"] == pytest.approx(0.8)
    text = scaling.table(report)
    assert "| dp2 (DDP) | dp | 2 |" in text and "error: boom" in text and "python bench/scaling.py" in text


def _tiny_standalone(tmp_path, *contenders: str) -> tuple[Path, dict]:
    """bench/train_standalone.py on the tiny model, one round of one timed step: (its JSON path, the result row)."""
    out = tmp_path / "standalone.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "train_standalone.py"),
            "--sizes",
            "tiny",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--batch",
            "2",
            "--seq",
            "32",
            "--no-compile",
            "--contenders",
            *contenders,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    return out, r


@pytest.mark.slow  # ~20 s: two fresh processes (fitlm, the HF Trainer), each imports torch and trains
def test_train_standalone_contract(tmp_path):
    pytest.importorskip("transformers")
    out, r = _tiny_standalone(tmp_path, "fitlm", "hf_eager")
    assert r["fitlm"]["tokens_per_s"] > 0 and r["hf_eager"]["tokens_per_s"] > 0 and "hf_sdpa" not in r
    assert r["fitlm_vs_hf_eager"]["ratio"] == pytest.approx(
        r["hf_eager"]["round_step_s"][0] / r["fitlm"]["round_step_s"][0], rel=1e-3, abs=5e-4
    )  # rounded to 3 places
    # fitlm's Trainer keeps freed memory (train.host_allocator: reuse); its run counts its faults like HF's
    assert r["fitlm"]["faults_per_step"] >= 0 and len(r["fitlm"]["runs"][0]["step_times_s"]) == 2
    assert r["fitlm_best_settings"].endswith("chunked loss 4096 + matmul_saved attention")  # O2, or O0 without bf16
    assert "compile" not in r["fitlm_best_settings"] + r["hf_trainer_best_settings"]
    assert r["fitlm"]["runs"][0]["jemalloc"] is False and r["hf_eager"]["runs"][0]["jemalloc"] is False
    md = subprocess.run(
        [sys.executable, str(BENCH / "train_standalone.py"), "--markdown", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert md.returncode == 0 and "| tiny |" in md.stdout and "--sizes tiny" in md.stdout


@pytest.mark.process
def test_train_standalone_refuses_a_missing_jemalloc(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "train_standalone.py"),
            "--contenders",
            "hf_eager_jemalloc",
            "--jemalloc",
            str(tmp_path / "libjemalloc.so.2"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode != 0 and "no such file" in proc.stderr and "apt-get install libjemalloc2" in proc.stderr


@pytest.mark.slow  # ~15 s: one HF Trainer process with jemalloc preloaded
def test_train_standalone_preloads_jemalloc(tmp_path):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("train_standalone", BENCH / "train_standalone.py")
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)
    if lib.find_jemalloc(None) is None:
        pytest.skip("jemalloc is not installed (apt-get install libjemalloc2)")
    _, r = _tiny_standalone(tmp_path, "fitlm", "hf_eager_jemalloc")
    assert r["hf_eager_jemalloc"]["runs"][0]["jemalloc"] is True and r["fitlm"]["runs"][0]["jemalloc"] is False
    assert "fitlm_vs_hf_eager_jemalloc" in r


@pytest.mark.slow  # ~70 s: one process builds a Qwen3-MoE in transformers, trains it in fitlm and three ways in HF, and LoRA in both
def test_moe_contract(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    out = tmp_path / "moe.json"
    r = run_script("moe.py", "--size", "tiny", "--steps", "1", "--warmup", "1", "--rounds", "1", "--out", out)
    assert json.loads(out.read_text()) == r
    assert {"fitlm", "fitlm_loop", "hf_eager"} <= r["step"].keys() and r["layer"].keys() == r["step"].keys()
    for name, s in r["step"].items():
        assert s["tokens_per_s"] > 0 and s["peak_bytes"] > 0 and r["layer"][name]["tokens_per_s"] > 0, name
        assert s["loss_max_abs_diff"] < 1e-4 and s["aux_loss_max_abs_diff"] < 1e-4, name  # same model, same batch
        assert r["layer"][name]["max_abs_diff_vs_fitlm"] < 1e-5, name
    assert r["step"]["fitlm"]["ratio_vs_fitlm"] == 1.0
    # LoRA on attention and the experts (issue #55): fitlm's step against transformers + PEFT from the same adapters
    lora = r["lora"]["step"]
    assert lora.keys() == {"fitlm_lora", "hf_peft_lora"} and lora["fitlm_lora"]["ratio_vs_fitlm"] == 1.0
    for name, s in lora.items():
        assert s["tokens_per_s"] > 0 and s["peak_bytes"] > 0, name
        assert s["loss_max_abs_diff"] < 1e-4 and s["aux_loss_max_abs_diff"] < 1e-4, name  # same training
    assert lora["hf_peft_lora"]["adapter_effect_rel_diff"] < 1e-2  # a scaling or wiring mismatch gives ~1
    m = r["model"]
    shared_a = m["num_hidden_layers"] * m["num_experts"] * r["lora"]["r"] * m["hidden_size"]  # PEFT's gate_up A
    assert lora["fitlm_lora"]["trainable_params"] == lora["hf_peft_lora"]["trainable_params"] + shared_a
    # one part rerun into the same file: the others stay as measured, each part with its command. The control with
    # adapters on down_proj alone (the same parameters on both sides, no shared A) trains alike to float rounding.
    again = run_script(
        "moe.py", "--size", "tiny", "--steps", "6", "--warmup", "0", "--rounds", "1", "--parts", "lora",
        "--lora-experts", "down_proj", "--out", out,
    )  # fmt: skip
    assert again == json.loads(out.read_text()) and again["layer"] == r["layer"] and again["step"] == r["step"]
    assert "--parts lora" in again["lora"]["command"] and "--parts" not in again["command"]
    control = again["lora"]["step"]
    assert control["fitlm_lora"]["trainable_params"] == control["hf_peft_lora"]["trainable_params"]
    assert control["hf_peft_lora"]["adapter_effect_rel_diff"] < 2e-5  # with gate_up_proj: ~2e-4 at 6 steps
    md = subprocess.run(
        [sys.executable, str(BENCH / "moe.py"), "--markdown", str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert md.returncode == 0 and "| fitlm_loop |" in md.stdout and "--size tiny" in md.stdout
    assert "| hf_peft_lora |" in md.stdout and "--parts lora" in md.stdout


@pytest.mark.process  # ~25 s: two gloo processes (issue #52), each imports torch
def test_moe_tp_contract(tmp_path):
    out = tmp_path / "moe_tp.json"
    r = run_script(
        "moe_tp.py", "--sizes", "tiny", "--seq", "32", "--rounds", "1", "--steps", "1", "--warmup", "1", "--out", out
    )
    assert json.loads(out.read_text()) == r
    rows = {x["contender"]: x for x in r["results"]}
    assert rows.keys() == {"replicated", "split", "fitlm", "local"} and rows["replicated"]["vs_replicated"] == 1.0
    for name, x in rows.items():
        assert x["step_s"] > 0 and x["peak_bytes"] > 0 and len(x["step_s_ranks"]) == 2, name
        assert x["max_rel_diff"] < 1e-5, name  # each gives one process's output and gradients
    # bytes each rank receives (fp32, ring counts): B·T·H = 2·32·64 elements, E·H = 4·64, all parameters 24832
    half = 2 * 32 * 64 * 4 // 2  # an all-gather or a reduce-scatter of the full sequence over tp2
    assert rows["replicated"]["comm_bytes"] == 2 * half  # gather x, gather the output gradient
    assert rows["split"]["comm_bytes"] == 4 * half + 4 * 64 * 4  # + reduce-scatters of y and dx, the router's grad
    assert rows["local"]["comm_bytes"] == (4 * 64 + 3 * 4 * 32 * 64) * 4  # every parameter's gradient
    assert rows["split"]["param_bytes"] == (4 * 64 + 3 * 4 * 16 * 64) * 4  # half of each expert, the router whole
    # fitlm's split: gather x, reduce-scatter y, gather the output gradient; all-reduce the rows' and the routing
    # weights' (B·T·k = 2·32·2) partial gradients
    assert rows["fitlm"]["comm_bytes"] == 3 * half + 2 * half + 2 * 32 * 2 * 4
    assert rows["fitlm"]["param_bytes"] == rows["split"]["param_bytes"] and rows["fitlm"]["comm_s"] is None
    md = subprocess.run(
        [sys.executable, str(BENCH / "moe_tp.py"), "--markdown", str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert md.returncode == 0 and "| tiny (64, 4, 2, 32) | split |" in md.stdout and "--sizes tiny" in md.stdout


@pytest.mark.slow  # ~40 s: fitlm (data pack, train, export) and a TRL GRPOTrainer, each a fresh process
def test_grpo_contract(tiny_corpus, tmp_path):
    """bench/grpo.py at its tiniest on a transformers-made tiny Llama (nothing downloaded): both contenders train
    the same steps, the held-out set is scored before and after each, and the table prints from the JSON."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    import torch

    torch.manual_seed(0)
    hf = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176
    )
    hf.vocab_size, hf.max_position_embeddings, hf.tie_word_embeddings = 512, 64, False
    model = tmp_path / "hf"
    transformers.LlamaForCausalLM(hf).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((tiny_corpus["root"] / name).read_bytes())
    out = tmp_path / "grpo.json"
    r = run_script(
        "grpo.py", "--model", model, "--steps", "2", "--rounds", "1", "--held-out", "4", "--max-operand", "4", "--completion-length",
        "4", "--threads", "1", "--out", out,
    )  # fmt: skip
    assert json.loads(out.read_text()) == r
    (round_,) = r["rounds"]
    for name in ("fitlm", "trl"):
        raw = round_["raw"][name]
        assert len(raw["step_s"]) == len(raw["sampling_s"]) == len(raw["reward"]) == 2, name
        assert 0 < round_[name]["sampling_s"] < round_[name]["step_s"], name
        assert 0 < round_[name]["sampling_cpu_s"] < round_[name]["step_cpu_s"], name
        assert 0 < round_[name]["completion_length"] <= 4, name
        assert 0.0 <= r["held_out"][f"after_{name}"]["mean_reward"] <= 1.0, name
    assert (
        round_["trl_over_fitlm"] > 0
        and round_["trl_over_fitlm_cpu"] > 0
        and r["task"] == {"train_prompts": 12, "held_out_prompts": 4, "max_operand": 4}
    )
    assert r["settings"]["prompts_per_step"] == 2 and r["settings"]["num_generations"] == 4
    md = subprocess.run(
        [sys.executable, str(BENCH / "grpo.py"), "--markdown", str(out)], capture_output=True, text=True, cwd=ROOT
    )
    assert md.returncode == 0, md.stderr[-2000:]
    assert "| TRL `GRPOTrainer`, after 2 steps |" in md.stdout and "G=4" in md.stdout
