"""The worst-case routing plan (fitlm/plan/routing.py) against `fitlm profile` when routing is skewed: a
transformers-made Qwen3-MoE whose router sends every token to experts 0 and 1 (rank 0's under expert parallel 2),
profiled dp2 × ep2 under gloo from a config whose model section is `init_from` alone. Rank 0's experts then run
both ranks' slots, twice the balanced share, and its measured peak exceeds the balanced plan; the worst case
planned from the profile's own expert load (dropless) or from model.capacity_factor holds it, within 5% above, and
`--simulate`'s worst case (the fake step with rank 0's experts receiving that many times their rows) meets it
within 3%.

How the router is skewed: the embedding's first coordinate is 4 for every token (the rest stays at the 0.02
initialisation), so the normalised input of every block's router is large and positive there, and the router's
rows are +10 (experts 0, 1) and -10 (experts 2, 3) on that coordinate and 0 elsewhere."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import fitlm, write_config

MOE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}
BOUND = 0.05  # how far above the measured peak the worst case may plan
SIMULATED = 0.03  # how far from the measured peak the simulated worst case may be


def skewed_qwen3_moe(path):
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("qwen3_moe", **MOE))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        for layer in model.model.layers:
            router = layer.mlp.gate.weight  # [E, H]
            router.zero_()
            router[:2, 0], router[2:, 0] = 10.0, -10.0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def skewed(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("skew")
    cfg = {
        "model": {"init_from": str(skewed_qwen3_moe(root / "hf"))},
        "data": {"train": str(tiny_corpus["train"]), "seq_length": 64},
        "parallel": {"data_parallel": 2, "expert_parallel": 2},
        "train": {"max_steps": 8, "micro_batch_size": 2, "lr": 1e-4, "eval_interval": 0, "progress": False,
                  "output_dir": str(root / "run"), "peak_tflops": 1.0},
    }  # fmt: skip
    return write_config(root / "cfg.yaml", cfg), root


def _profile(config, out, *overrides) -> dict:
    proc = fitlm("profile", config, "--steps", "2", "--out", out, "--json", *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _routing(config, *args) -> dict:
    proc = fitlm("plan", config, "--device", "cpu", "--json", "--simulate", *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)["routing"]


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, 1.5], ids=["dropless", "capacity 1.5"])
def test_the_worst_case_holds_a_profile_whose_router_sends_every_token_to_one_rank(skewed, capacity):
    config, root = skewed
    overrides = ("--set", f"model.capacity_factor={capacity}") if capacity else ()
    out = root / f"profile-{capacity}"
    profiled = _profile(config, out, *overrides)
    assert profiled["expert_load"] == 2.0  # every slot on 2 of the 4 experts: E / k, the most there is
    assert profiled["most_loaded_rank"] == 0  # the rank holding experts 0 and 1
    measured = profiled["per_device"]["total"]
    routing = _routing(config, "--expert-load", out, *overrides)
    assert routing["imbalance"] == (capacity or 2.0)
    balanced, worst = routing["balanced"]["total"], routing["worst_case"]["total"]
    assert balanced == profiled["plan"]["analytic"]["per_device"]["total"]
    simulated = routing["simulated_worst_case"]["total"]
    print(
        f"\nskewed {capacity=}: measured {measured:,} balanced {balanced:,} worst case {worst:,} "
        f"({worst / measured - 1:+.1%}) simulated worst case {simulated:,} ({simulated / measured - 1:+.1%})"
    )
    assert balanced < measured <= worst <= measured * (1 + BOUND)
    assert simulated == pytest.approx(measured, rel=SIMULATED)
