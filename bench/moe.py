"""Expert compute: fitlm's MoE layer and training step beside transformers' on the same Qwen3-MoE and batch
(issue #38).

Not a test: it prints a table (stderr with --json) and writes JSON; it asserts nothing. One process:

* builds a Qwen3-MoE with transformers (`AutoConfig.for_model("qwen3_moe")`, `from_config`, seeded init),
  saves it, and loads that directory into fitlm (`model.init_from`): the same weights on both sides;
* contenders: fitlm (GroupedExperts on its grouped-matmul path where torch has the kernel:
  fitlm.models.moe.grouped_mm_supported), `fitlm_loop` (the same with the per-expert loop forced), and
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
  (`loss_max_abs_diff` over the timed run; the first step starts from the same weights and batch).

    python bench/moe.py [--json] [--size small|tiny] [--steps 4] [--warmup 2] [--rounds 3]
                        [--hf-impls eager batched_mm grouped_mm] [--profile] [--out bench/results/moe.json]
    python bench/moe.py --markdown [bench/results/moe.json]   # the RESULTS.md table

How to read it: `*_tokens_per_s` = B·T / median time; `ratio` = the contender's time / fitlm's, > 1 means
fitlm is faster; `peak MiB` are live-tensor peaks (lower is better).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, fitlm_config, log, machine, median, prepare_data, profile_step, write_json  # noqa: E402

SIZES = {
    # a small Qwen3-MoE: 16 experts, 4 per token, ~256 rows per expert at batch 4 x 256
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "moe_intermediate_size": 256,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "vocab_size": 2048,
        "batch": 4,
        "seq": 256,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 1024,
        "batch": 2,
        "seq": 32,
    },
}
HF_IMPLS = ("eager", "batched_mm", "grouped_mm")
LR, WD, BETAS, EPS, CLIP, AUX_COEF = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0, 0.001


@contextlib.contextmanager
def loop_path():
    """fitlm's GroupedExperts with the per-expert loop forced (the grouped matmul reported unsupported)."""
    import fitlm.models.moe as moe

    saved = moe.grouped_mm_supported
    moe.grouped_mm_supported = lambda device, dtype, traced=False: False
    try:
        yield
    finally:
        moe.grouped_mm_supported = saved


def hf_checkpoint(size: dict, out: Path) -> Path:
    """A seeded transformers Qwen3-MoE saved to `out` (fp32, eager-free sdpa attention, no cache)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = {k: v for k, v in size.items() if k not in ("batch", "seq")}
    cfg = AutoConfig.for_model(
        "qwen3_moe",
        **dims,
        max_position_embeddings=size["seq"],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        router_aux_loss_coef=AUX_COEF,
        output_router_logits=True,
        use_cache=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(out)
    return out


def hf_model(path: Path, impl: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.float().train()


def batches_for(cfg, n: int) -> list[dict]:
    """The first n batches fitlm's Trainer reads (same dataset, seed and loader)."""
    from fitlm.data.dataset import PackedDataset
    from fitlm.data.loader import SequenceLoader

    loader = SequenceLoader.from_config(
        PackedDataset(cfg.data.train), cfg.data, cfg.train.micro_batch_size, seed=cfg.train.seed, shuffle=True
    )
    return [next(loader) for _ in range(n)]


# --------------------------------------------------------------------------- contenders: the step


def fitlm_contender(ckpt: Path, data_dir: Path, out: Path, size: dict, loop: bool):
    """(step() -> (token loss, aux loss), its Trainer)."""
    from fitlm.models.hf import read_hf_config
    from fitlm.train.trainer import Trainer

    model = read_hf_config(ckpt).model_dump(exclude_unset=True) | {"init_from": str(ckpt)}
    train = {"lr_schedule": "constant", "lr": LR, "weight_decay": WD, "grad_clip": CLIP, "eps": EPS}
    train |= {"beta1": BETAS[0], "beta2": BETAS[1]}
    cfg = fitlm_config(model, data_dir, out, size["batch"], size["seq"], {"loss_chunk_size": 0}, **train)
    trainer = Trainer(cfg)
    batches = iter(trainer.loader)
    state = {"step": 0}

    def step():
        state["step"] += 1
        with loop_path() if loop else contextlib.nullcontext():
            o = trainer.train_step(state["step"], batches)
        return float(o.loss), float(trainer.step.balance.metrics.get("aux_loss", float("nan")))

    return step, trainer


