"""Expert compute: fitlm's MoE layer and training step beside transformers' on the same Qwen3-MoE and batch
(issue #38).

Not a test: it prints a table (stderr with --json) and writes JSON; it asserts nothing. One process:

* builds a Qwen3-MoE with transformers (`AutoConfig.for_model("qwen3_moe")`, `from_config`, seeded init),
  saves it, and loads that directory into fitlm (`model.init_from`): the same weights on both sides;
* contenders: fitlm (GroupedExperts on its grouped-matmul path where torch has the kernel:
  fitlm.models.experts.grouped_mm_supported), `fitlm_loop` (the same with the per-expert loop forced), and
  transformers with each of its experts implementations that runs on this device (`--hf-impls`; default:
  eager = a loop over the experts hit, batched_mm = one bmm per token-expert slot over gathered weights,
  grouped_mm = torch's grouped matmul, which torch 2.11+ also has on CPU);
* (a) the MoE layer alone, forward + backward: layer 0's `mlp` of each model on the same input [B, T, H] and
  output gradient; (b) a whole training step: fitlm's `Trainer.train_step` (data, forward, backward with its
  load-balancing loss, clip, AdamW) against the transformers model's own loss with `output_router_logits=True`
  (its aux loss added with the same `router_aux_loss_coef`), `clip_grad_norm_(1.0)` and torch's AdamW with
  fitlm's hyper-parameters (lr constant 3e-4, betas (0.9, 0.95), weight decay 0.1, eps 1e-8): like with like;
* steps are interleaved contender by contender (a shared machine slows them alike), `--rounds` times;
  times are medians after `--warmup`, ratios are taken within a round then their median over rounds;
* peak bytes: the live tensors over one layer call / one step (torch's MemTracker,
  fitlm.memory.tracking.peak_live_bytes: parameters, gradients, optimizer states, activations, temporaries);
* honesty check: each step's token loss and aux loss of every transformers contender against fitlm's
  (`loss_max_abs_diff` over the timed run; the first step starts from the same weights and batch);
* (c) LoRA on attention and the experts (`lora`, issue #55): fitlm's LoRA step against transformers + PEFT
  (`target_parameters` on its fused experts) from the same adapters, same batches (bench/moe_lora.py says how);
* `--parts` runs some of (a), (b), (c): with `--out` an earlier report of the same model keeps the others (each
  part records its command), e.g. more rounds of the LoRA rows than the whole run's time allows.

    python bench/moe.py [--json] [--size small|tiny] [--steps 4] [--warmup 2] [--rounds 3]
                        [--hf-impls eager batched_mm grouped_mm]
                        [--parts layer step lora] [--lora-experts all|down_proj]
                        [--lora-hf-impl grouped_mm] [--profile] [--out bench/results/moe.json]
    python bench/moe.py --markdown [bench/results/moe.json]   # the RESULTS.md table

How to read it: `*_tokens_per_s` = B·T / median time; `ratio` = the contender's time / fitlm's, > 1 means
fitlm is faster; `peak MiB` are live-tensor peaks (lower is better).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, emit, log, machine, prepare_data, profile_step  # noqa: E402
from moe_lora import lora_part, lora_table  # noqa: E402
from moe_setup import (  # noqa: E402
    HF_IMPLS,
    SIZES,
    batches_for,
    fitlm_contender,
    hf_checkpoint,
    hf_contender,
    hf_model,
    loop_path,
    loss_checks,
    summary,
    timed,
)

PARTS = ("layer", "step", "lora")

# --------------------------------------------------------------------------- contenders: the layer


def layer_call(layer, x, g, loop: bool = False):
    """Forward + backward of one MoE layer on x [B, T, H] with output gradient g."""

    def call():
        with loop_path() if loop else contextlib.nullcontext():
            xx = x.detach().requires_grad_()
            y = layer(xx)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(g)
            layer.zero_grad(set_to_none=True)

    return call


# --------------------------------------------------------------------------- the run


def layer_part(args, size: dict, ckpt: Path) -> tuple[dict, dict]:
    """(a) layer 0's MoE block alone, forward + backward: (summaries by contender, profiles)."""
    import torch

    from fitlm.memory.tracking import peak_live_bytes
    from fitlm.models.hf import load_hf_dir
    from fitlm.models.moe import moe_layers

    fit_model, _ = load_hf_dir(ckpt)
    fit_layer = moe_layers([fit_model.train()])[0]
    layers = {"fitlm": (fit_layer, False), "fitlm_loop": (fit_layer, True)}
    hf_models = {}
    for impl in args.hf_impls:
        try:
            hf_models[impl] = hf_model(ckpt, impl)
            layers[f"hf_{impl}"] = (hf_models[impl].model.layers[0].mlp, False)
        except Exception as e:  # an implementation this device lacks (e.g. a CUDA-only kernel)
            log(f"  transformers experts_implementation={impl}: unavailable here ({type(e).__name__}: {e})")
    torch.manual_seed(1)
    x = torch.randn(size["batch"], size["seq"], size["hidden_size"])
    g = torch.randn_like(x)
    with torch.no_grad():
        ref = layers["fitlm"][0](x)
        layer_diff = {
            name: float((layer(x)[0] if isinstance(layer(x), tuple) else layer(x)).sub(ref).abs().max())
            for name, (layer, _) in layers.items()
        }
    calls = {name: layer_call(layer, x, g, loop) for name, (layer, loop) in layers.items()}
    layer_times: dict[str, list[list[float]]] = {n: [] for n in calls}
    for _round in range(args.rounds):
        per, _ = timed(calls, args.warmup + args.steps)
        for n in calls:
            layer_times[n].append(per[n])
    layer = summary(layer_times, args.warmup, size["batch"] * size["seq"], "fitlm")
    for n, call in calls.items():
        layer[n]["peak_bytes"] = peak_live_bytes(call, [layers[n][0]], None, warmup_steps=1)["total"]
        layer[n]["max_abs_diff_vs_fitlm"] = layer_diff[n]
    return layer, ({n: profile_step(calls[n], f"layer {n}", rows=8) for n in calls} if args.profile else {})


