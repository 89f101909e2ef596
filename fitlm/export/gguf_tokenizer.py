"""The tokenizer of a GGUF export, as llama.cpp reads it (the inverse of fitlm/data/gguf_tokenizer.py).

Two vocabulary kinds, named by fitlm.data.gguf_vocab from the tokenizer.json itself:

  "gpt2"   byte-level BPE (Llama 3, Qwen2/2.5/3, SmolLM, GPT-2, Mistral Nemo, DeepSeek, fitlm's own): tokens,
           token types, merges, and tokenizer.ggml.pre, the name of its split rule in llama.cpp.
  "llama"  SentencePiece BPE (Llama 2, Mistral v0.x, Gemma, Phi-3): tokens, scores, token types and
           add_space_prefix. llama.cpp merges the adjacent pair whose joined piece scores highest; a
           tokenizer.json ranks merges instead, so a piece's score is minus the rank of the first merge that makes
           it (transformers' converter ranked those merges by the SentencePiece scores: the same order back).

Then the specials (BOS, EOS, PAD, UNK, end of turn), BOS/EOS rules and the chat template. A model exported with
no tokenizer gets tokenizer.ggml.model "none", which llama.cpp loads (token ids in, logits out).
"""

from __future__ import annotations

import json
from pathlib import Path

from fitlm.data.chat import resolve_template
from fitlm.data.gguf_vocab import (
    BYTE,
    BYTE_PIECE,
    CHECK_TEXT,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    add_space_prefix,
    is_sentencepiece,
    pre_tokenizer_name,
)
from fitlm.data.tokenizer import Tokenizer


def _tokens_and_types(tok: Tokenizer, spec: dict, byte_fallback: bool) -> tuple[list[str], list[int]]:
    """Every id's text and llama.cpp token type; holes in the id range are unused padding entries."""
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    tokens = [f"[PAD{i}]" for i in range(tok.vocab_size)]
    types = [UNUSED] * tok.vocab_size
    for t, i in vocab.items():
        tokens[i] = t
        types[i] = BYTE if byte_fallback and BYTE_PIECE.fullmatch(t) else NORMAL
    unk = (spec.get("model") or {}).get("unk_token")
    for i, added in tok.backend.get_added_tokens_decoder().items():
        types[i] = UNKNOWN if added.content == unk else CONTROL if added.special else USER_DEFINED
    return tokens, types


def _merges(spec: dict) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in (spec.get("model") or {}).get("merges", [])]


def piece_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """SentencePiece scores from ranked merges: -rank of the first merge making the piece; a piece no merge makes
    (single characters, bytes, specials) scores below every merged piece, as llama.cpp never forms it by merging."""
    first: dict[str, int] = {}
    for rank, m in enumerate(merges):
        a, _, b = m.partition(" ")
        first.setdefault(a + b, rank)
    floor = -float(len(merges))
    return [-float(first[t]) if t in first else floor - i for i, t in enumerate(tokens)]


def _add_specials(writer, tok: Tokenizer, unk_id: int | None) -> None:
    if tok.bos_id is not None:
        writer.add_bos_token_id(tok.bos_id)
    writer.add_eos_token_id(tok.eos_id)
    writer.add_pad_token_id(tok.pad_id)
    if unk_id is not None:
        writer.add_unk_token_id(unk_id)
    end_of_turn = [i for i in tok.stop_ids if i != tok.eos_id]
    if end_of_turn:
        writer.add_eot_token_id(end_of_turn[0])
    writer.add_add_bos_token(tok.add_bos)
    writer.add_add_eos_token(False)


def add_tokenizer(writer, tokenizer_path: Path | None) -> str:
    """Write the tokenizer of `tokenizer_path` (None: none) into a GGUFWriter; returns what was written:
    "gpt2 <pre>", "llama" or "none". Raises UnnamedTokenizer for a tokenizer llama.cpp has no name for."""
    if tokenizer_path is None:
        writer.add_tokenizer_model("none")
        return "none"
    tok = Tokenizer.from_file(tokenizer_path)
    spec = json.loads(tok.backend.to_str())
    model = spec.get("model") or {}
    if is_sentencepiece(spec):
        tokens, types = _tokens_and_types(tok, spec, byte_fallback=True)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")  # what llama.cpp's converter writes for SentencePiece vocabularies
        writer.add_token_list(tokens)
        writer.add_token_scores(piece_scores(tokens, _merges(spec)))
        writer.add_token_types(types)
        writer.add_add_space_prefix(add_space_prefix(spec))
        unk = model.get("unk_token")
        _add_specials(writer, tok, None if unk is None else tok.token_to_id(unk))
        written = "llama"
    else:
        plain = tok.encode(CHECK_TEXT)
        variants = [plain] + ([[tok.bos_id, *plain]] if tok.bos_id is not None else [])
        pre = pre_tokenizer_name(tok.backend, variants, str(tok.path))
        tokens, types = _tokens_and_types(tok, spec, byte_fallback=False)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(_merges(spec))
        _add_specials(writer, tok, None)
        written = f"gpt2 {pre}"
    writer.add_chat_template(resolve_template(None, tokenizer_path)[1])
    return written


__all__ = ["add_tokenizer", "piece_scores"]
