"""The whole matrix, run by hand (not collected by pytest): every family x every layout of test_layouts.py, tied
and untied, each against its family's single-process run (losses, gradient norms, eval loss and final weights as
assert_same_training holds them), in shared torchrun worlds. Prints one row per case: ok, refused (the rule's
message) or the first line of the mismatch. CI runs the layouts on Llama (test_layouts.py) and two layouts on
every family (test_family_layouts.py), every layout and expert parallel's (MOE_LAYOUTS) on Qwen3-MoE
(test_layouts.py); this is the sweep behind them.

    python -m tests.distributed.layout_matrix [--families qwen3 gemma2 ...] [--layouts tp2 pp2-1f1b ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.conftest import PLAYS
from tests.distributed.test_family_layouts import FAMILIES, MIXTRAL_PP
from tests.distributed.test_layouts import LAYOUTS, MOE_LAYOUTS, REFERENCE, assert_same_training, run_shared

ALL_FAMILIES = {
    "llama": {},
    **FAMILIES,
    # Mixtral's every block sparse (qwen3_moe's FAMILIES row has a dense one); aux loss off as there
    "mixtral": {**MIXTRAL_PP, "num_layers": 2, "router_aux_loss_coef": 0.0},
    "gpt2": {"arch": "gpt2", "num_kv_heads": 4},
}


def corpus(root: Path) -> dict:
    from fitlm.data.prep.pack import pack_corpus
    from fitlm.data.prep.tokenizer_train import train_tokenizer

    tok = train_tokenizer([PLAYS / "macbeth_gut.txt", PLAYS / "tempest_gut.txt"], 512, root / "tokenizer.json")
    pack_corpus([PLAYS / "macbeth_gut.txt"], tok, root / "train", show_progress=False)
    pack_corpus([PLAYS / "tempest_gut.txt"], tok, root / "valid", show_progress=False)
    return {"tokenizer": tok, "train": root / "train", "valid": root / "valid"}


def verdict(result: dict, reference: dict) -> str:
    if "error" in reference:
        return "reference refused: " + reference["error"].splitlines()[-1][:160]
    if "error" in result:
        return "refused: " + " ".join(result["error"].split())[:200]
    try:
        assert_same_training(result, reference)
    except AssertionError as exc:
        return "MISMATCH: " + " ".join(str(exc).split())[:200]
    return "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=list(ALL_FAMILIES))
    ap.add_argument("--layouts", nargs="*", help="default: every layout (MoE families: and MOE_LAYOUTS')")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="fitlm-matrix-"))
    root.mkdir(parents=True, exist_ok=True)
    data = corpus(root)
    cases, wanted = {}, []
    for family in args.families:
        for tied in (True, False):
            tie = "tied" if tied else "untied"
            moe = bool(ALL_FAMILIES[family].get("num_experts"))
            for layout in args.layouts or [*LAYOUTS, *(MOE_LAYOUTS if moe else ())]:
                parallel, train, extra = {**LAYOUTS, **MOE_LAYOUTS}[layout]
                model = {**ALL_FAMILIES[family], **(extra or {}), "tie_embeddings": tied}
                if extra and "layer_types" in model:  # a deeper model repeats the family's layer pattern
                    pattern = model["layer_types"]
                    model["layer_types"] = [pattern[i % len(pattern)] for i in range(model["num_layers"])]
                ref = f"{family}-{tie}-single" + ("-deep" if extra else "")
                cases[ref] = {"parallel": {}, "train": REFERENCE, "model": model}
                cases[f"{family}-{tie}-{layout}"] = {"parallel": parallel, "train": train, "model": model}
                wanted.append((family, tie, layout, ref))
    runs = run_shared(data, root, cases, timeout=3600, keep_going=True)
    print("| family | embeddings | layout | result |\n|---|---|---|---|")
    for family, tie, layout, ref in wanted:
        print(f"| {family} | {tie} | {layout} | {verdict(runs[f'{family}-{tie}-{layout}'], runs[ref])} |")


if __name__ == "__main__":
    main()