def step_part(args, size: dict, ckpt: Path, data_dir: Path, tmp: Path, impls: list[str]) -> tuple[dict, dict]:
    """(b) the whole training step of fitlm, fitlm_loop and transformers' `impls`: (summaries, profiles)."""
    from fitlm.memory.tracking import peak_live_bytes

    steps = args.warmup + args.steps
    step_times: dict[str, list[list[float]]] = {}
    losses: dict[str, list[tuple[float, float]]] = {}
    step_peak: dict[str, int] = {}
    step_prof: dict[str, list] = {}
    for r in range(args.rounds):
        log(f"[{args.size}] round {r + 1}/{args.rounds}: fitlm, fitlm_loop, transformers {' '.join(impls)}")
        contenders, holders = {}, {}
        fit_step, fit_trainer = fitlm_contender(ckpt, data_dir, tmp / f"fit{r}", size, loop=False)
        contenders["fitlm"], holders["fitlm"] = fit_step, (fit_trainer.pm.modules, fit_trainer.step.optimizer)
        loop_step, loop_trainer = fitlm_contender(ckpt, data_dir, tmp / f"loop{r}", size, loop=True)
        contenders["fitlm_loop"] = loop_step
        holders["fitlm_loop"] = (loop_trainer.pm.modules, loop_trainer.step.optimizer)
        batches = batches_for(fit_trainer.cfg, steps + 2)
        for impl in impls:
            model = hf_model(ckpt, impl)
            contenders[f"hf_{impl}"], opt = hf_contender(model, batches)
            holders[f"hf_{impl}"] = ([model], opt)
        per, outs = timed(contenders, steps)
        for n in contenders:
            step_times.setdefault(n, []).append(per[n])
        if r == 0:
            losses = outs
            for n, step in contenders.items():
                step_peak[n] = peak_live_bytes(step, *holders[n], warmup_steps=0)["total"]
            if args.profile:
                step_prof = {n: profile_step(step, f"step {n}", rows=8) for n, step in contenders.items()}
        del contenders, holders, fit_trainer, loop_trainer
        gc.collect()
    step = summary(step_times, args.warmup, size["batch"] * size["seq"], "fitlm")
    for n in step:
        step[n]["peak_bytes"] = step_peak[n]
    loss_checks(step, losses, "fitlm")
    return step, step_prof


