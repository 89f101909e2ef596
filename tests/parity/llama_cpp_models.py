"""Tiny transformers-made checkpoints with real tokenizers of each kind llama.cpp reads, for tests/parity/test_llama_cpp.py.

Byte-level BPE tokenizers (tokenizers' trainer, saved by transformers) with the split rule of Llama 3, Qwen2,
SmolLM, Mistral Nemo (Tekken) and DeepSeek-V3, plus fitlm's own `fitlm data tokenizer` BPE (GPT-2's rule).
SentencePiece tokenizers trained by the sentencepiece library (BPE with byte fallback) and converted by
transformers' own LlamaTokenizer / GemmaTokenizer, as the Llama 2, Mistral v0.x, Phi-3 and Gemma repositories
hold them. Chat templates are the models' own formats (with a system turn), in the spelling llama.cpp recognises.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fitlm.data.gguf_vocab import _DEEPSEEK3, _TEKKEN
from tests.parity.test_families import randomize
from tests.unit.model_tokenizers import QWEN_TEMPLATE, STYLES, corpus, hf_dir

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma 3's rule for a system turn: its text opens the first user turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _digits_then_gpt2():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


def _deepseek3():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(r), "isolated") for r in _DEEPSEEK3),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


BPE_STYLES = {  # style -> STYLES-like entry (tests/unit/model_tokenizers.py)
    "llama3": STYLES["llama3"],
    "qwen": {**STYLES["qwen"], "template": QWEN_TEMPLATE},
    "smollm": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": "<|im_start|>",
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "pre": _digits_then_gpt2,
        "template": CHATML,
        "end_of_turn": "<|im_end|>",
        "config": {"add_bos_token": False},
    },
    "tekken": {
        "specials": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "bos": "<s>",
        "eos": "</s>",
        "pad": "<unk>",
        "split": _TEKKEN,
        "template": None,
    },
    "deepseek3": {
        "specials": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
        "bos": "<｜begin▁of▁sentence｜>",
        "eos": "<｜end▁of▁sentence｜>",
        "pad": "<｜end▁of▁sentence｜>",
        "pre": _deepseek3,
        "template": None,
    },
}
LLAMA2_STYLE = ("<unk>", "<s>", "</s>")


def _sentencepiece_model(root: Path) -> Path:
    """A SentencePiece BPE model (byte fallback, digits split, whitespace kept) trained on the test corpus."""
    import sentencepiece as spm

    out = root / "sp.model"
    if not out.is_file():
        (root / "corpus.txt").write_text("\n".join(corpus()), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(root / "corpus.txt"),
            model_prefix=str(root / "sp"),
            vocab_size=1500,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=0.98,
            split_digits=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False,
            normalization_rule_name="identity",
            minloglevel=2,
        )
    return out


def spm_dir(style: str, root: Path) -> Path:
    """A SentencePiece tokenizer as transformers converts it: llama2 (Llama 2 / Mistral v0.x), phi3 (Llama 2's
    vocabulary plus Phi-3's turn tokens) or gemma (no space prefix, Gemma's specials and turns)."""
    from transformers import GemmaTokenizer, LlamaTokenizer

    src = root / f"src-{style}"
    src.mkdir(parents=True, exist_ok=True)
    shutil.copy(_sentencepiece_model(root), src / "tokenizer.model")
    cls = GemmaTokenizer if style == "gemma" else LlamaTokenizer
    tok = cls.from_pretrained(src, add_bos_token=True)
    if style == "gemma":
        tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
        tok.chat_template = GEMMA3_TEMPLATE
    elif style == "phi3":  # Phi-3's vocabulary: Llama 2's, then <|endoftext|> (its EOS) and the turn markers
        tok.add_special_tokens(
            {
                "eos_token": "<|endoftext|>",
                "additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
            }
        )
        tok.chat_template = PHI3_TEMPLATE
    out = root / style
    tok.save_pretrained(out)
    (out / "tokenizer.model").unlink(missing_ok=True)  # fitlm reads tokenizer.json, as transformers does
    if style == "gemma":
        (out / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [tok.convert_tokens_to_ids(t) for t in ("<eos>", "<end_of_turn>")]})
        )
    if style == "phi3":
        (out / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|end|>")]})
        )
    return out


def fitlm_bpe_dir(root: Path) -> Path:
    """fitlm's own tokenizer (`fitlm data tokenizer`: byte-level BPE with GPT-2's split) with a ChatML template."""
    from fitlm.data.prep.tokenizer_train import train_tokenizer
    from tests.conftest import PLAYS

    out = root / "fitlm"
    train_tokenizer([PLAYS / "macbeth_gut.txt"], 600, out / "tokenizer.json")
    return out


def tokenizer_dir(style: str, root: Path) -> Path:
    if style == "fitlm":
        return fitlm_bpe_dir(root)
    if style in ("llama2", "phi3", "gemma"):
        return spm_dir(style, root)
    s = BPE_STYLES[style]
    STYLES.setdefault(f"llama.cpp:{style}", s)
    try:  # SmolLM names a BOS (<|im_start|>) that its tokenizer never adds
        return hf_dir(f"llama.cpp:{style}", root, post_bos=style != "smollm")
    finally:
        STYLES.pop(f"llama.cpp:{style}")


# name -> (transformers model_type, config overrides, tokenizer style)
# Rows 256 wide, so llama.cpp's k-quants use their own block types (narrower rows fall back to legacy ones).
KQUANT_CASE = (
    "llama",
    dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, tie_word_embeddings=False),
    "llama3",
)
# The MoE families' k-quants: experts and their rows 256 wide (llama.cpp's k-quant blocks), every block routed.
KQUANT_MOE_CASES = {
    "qwen3-moe": (
        "qwen3_moe",
        dict(
            hidden_size=256,
            head_dim=64,
            moe_intermediate_size=256,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        "qwen",
    ),
    "qwen2-moe": (
        "qwen2_moe",
        dict(
            hidden_size=256,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=256,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
        "qwen",
    ),
    "mixtral": (
        "mixtral",
        dict(hidden_size=256, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2),
        "llama2",
    ),
}
CASES = {
    "llama3": ("llama", dict(tie_word_embeddings=True), "llama3"),
    "llama2": ("llama", dict(tie_word_embeddings=False), "llama2"),
    "smollm": ("llama", dict(tie_word_embeddings=True), "smollm"),
    "fitlm-bpe": ("llama", dict(tie_word_embeddings=True), "fitlm"),
    "mistral-nemo": ("mistral", dict(head_dim=16, tie_word_embeddings=False), "tekken"),
    "deepseek-v3-vocab": ("llama", dict(tie_word_embeddings=False), "deepseek3"),
    "qwen2.5": ("qwen2", dict(tie_word_embeddings=True), "qwen"),
    "qwen3": ("qwen3", dict(head_dim=16, tie_word_embeddings=True), "qwen"),
    "phi3": ("phi3", dict(tie_word_embeddings=False), "phi3"),
    "gemma2": (
        "gemma2",
        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True),
        "gemma",
    ),
    "gemma3": (
        "gemma3_text",
        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True),
        "gemma",
    ),
    "gemma3-untied": (
        "gemma3_text",
        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=False),
        "gemma",
    ),
    # Mixtures of experts, as llama.cpp's graphs run them: every block routed; qwen3moe and Mixtral renormalize
    # the top-k weights, qwen2moe does not and adds its gated shared expert.
    "qwen3-moe": (
        "qwen3_moe",
        dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        "qwen",
    ),
    "qwen2-moe": (
        "qwen2_moe",
        dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=3),
        "qwen",
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False), "llama2"),
}


def build(name: str, root: Path, spread: bool = True, case: tuple | None = None) -> Path:
    """Directory with the case's tokenizer files and a random transformers checkpoint of its vocabulary size: every
    weight spread away from its initial value (tests/parity/test_families.randomize), or, `spread` False,
    transformers' own initialisation (std 0.02: activations that stay in range through quantization, as a trained
    model's do). `case`: a (model_type, overrides, style) of its own instead of CASES[name]."""
    from tokenizers import Tokenizer

    model_type, overrides, style = case or CASES[name]
    d = tokenizer_dir(style, root)
    n = max(Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True).values()) + 1
    shape = dict(
        vocab_size=n,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    cfg = AutoConfig.for_model(model_type, **{**shape, **overrides})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).float().eval()
    if spread:
        randomize(hf, seed=len(name))
    hf.save_pretrained(d)
    return d