def hf_contender(model, batches: list[dict]):
    """(step() -> (token loss, aux loss), optimizer): the model's own loss + coef · aux, clip, AdamW."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, eps=EPS, foreach=True)
    it = iter(range(10**9))

    def step():
        b = batches[next(it) % len(batches)]
        out = model(input_ids=b["input_ids"], labels=b["labels"], shift_labels=b["labels"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = float(out.aux_loss.detach())
        return float(out.loss.detach()) - model.config.router_aux_loss_coef * aux, aux

    return step, opt


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


def run(args) -> dict:
    import torch

    from fitlm.memory.tracking import peak_live_bytes
    from fitlm.models.hf import load_hf_dir
    from fitlm.models.moe import grouped_mm_supported, moe_layers

    size = SIZES[args.size]
    tmp = Path(tempfile.mkdtemp(prefix="bench_moe_"))
    data_dir = prepare_data(tmp / "data", tokenizer_vocab=min(1024, size["vocab_size"]))
    ckpt = hf_checkpoint(size, tmp / "hf")
    tokens = size["batch"] * size["seq"]
    steps = args.warmup + args.steps

    # ---- (a) the MoE layer alone
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
        per = {n: [] for n in calls}
        for _ in range(steps):
            for name, call in calls.items():
                t0 = time.perf_counter()
                call()
                per[name].append(time.perf_counter() - t0)
        for n in calls:
            layer_times[n].append(per[n])
    layer_peak = {n: peak_live_bytes(call, [layers[n][0]], None, warmup_steps=1)["total"] for n, call in calls.items()}
    layer_prof = {n: profile_step(calls[n], f"layer {n}", rows=8) for n in calls} if args.profile else {}
    del calls
    hf_models.clear()
    gc.collect()

    # ---- (b) the training step
    step_times: dict[str, list[list[float]]] = {}
    losses: dict[str, list[tuple[float, float]]] = {}
    step_peak: dict[str, int] = {}
    step_prof: dict[str, list] = {}
    for r in range(args.rounds):
        log(f"[{args.size}] round {r + 1}/{args.rounds}: fitlm, fitlm_loop, transformers {' '.join(args.hf_impls)}")
        contenders, holders = {}, {}
        fit_step, fit_trainer = fitlm_contender(ckpt, data_dir, tmp / f"fit{r}", size, loop=False)
        contenders["fitlm"], holders["fitlm"] = fit_step, (fit_trainer.pm.modules, fit_trainer.step.optimizer)
        loop_step, loop_trainer = fitlm_contender(ckpt, data_dir, tmp / f"loop{r}", size, loop=True)
        contenders["fitlm_loop"] = loop_step
        holders["fitlm_loop"] = (loop_trainer.pm.modules, loop_trainer.step.optimizer)
        batches = batches_for(fit_trainer.cfg, steps + 2)
        for impl in args.hf_impls:
            if f"hf_{impl}" not in layers:
                continue
            model = hf_model(ckpt, impl)
            contenders[f"hf_{impl}"], opt = hf_contender(model, batches)
            holders[f"hf_{impl}"] = ([model], opt)
        per = {n: [] for n in contenders}
        for _ in range(steps):
            for name, step in contenders.items():
                t0 = time.perf_counter()
                out = step()
                per[name].append(time.perf_counter() - t0)
                if r == 0:
                    losses.setdefault(name, []).append(out)
        for n in contenders:
            step_times.setdefault(n, []).append(per[n])
        if r == 0:
            for n, step in contenders.items():
                step_peak[n] = peak_live_bytes(step, *holders[n], warmup_steps=0)["total"]
            if args.profile:
                step_prof = {n: profile_step(step, f"step {n}", rows=8) for n, step in contenders.items()}
        del contenders, holders, fit_trainer, loop_trainer
        gc.collect()

    def summary(times: dict[str, list[list[float]]]) -> dict:
        out = {}
        for n, rounds in times.items():
            meds = [median(t[args.warmup :]) for t in rounds]
            ratios = [median(t[args.warmup :]) / median(f[args.warmup :]) for t, f in zip(rounds, times["fitlm"])]
            out[n] = {
                "median_s": round(median(meds), 6),
                "tokens_per_s": round(tokens / median(meds), 1),
                "ratio_vs_fitlm": round(median(ratios), 3),
                "round_median_s": [round(m, 6) for m in meds],
            }
        return out

    layer = summary(layer_times)
    step = summary(step_times)
    for n in layer:
        layer[n]["peak_bytes"] = layer_peak[n]
        layer[n]["max_abs_diff_vs_fitlm"] = layer_diff[n]
    fit_losses = losses["fitlm"]
    for n in step:
        step[n]["peak_bytes"] = step_peak[n]
        step[n]["losses"] = [[round(a, 6), round(b, 6)] for a, b in losses[n]]
        step[n]["loss_max_abs_diff"] = max(abs(a - fa) for (a, _), (fa, _) in zip(losses[n], fit_losses))
        step[n]["aux_loss_max_abs_diff"] = max(abs(b - fb) for (_, b), (_, fb) in zip(losses[n], fit_losses))
    report = {
        "benchmark": "moe",
        "machine": machine(),
        "command": "python bench/moe.py " + " ".join(sys.argv[1:]),
        "size": args.size,
        "model": size,
        "tokens_per_step": tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "grouped_mm_on_cpu": grouped_mm_supported(torch.device("cpu"), torch.float32),
        "layer": layer,
        "step": step,
    }
    if args.profile:
        report["profile"] = {"layer": layer_prof, "step": step_prof}
    return report


def table(report: dict) -> str:
    m = report["model"]
    head = (
        f"Qwen3-MoE {report['size']}: H {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_experts']} "
        f"experts (top {m['num_experts_per_tok']}, width {m['moe_intermediate_size']}), vocab {m['vocab_size']}, "
        f"batch {m['batch']} x {m['seq']}; fp32, {report['steps']} timed steps after {report['warmup']}, "
        f"{report['rounds']} rounds; fitlm's grouped matmul on CPU: {report['grouped_mm_on_cpu']}\n"
    )
    rows = [
        "| contender | layer fwd+bwd ms | layer tokens/s | layer ratio | layer peak MiB | step ms | step tokens/s "
        "| step ratio | step peak MiB | loss diff vs fitlm |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s in report["step"].items():
        ly = report["layer"][n]
        rows.append(
            f"| {n} | {ly['median_s'] * 1e3:.1f} | {ly['tokens_per_s']:,.0f} | {ly['ratio_vs_fitlm']:.2f} "
            f"| {ly['peak_bytes'] / 2**20:.1f} | {s['median_s'] * 1e3:.0f} | {s['tokens_per_s']:,.0f} "
            f"| {s['ratio_vs_fitlm']:.2f} | {s['peak_bytes'] / 2**20:.1f} | {s['loss_max_abs_diff']:.1e} |"
        )
    return head + "\n".join(rows) + f"\n\n`{report['command']}`\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hf-impls", nargs="+", default=list(HF_IMPLS))
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
    if out:
        write_json(out, report)
    if args.json:
        log(table(report))
        print(json.dumps(report))
    else:
        print(table(report))


if __name__ == "__main__":
    main()
