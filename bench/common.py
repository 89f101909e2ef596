"""Helpers shared by the bench/ scripts: packed data, fitlm trainers from a dict, the same model in
Hugging Face transformers, GEMM peaks, step functions and JSON output.

Not a script: `bench/train_throughput.py`, `bench/gemm_peak.py`, `bench/scaling.py` and
`bench/gpu_1b.py` import it (they put bench/ and the repository root on sys.path).
"""

from __future__ import annotations

import json
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
PLAYS = ROOT / "examples" / "data" / "shakespeare"
RESULTS = ROOT / "bench" / "results"


def prepare_data(root: Path, tokenizer_vocab: int = 1024) -> Path:
    """Pack Macbeth with a small BPE tokenizer into root/train (as bench/memory.py does); returns the dir.

    A model's vocabulary may be larger than the tokenizer's: the logits cost the same whatever ids occur.
    """
    from fitlm.data.prep.pack import pack_corpus
    from fitlm.data.prep.tokenizer_train import train_tokenizer

    if not (root / "train").exists():
        tok = train_tokenizer([PLAYS / "macbeth_gut.txt"], tokenizer_vocab, root / "tokenizer.json")
        pack_corpus([PLAYS / "macbeth_gut.txt"], tok, root / "train", show_progress=False)
    return root / "train"


def fitlm_config(
    model: dict,
    data_dir: Path,
    out_dir: Path,
    batch: int,
    seq: int,
    memory: dict | None = None,
    device: str = "cpu",
    finetune: dict | None = None,
    **train,
):
    """A validated fitlm Config for benchmarking: no eval, no progress bar, no warm-up of the LR; `finetune`: the
    config's finetune section (e.g. LoRA), none = full training."""
    from fitlm.config import validate_dict

    return validate_dict(
        {
            "model": {"arch": "llama", "max_seq_len": seq, **model},
            "memory": memory or {},
            "finetune": finetune or {},
            # Plain causal attention over the packed row, as transformers computes it (no block-causal mask).
            "data": {"train": str(data_dir), "seq_length": seq, "document_mask": False},
            "train": {
                "micro_batch_size": batch,
                "max_steps": 10**6,
                "warmup_steps": 0,
                "eval_interval": 0,
                "progress": False,
                "log_interval": 10**6,
                "observe": {"consistency_interval": 0, "tensorboard": False},
                "device": device,
                "output_dir": str(out_dir),
                **train,
            },
        }
    )


def fitlm_step(trainer) -> Callable[[], object]:
    """One optimizer step of a fitlm Trainer (`Trainer.train_step`: data, forward/backward, update)."""
    batches = iter(trainer.loader)
    state = {"step": 0}

    def step():
        state["step"] += 1
        return trainer.train_step(state["step"], batches)

    return step


def hf_model_from_fitlm(model, cfg, attn: str = "sdpa"):
    """transformers' LlamaForCausalLM with fitlm's config and exactly its weights (fitlm.models.hf)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fitlm.models.hf import config_to_hf, to_hf_state_dict

    hf_cfg = LlamaConfig(**config_to_hf(cfg))
    hf_cfg._attn_implementation = attn
    hf_cfg.use_cache = False
    hf = LlamaForCausalLM(hf_cfg).to(torch.float32)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model, cfg), strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"HF weights do not match: missing {missing}, unexpected {unexpected}")
    return hf.train()


def bf16_matmul_fast(device: str = "cpu") -> bool:
    """Whether half-precision matmuls have a fast path here (GPU, or a CPU with AVX512-BF16/AMX for oneDNN)."""
    import torch

    if device != "cpu":
        return True
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def gemm_peak(dtype_name: str, device: str = "cpu", n: int | None = None) -> float:
    """Measured peak FLOP/s of a square GEMM (fitlm.hardware.measure_gemm_flops, cached per dtype).

    Half precision without a fast path on this CPU runs ~100x slower than fp32: a smaller matrix keeps
    the measurement to seconds (it is the same slow kernel at any size).
    """
    import torch

    from fitlm.hardware import measure_gemm_flops

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    if n is None:
        n = 1024 if dtype_name == "fp32" or bf16_matmul_fast(device) else 256
    return measure_gemm_flops(torch.device(device), dtype, n=n)


def rss_bytes() -> int:
    """Peak resident set of this process since it started.

    On Linux this is VmHWM of /proc/self/status: `ru_maxrss` survives fork + exec, so a child process
    started by a large parent would report the parent's peak (every child the same number).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def machine() -> dict:
    import os

    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def write_json(path: Path, obj: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")
    return path


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs) if xs else float("nan")


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the results)."""
    print(msg, file=sys.stderr, flush=True)


def emit(report: dict, table: Callable[[dict], str], out: Path | None, as_json: bool) -> None:
    """A bench's report: written to `out` when given, then one JSON object on stdout (the table on stderr) with
    `as_json`, or the table on stdout."""
    if out:
        write_json(out, report)
    if as_json:
        log(table(report))
        print(json.dumps(report))
    else:
        print(table(report))


def profile_step(step: Callable[[], object], label: str, rows: int = 12) -> list[dict]:
    """Self CPU time of the top ops over one call of `step` (torch.profiler), for 'where does the time go'."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    top = [
        {
            "op": e.key,
            "self_ms": round(e.self_cpu_time_total / 1e3, 2),
            "share": round(e.self_cpu_time_total / total, 3),
            "calls": e.count,
        }
        for e in events[:rows]
    ]
    log(f"  profile {label}: " + ", ".join(f"{t['op']} {t['share']:.0%}" for t in top[:6]))
    return top
