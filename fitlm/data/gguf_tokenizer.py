"""GGUF tokenizer metadata (llama.cpp's format) -> Hugging Face tokenizer files, so a model imported from
GGUF keeps its vocabulary, its special tokens and its chat template.

`write_gguf_tokenizer` (used by `fitlm import model.gguf --out DIR`) writes:

    tokenizer.json          the vocabulary as a `tokenizers` pipeline (below)
    tokenizer_config.json   bos/eos/pad/unk names and add_bos_token/add_eos_token (tokenizer.ggml.*)
    generation_config.json  bos/pad ids and every id generation stops at: eos, eot, eom
    chat_template.jinja     tokenizer.chat_template

Vocabularies (tokenizer.ggml.model):
  "gpt2"   byte-level BPE (tokens + merges). tokenizer.ggml.pre names the split rule, which becomes the
           pre-tokenizer (and normalizer) of the model's Hugging Face tokenizer: llama-bpe, qwen2, smollm,
           gpt-2, tekken, deepseek-v3/-llm/-coder, gpt-4o and their aliases (fitlm.data.gguf_vocab.RULES).
  "llama"  SentencePiece (tokens + scores + token types: Llama 2, Phi-3, Gemma), as transformers' converter
           writes it: BPE with byte fallback, merges ranked by piece score, spaces as "▁" with a "▁" put
           before each text unless tokenizer.ggml.add_space_prefix is false.
A GGUF that embeds its tokenizer.json (tokenizer.huggingface.json) keeps it as is. Other vocabularies
(bert, t5, rwkv, ...) and other split rules raise UnsupportedTokenizer: the import keeps the weights
and says the tokenizer was not converted. llama.cpp's "default" rule (a file that names none) is read as
GPT-2's, which splits a few rare cases (runs of punctuation before letters) differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fitlm.data.conventions import CONFIG_FILE, GENERATION_FILE, TEMPLATE_FILE
from fitlm.data.errors import DataError
from fitlm.data.gguf_vocab import (
    BYTE,
    BYTE_PIECE,
    CONTROL,
    IGNORE_MERGES,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    known_names,
    rule_tokenizer_json,
)

_K = "tokenizer.ggml."


class UnsupportedTokenizer(DataError):
    """A GGUF vocabulary fitlm does not convert; the model can still be imported without it."""


def _token_id(meta: dict[str, Any], key: str, n: int, source: str) -> int | None:
    value = meta.get(_K + key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n:
        raise DataError(
            f"{source}: {_K}{key} = {value!r} is not a token id (the vocabulary has {n} tokens); "
            f"re-convert the model with llama.cpp's convert_hf_to_gguf.py or fix that key"
        )
    return value


def _token_types(meta: dict[str, Any], tokens: list[str], source: str) -> list[int]:
    types = meta.get(_K + "token_type")
    if types is None:  # older files: byte pieces by their spelling, everything else normal
        return [BYTE if BYTE_PIECE.fullmatch(t) else NORMAL for t in tokens]
    if len(types) != len(tokens):
        raise DataError(
            f"{source}: {_K}token_type has {len(types)} entries for {len(tokens)} tokens; re-convert "
            "the model with llama.cpp's convert_hf_to_gguf.py"
        )
    return [int(t) for t in types]


def _first_ids(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated token (padding entries) keeps its first id; the rest stay unused
    return vocab


def _byte_level(meta: dict[str, Any], tokens: list[str], source: str):
    from tokenizers import Tokenizer, decoders, models

    pre = meta.get(_K + "pre") or "default"
    split = rule_tokenizer_json(pre)
    if split is None:
        raise UnsupportedTokenizer(
            f"{source}: {_K}pre {pre!r} names a split rule fitlm does not reproduce (it does "
            f"{', '.join(known_names())}); to use this model's tokenizer, copy its "
            "tokenizer.json and tokenizer_config.json from the Hugging Face repository into "
            "the imported directory"
        )
    vocab = _first_ids(tokens)
    merges = []
    for m in meta.get(_K + "merges") or []:
        a, sep, b = m.partition(" ")
        if not sep or a not in vocab or b not in vocab:
            raise DataError(
                f"{source}: {_K}merges holds {m!r}, which is not two tokens of the vocabulary; "
                "re-convert the model with llama.cpp's convert_hf_to_gguf.py"
            )
        merges.append((a, b))
    if not merges:
        raise DataError(
            f"{source}: {_K}model is gpt2 (byte-level BPE) but {_K}merges is missing or empty; "
            "re-convert the model with llama.cpp's convert_hf_to_gguf.py"
        )
    # llama.cpp's Llama 3 and Tekken rules take a piece that is a whole token before merging (ignore_merges), as
    # those models' tokenizer.json files say.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES))
    rebuilt = Tokenizer.from_str(json.dumps({**json.loads(tok.to_str()), **split}))
    rebuilt.decoder = decoders.ByteLevel()
    return rebuilt


def _sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int], source: str):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get(_K + "scores")
    if scores is None or len(scores) != len(tokens):
        raise DataError(
            f"{source}: {_K}model is llama (SentencePiece) but {_K}scores is missing or does not match "
            f"the {len(tokens)} tokens; fitlm ranks the merges by those scores. Re-convert the model "
            "with llama.cpp's convert_hf_to_gguf.py"
        )
    vocab = _first_ids(tokens)
    normal = {t: i for t, i in vocab.items() if types[i] == NORMAL}
    # A piece is made from any two pieces that spell it; higher score merges first, ties by id (as
    # transformers' SentencePiece converter orders them).
    ranked = sorted(
        (-float(scores[i]), i, normal[p[:k]], normal[p[k:]], p[:k], p[k:])
        for p, i in normal.items()
        for k in range(1, len(p))
        if p[:k] in normal and p[k:] in normal
    )
    unk = next((t for t, i in vocab.items() if types[i] == UNKNOWN), None)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    prefix = bool(meta.get(_K + "add_space_prefix", True))
    spaces = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*decs, decoders.Strip(" ", 1, 0)] if prefix else decs)
    return tok


def gguf_tokenizer_files(meta: dict[str, Any], source: str) -> dict[str, str]:
    """File name -> text of the Hugging Face tokenizer files for GGUF metadata `meta` (see the module doc)."""
    from tokenizers import AddedToken, Tokenizer, processors

    kind, tokens = meta.get(_K + "model"), meta.get(_K + "tokens")
    if kind is None or not tokens:
        raise UnsupportedTokenizer(f"{source} carries no tokenizer ({_K}model / {_K}tokens are absent)")
    if kind not in ("gpt2", "llama") and "tokenizer.huggingface.json" not in meta:
        raise UnsupportedTokenizer(
            f"{source}: {_K}model {kind!r} is not converted by fitlm (it converts gpt2 = "
            "byte-level BPE and llama = SentencePiece); copy the model's tokenizer.json and "
            "tokenizer_config.json from its Hugging Face repository into the imported directory"
        )
    n = len(tokens)
    ids = {k: _token_id(meta, f"{k}_token_id", n, source) for k in ("bos", "eos", "padding", "unknown", "eot", "eom")}
    if ids["eos"] is None:
        raise DataError(
            f"{source}: {_K}eos_token_id is missing; fitlm needs the EOS token to end documents and "
            "generation. Re-convert the model with llama.cpp's convert_hf_to_gguf.py"
        )
    types = _token_types(meta, tokens, source)
    add_bos = bool(meta.get(_K + "add_bos_token", kind == "llama"))  # llama.cpp's defaults per vocabulary
    add_eos = bool(meta.get(_K + "add_eos_token", False))
    name = {k: None if i is None else tokens[i] for k, i in ids.items()}
    if "tokenizer.huggingface.json" in meta:
        tok = Tokenizer.from_str(meta["tokenizer.huggingface.json"])
    else:
        tok = _byte_level(meta, tokens, source) if kind == "gpt2" else _sentencepiece(meta, tokens, types, source)
        tok.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, i in _first_ids(tokens).items()
                if types[i] in (CONTROL, UNKNOWN)
            ]
        )
        tok.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, i in _first_ids(tokens).items()
                if types[i] == USER_DEFINED
            ]
        )
        # The post-processor tokenizers-only readers apply; transformers rebuilds it from add_bos_token.
        wrap = [t for t, on in ((name["bos"], add_bos), ("$A", True), (name["eos"], add_eos)) if on and t]
        template = processors.TemplateProcessing(
            single=" ".join(wrap),
            pair=" ".join(wrap + ["$B"]),
            special_tokens=[
                (t, ids[k]) for k, t, on in (("bos", name["bos"], add_bos), ("eos", name["eos"], add_eos)) if on and t
            ],
        )
        steps = [processors.ByteLevel(trim_offsets=False)] if kind == "gpt2" else []
        tok.post_processor = processors.Sequence([*steps, template])
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name["bos"],
        "eos_token": name["eos"],
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "imported_by": "fitlm",
        "imported_from": "gguf",
    }
    cfg.update({f"{k}_token": name[g] for k, g in (("pad", "padding"), ("unk", "unknown")) if name[g]})
    stops = list(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))
    gen = {
        "bos_token_id": ids["bos"],
        "eos_token_id": stops if len(stops) > 1 else stops[0],
        "pad_token_id": ids["padding"],
    }
    files = {
        "tokenizer.json": json.dumps(json.loads(tok.to_str()), ensure_ascii=False),
        CONFIG_FILE: json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
        GENERATION_FILE: json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2) + "\n",
    }
    template_src = meta.get("tokenizer.chat_template")
    if isinstance(template_src, str) and template_src:
        files[TEMPLATE_FILE] = template_src
    return files


def write_gguf_tokenizer(meta: dict[str, Any], folder: Path, source: str) -> list[Path]:
    """Write the tokenizer files of GGUF metadata `meta` into `folder`; raises UnsupportedTokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in gguf_tokenizer_files(meta, source).items():
        out.append(folder / name)
        out[-1].write_text(text, encoding="utf-8")
    return out


def gguf_chat_template(path: Path) -> str:
    """tokenizer.chat_template of the GGUF file at `path` (for `--template model.gguf`)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    except (ValueError, OSError) as e:
        raise DataError(f"--template {path}: not a readable GGUF file ({e})") from None
    if field is None:
        raise DataError(
            f"--template {path}: the GGUF file has no tokenizer.chat_template; pass a built-in name or a .jinja file"
        )
    return str(field.contents())


__all__ = ["UnsupportedTokenizer", "gguf_chat_template", "gguf_tokenizer_files", "write_gguf_tokenizer"]
