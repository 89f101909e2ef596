"""Tokenizing documents in pack's worker processes (a local pool, or Ray's map_batches): one encoder per
process, set up by `init_encoder`, and `encode_batch` turning a batch of texts, conversations or preference
pairs into flat ids, per-document lengths, a loss mask (chat) and counts."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from fitlm.data.preference import Pair, PreferenceEncoder
from fitlm.data.tokenizer import Tokenizer

_STATE: dict[str, Any] = {}


def init_encoder(
    tokenizer_path: str, names: dict[str, str | None], template: tuple[str, str] | None, single_thread: bool = False
) -> None:
    if single_thread:  # a pool worker: one thread each, so N workers use N cores without oversubscription
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = Tokenizer.from_file(tokenizer_path, **names)
    _STATE.clear()  # inline packing reuses this process: never keep a previous pack's template
    _STATE["tok"] = tok
    if template is not None:
        from fitlm.data.chat import ChatEncoder

        _STATE["chat"] = ChatEncoder(tok, template[1], template[0])


def encode_batch(batch: list[Any], max_length: int | None, overlong: str) -> dict[str, Any]:
    """Encode one batch; returns flat ids, per-document lengths, flat mask (chat) and counts."""
    tok: Tokenizer = _STATE["tok"]
    counts = {"no_assistant": 0, "truncated": 0, "dropped_overlong": 0}
    if batch and isinstance(batch[0], Pair):
        return _encode_pairs(batch, max_length)
    if "chat" not in _STATE:
        # BOS as the model's tokenizer adds it (fitlm's own: always), EOS closes every document.
        seqs = tok.encode_batch(batch, add_bos=tok.add_bos, add_eos=True)
        masks = None
    else:
        seqs, masks = [], []
        for messages in batch:
            if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
                counts["no_assistant"] += 1
                continue
            ids, mask = _STATE["chat"].encode(messages)
            if max_length is not None and len(ids) > max_length:
                if overlong == "drop" or not any(mask[:max_length]):
                    counts["dropped_overlong"] += 1
                    continue
                ids, mask = ids[:max_length], mask[:max_length]
                counts["truncated"] += 1
            seqs.append(ids)
            masks.append(mask)
    return _flat(seqs, masks, counts)


def _flat(seqs: list[list[int]], masks: list[list[int]] | None, counts: dict[str, int]) -> dict[str, Any]:
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter((i for s in seqs for i in s), dtype=np.int64, count=int(lengths.sum()))
    out = {"ids": flat, "lengths": lengths, "counts": counts}
    if masks is not None:
        out["mask"] = np.fromiter((x for m in masks for x in m), dtype=np.uint8, count=int(lengths.sum()))
    return out


def _encode_pairs(batch: list[Pair], max_length: int | None) -> dict[str, Any]:
    """Preference pairs: two documents each (chosen, then rejected), mask on the responses; a pair with a
    sequence over `max_length` is dropped whole."""
    encoder = PreferenceEncoder(_STATE["tok"], _STATE["chat"])
    counts = {"pairs": 0, "dropped_overlong": 0}
    seqs, masks = [], []
    for pair in batch:
        docs = encoder.documents(pair, max_length)
        if docs is None:
            counts["dropped_overlong"] += 1
            continue
        counts["pairs"] += 1
        for ids, mask in docs:
            seqs.append(ids)
            masks.append(mask)
    return _flat(seqs, masks, counts)


__all__ = ["encode_batch", "init_encoder"]
