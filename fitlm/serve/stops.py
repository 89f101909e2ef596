"""Tokens to text deltas, ending at stop strings: what a streamed completion sends, piece by piece.

The whole generated text is decoded again after every token (byte-level BPE can split a character
over tokens, so token-by-token decoding would send replacement characters), and only its new suffix
goes out. Text that could be the start of a stop string is held back until it is known not to be
one, so a client never receives part of a stop string; the joined deltas are the final text.
"""

from __future__ import annotations

from fitlm.data.tokenizer import Tokenizer


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that begins some stop string (and so may still become one)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextStream:
    """push(token) -> (new text, stopped by a stop string); finish() -> the text still held back.
    The deltas joined equal the decoded tokens, cut before the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out
        self.text = ""

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an unfinished character: wait for its other bytes
            return "", False
        self.text = text
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.text = text[: min(cuts)]
            return self._take(len(self.text)), True
        return self._take(len(text) - _held_back(text, self.stops)), False

    def finish(self) -> str:
        """The rest, once no token follows: held-back text and an unfinished character (as replacement
        characters, as `fitlm generate` prints it). Not called after a stop string."""
        self.text = self.tokenizer.decode(self.ids)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        piece = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return piece


__all__ = ["TextStream"]
