"""Preference data (DPO): (prompt, chosen, rejected) rows -> two documents per pair, loss mask on the response.

A row of a .jsonl file is {"prompt": [messages] | "text", "chosen": [messages] | "text", "rejected": ...}.
Conversational rows (any field a message list; a string prompt becomes one user message, a string response
one assistant message) are rendered with the model's chat template the way TRL tokenizes them:

    prompt   = encode(render(prompt, add_generation_prompt=True))     (fitlm.data.chat: BOS as the model adds it)
    chosen   = encode(render(prompt + chosen))                        (end-of-turn included; EOS when no stop
                                                                       token closes the last turn)
    response = chosen after the prefix it shares with the prompt

Plain-text rows are encode(prompt + chosen) + EOS, the prompt being its shared prefix with encode(prompt).
Each pair is stored as two adjacent documents of a chat-format pack, chosen (document 2k) then rejected
(2k + 1), mask 1 on the response tokens; the manifest's "preference" entry marks the pack (and holds the
counts) so SFT cannot read it by mistake and the loader (packing "pairs") keeps a pair together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from fitlm.data.chat import ChatEncoder, check_messages
from fitlm.data.errors import DataError
from fitlm.data.tokenizer import Tokenizer

FIELDS = ("prompt", "chosen", "rejected")
MANIFEST_KEY = "preference"  # manifest entry of a preference pack: {"pairs", "dropped_overlong", ...}
PAIR_EXAMPLE = (
    '{"prompt": [{"role": "user", "content": "..."}], "chosen": [{"role": "assistant", "content": "..."}], '
    '"rejected": [{"role": "assistant", "content": "..."}]}'
)


@dataclass(frozen=True)
class Pair:
    """One validated row: message lists when conversational, else plain strings."""

    prompt: list[dict[str, str]] | str
    chosen: list[dict[str, str]] | str
    rejected: list[dict[str, str]] | str

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)

    def chars(self) -> int:
        def n(v: list[dict[str, str]] | str) -> int:
            return len(v) if isinstance(v, str) else sum(len(m["content"]) for m in v)

        return n(self.prompt) + n(self.chosen) + n(self.rejected)


def is_preference(manifest: dict[str, Any]) -> bool:
    """Whether a packed directory's manifest describes preference pairs."""
    return manifest.get(MANIFEST_KEY) is not None


def check_pair(record: Any, where: str) -> Pair:
    """Validate one row; a conversational row has all three fields as message lists (strings promoted)."""
    if not isinstance(record, dict) or any(k not in record for k in FIELDS):
        missing = [k for k in FIELDS if not isinstance(record, dict) or k not in record]
        raise DataError(
            f"{where}: no {', '.join(repr(k) for k in missing)} field; each line of preference data "
            f"must be {PAIR_EXAMPLE} (or the three fields as plain strings)"
        )
    values = {k: record[k] for k in FIELDS}
    for k, v in values.items():
        if not (isinstance(v, str) and v.strip()) and not (isinstance(v, list) and v):
            raise DataError(
                f'{where}: "{k}" must be a non-empty string or a non-empty list of messages, got {json.dumps(v)[:120]}'
            )
    if all(isinstance(v, str) for v in values.values()):
        return Pair(**values)
    role = {"prompt": "user", "chosen": "assistant", "rejected": "assistant"}
    msgs = {
        k: [{"role": role[k], "content": v}] if isinstance(v, str) else check_messages(v, f'{where}: "{k}"')
        for k, v in values.items()
    }
    for k in ("chosen", "rejected"):
        if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs[k]):
            raise DataError(
                f'{where}: "{k}" has no assistant message with content; a response is what the '
                "model is trained to prefer (or not)"
            )
    return Pair(**msgs)


class PreferenceEncoder:
    """Pairs -> the two sequences and where their response starts, with one tokenizer and template."""

    def __init__(self, tokenizer: Tokenizer, chat: ChatEncoder):
        self.tokenizer, self.chat = tokenizer, chat

    def encode(self, pair: Pair) -> tuple[list[int], list[int], int]:
        """(chosen ids, rejected ids, prompt length): each sequence is prompt + response tokenized whole, as
        its model sees it; the prompt is the part both share with the prompt tokenized alone (a template may
        render the generation prompt differently, or tokens merge across the boundary: the response then
        starts where they diverge, as in TRL)."""
        tok = self.tokenizer
        if pair.conversational:  # (all three fields are message lists, check_pair)
            prompt = self.chat.encode(cast(list[dict[str, str]], pair.prompt), add_generation_prompt=True)[0]
            chosen, rejected = (self.chat.encode([*pair.prompt, *r])[0] for r in (pair.chosen, pair.rejected))
        else:  # text: BOS as the model adds it, EOS closes the response
            text = cast(str, pair.prompt)  # (all three fields are strings)
            prompt = tok.encode(text, add_bos=tok.add_bos)
            chosen, rejected = (
                tok.encode(text + cast(str, r), add_bos=tok.add_bos, add_eos=True) for r in (pair.chosen, pair.rejected)
            )
        shared = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
        return chosen, rejected, shared

    def documents(self, pair: Pair, max_length: int | None) -> list[tuple[list[int], list[int]]] | None:
        """[(ids, mask) of chosen, (ids, mask) of rejected], mask 1 on the response; None when either exceeds
        `max_length` tokens (a pair is dropped whole: a cut response would be compared with a whole one)."""
        chosen, rejected, shared = self.encode(pair)
        if max_length is not None and max(len(chosen), len(rejected)) > max_length:
            return None
        return [(ids, [0] * shared + [1] * (len(ids) - shared)) for ids in (chosen, rejected)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


__all__ = ["FIELDS", "MANIFEST_KEY", "Pair", "PreferenceEncoder", "check_pair", "is_preference"]