def run(args) -> dict:
    """The parts `args.parts` names of the report (the model's description always)."""
    import torch

    from fitlm.models.experts import grouped_mm_supported

    size = SIZES[args.size]
    tmp = Path(tempfile.mkdtemp(prefix="bench_moe_"))
    data_dir = prepare_data(tmp / "data", tokenizer_vocab=min(1024, size["vocab_size"]))
    ckpt = hf_checkpoint(size, tmp / "hf")
    command = "python bench/moe.py " + " ".join(sys.argv[1:])
    report: dict = {
        "benchmark": "moe",
        "size": args.size,
        "model": size,
        "tokens_per_step": size["batch"] * size["seq"],
    }
    if {"layer", "step"} & set(args.parts):
        report |= {"machine": machine(), "command": command, "steps": args.steps, "warmup": args.warmup}
        report |= {"rounds": args.rounds, "grouped_mm_on_cpu": grouped_mm_supported(torch.device("cpu"), torch.float32)}
    impls, profile = list(args.hf_impls), {}
    if "layer" in args.parts:
        report["layer"], profile["layer"] = layer_part(args, size, ckpt)
        impls = [n.removeprefix("hf_") for n in report["layer"] if n.startswith("hf_")]  # those that run here
        gc.collect()
    if "step" in args.parts:
        report["step"], profile["step"] = step_part(args, size, ckpt, data_dir, tmp, impls)
    if args.profile and profile:
        report["profile"] = profile
    if "lora" in args.parts:
        if importlib.util.find_spec("peft") is None:
            raise SystemExit("bench/moe.py --parts lora: PEFT is not installed (pip install peft), or leave lora out")
        report["lora"] = lora_part(args, size, ckpt, data_dir, tmp, command)
    return report


def merged(report: dict, out: Path | None, parts: list[str]) -> dict:
    """`report` over the report at `out` of the same model: the parts not rerun stay as measured there (each part
    says its command). A different model's, or no earlier report: `report` alone."""
    if out is None or not out.exists() or set(parts) == set(PARTS):
        return report
    old = json.loads(out.read_text())
    if old.get("model") != report["model"]:
        return report
    if {"layer", "step"} & set(parts):
        old.pop("profile", None)  # of the earlier run's layer and step
    return old | report


def table(report: dict) -> str:
    m = report["model"]
    head = (
        f"Qwen3-MoE {report['size']}: H {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_experts']} "
        f"experts (top {m['num_experts_per_tok']}, width {m['moe_intermediate_size']}), vocab {m['vocab_size']}, "
        f"batch {m['batch']} x {m['seq']}; fp32\n"
    )
    out = [head]
    if "step" in report or "layer" in report:
        out.append(main_table(report))
    if "lora" in report:
        out.append(lora_table(report["lora"]))
    return "\n".join(out)


def main_table(report: dict) -> str:
    """The layer and step parts as a markdown table, with their command."""
    rows = [
        f"{report['steps']} timed steps after {report['warmup']}, {report['rounds']} rounds; fitlm's grouped matmul "
        f"on CPU: {report['grouped_mm_on_cpu']}",
        "",
        "| contender | layer fwd+bwd ms | layer tokens/s | layer ratio | layer peak MiB | step ms | step tokens/s "
        "| step ratio | step peak MiB | loss diff vs fitlm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    layer, step = report.get("layer", {}), report.get("step", {})
    for n in {**layer, **step}:
        cells = []
        if n in layer:
            ly = layer[n]
            cells += [f"{ly['median_s'] * 1e3:.1f}", f"{ly['tokens_per_s']:,.0f}", f"{ly['ratio_vs_fitlm']:.2f}"]
            cells += [f"{ly['peak_bytes'] / 2**20:.1f}"]
        else:
            cells += [""] * 4
        if n in step:
            s = step[n]
            cells += [f"{s['median_s'] * 1e3:.0f}", f"{s['tokens_per_s']:,.0f}", f"{s['ratio_vs_fitlm']:.2f}"]
            cells += [f"{s['peak_bytes'] / 2**20:.1f}", f"{s['loss_max_abs_diff']:.1e}"]
        else:
            cells += [""] * 5
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + f"\n\n`{report['command']}`\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hf-impls", nargs="+", default=list(HF_IMPLS))
    p.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="what to run; with --out an earlier report of the same model keeps the other parts",
    )
    p.add_argument(
        "--lora-experts",
        choices=["all", "down_proj"],
        default="all",
        help="expert projections with adapters (down_proj alone: both sides have the same parameters)",
    )
    p.add_argument("--lora-hf-impl", default="grouped_mm", help="transformers' experts implementation under PEFT")
    p.add_argument("--profile", action="store_true", help="torch.profiler's top ops of one layer call and step")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/moe.json without --json)")
    p.add_argument("--markdown", nargs="?", const=str(RESULTS / "moe.json"), help="print the table of a JSON report")
    args = p.parse_args(argv)
    if args.markdown:
        print(table(json.loads(Path(args.markdown).read_text())))
        return
    with contextlib.redirect_stdout(sys.stderr):
        report = run(args)
    out = args.out or (None if args.json else RESULTS / "moe.json")
    report = merged(report, out, args.parts)
    emit(report, table, out, args.json)


if __name__ == "__main__":
    main()
