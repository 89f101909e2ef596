"""Tiny chat models for the serve tests: a transformers-made checkpoint with a real family tokenizer.

`chat_model_dir` saves a random Qwen2 (or Llama) of hidden 32, 2 layers with `save_pretrained` and puts one
of tests/unit/model_tokenizers.py's tokenizers (ChatML for Qwen, Llama 3's headers) beside it, so MODEL is
an ordinary Hugging Face directory with a chat template. Weights are drawn large enough that the greedy
tokens are far from ties (a near-tie could flip under any float reordering and make equality tests flaky).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.unit.model_tokenizers import hf_dir

FAMILIES = {"qwen": "qwen2", "llama3": "llama"}


def chat_model_dir(root: Path, style: str = "qwen", context: int = 256, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    tok_dir = hf_dir(style, root / "tokenizers")
    vocab = max(__import__("json").loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"].values()) + 8
    cfg = AutoConfig.for_model(
        FAMILIES[style],
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(hf.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_((1.0 + 0.1 * noise) if "norm" in name else (0.3 * noise if p.dim() > 1 else 0.1 * noise))
    out = root / f"{style}-chat"
    hf.save_pretrained(out)
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def models_beside_runs(root: Path, run: Path, cli) -> dict[str, Path]:
    """Model directories as a user leaves them under RUNS_DIR next to `run` (a finished training output): a
    transformers-made checkpoint through `fitlm import`, `run` through `fitlm export --format hf`, and a GGUF
    export. `cli(*args)` runs a fitlm command (in process or as a process) and returns its exit status."""
    src = chat_model_dir(root.parent / "hf-source")  # outside RUNS_DIR: only what fitlm wrote is under it
    out = {"imported": root / "imported", "exported": root / "exported", "gguf": root / "exported.gguf"}
    assert cli("import", str(src), "--out", str(out["imported"])) == 0
    assert cli("export", str(run), "--format", "hf", "--out", str(out["exported"])) == 0
    assert cli("export", str(run), "--format", "gguf", "--out", str(out["gguf"])) == 0
    return out
