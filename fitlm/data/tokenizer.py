"""The `Tokenizer` wrapper the rest of fitlm uses (training a byte-level BPE is fitlm.data.prep.tokenizer_train).

The file on disk is a plain Hugging Face `tokenizer.json` (plus a `tokenizer_config.json` naming the
special tokens), so `transformers.AutoTokenizer` and llama.cpp-style exporters can read it unchanged.
A foreign model's tokenizer keeps its own BOS/EOS/PAD conventions, read by fitlm.data.conventions.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import cast

import tokenizers

from fitlm.data.conventions import SIDE_FILES, SPECIAL_TOKENS, Conventions, read_conventions
from fitlm.data.errors import DataError

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_out_path(out_path: Path) -> Path:
    """`out_path` may name the tokenizer.json itself or a directory to hold it."""
    out_path = Path(out_path)
    return out_path if out_path.suffix == ".json" else out_path / TOKENIZER_FILE


class Tokenizer:
    """A loaded tokenizer.json with the BOS/EOS/PAD conventions of its model (fitlm.data.conventions).
    Build it with `Tokenizer.from_file`.

    bos_id is None for a model without BOS (Qwen); add_bos says whether the model puts BOS before a text;
    stop_ids are the ids generation ends at (EOS first, then the model's other EOS / end-of-turn ids).
    """

    def __init__(self, backend: tokenizers.Tokenizer, path: Path, conv: Conventions, sha256: str):
        self._tok = backend
        self.path = path
        self.sha256 = sha256
        self.special_tokens: dict[str, str | None] = {"bos": conv.bos, "eos": conv.eos, "pad": conv.pad}
        self.bos_id: int | None = None if conv.bos is None else backend.token_to_id(conv.bos)
        # (from_file has checked EOS, PAD and the stop tokens are in the vocabulary)
        self.eos_id: int = cast(int, backend.token_to_id(conv.eos))
        self.pad_id: int = cast(int, backend.token_to_id(conv.pad))
        self.add_bos: bool = conv.add_bos
        self.stop_ids: tuple[int, ...] = tuple(cast(int, backend.token_to_id(t)) for t in conv.stops)
        self.fitlm_convention: bool = conv.fitlm_convention
        # Embedding rows needed = largest id + 1 (a foreign vocab may have holes, so not len(vocab)).
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        # Special-token strings inside data are encoded as plain text, so a document that happens to
        # contain "<|eos|>" cannot forge a document boundary. Control ids are added only by add_bos/add_eos.
        self._tok.encode_special_tokens = True

    @classmethod
    def from_file(
        cls, path: Path | str, bos: str | None = None, eos: str | None = None, pad: str | None = None
    ) -> Tokenizer:
        """Load a tokenizer.json (or a directory holding one) and check its BOS, EOS and PAD are real tokens.

        Token names come from the arguments, else from the files beside it (tokenizer_config.json,
        special_tokens_map.json, generation_config.json), else SPECIAL_TOKENS (fitlm's own tokenizers).
        """
        path = Path(path)
        json_path = path / TOKENIZER_FILE if path.is_dir() else path
        if not json_path.is_file():
            where = (
                f"no {TOKENIZER_FILE} in directory {path}" if path.is_dir() else f"tokenizer file {path} does not exist"
            )
            raise DataError(f"{where}; train one with `fitlm data tokenizer` or pass the path of a tokenizer.json")
        raw = json_path.read_bytes()
        try:
            backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DataError(
                f"{json_path} is not a valid tokenizer.json ({e}); re-create it with `fitlm data tokenizer`"
            ) from None
        conv = read_conventions(json_path, backend, {"bos": bos, "eos": eos, "pad": pad})
        names = {"BOS": conv.bos, "EOS": conv.eos, "PAD": conv.pad}
        missing = [f"{k} {v!r}" for k, v in names.items() if v is not None and backend.token_to_id(v) is None]
        if missing:
            raise DataError(
                f"tokenizer {json_path} lacks the special token(s) {', '.join(missing)}; fitlm needs EOS and PAD "
                f"(and BOS, unless the model has none) in the vocabulary. Fix: retrain it with `fitlm data tokenizer` "
                f"(which adds {', '.join(SPECIAL_TOKENS.values())}), add the missing token(s) to its added_tokens, "
                f"or name tokens it already has with bos=/eos=/pad= (e.g. pad='</s>')"
            )
        return cls(backend, json_path, conv, hashlib.sha256(raw).hexdigest())

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`; BOS/EOS are added only when asked. `add_bos=tok.add_bos` encodes as the model's
        own tokenizer does (what `transformers.AutoTokenizer(...)(text)` returns); its post-processor is not run,
        so BOS is never doubled."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return self._wrap(ids, add_bos, add_eos)

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """Encode many texts at once (in parallel inside tokenizers)."""
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, add_bos, add_eos) for e in encodings]

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        if add_bos and self.bos_id is None:
            raise DataError(
                f"tokenizer {self.path} has no BOS token (its model adds none, e.g. Qwen); encode with "
                "add_bos=tokenizer.add_bos, or name one with bos="
            )
        if add_bos:
            assert self.bos_id is not None  # refused just above
            ids = [self.bos_id, *ids]
        if add_eos:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (a list, numpy array or tensor); special tokens dropped unless asked for."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def copy_to(self, directory: Path) -> list[Path]:
        """Copy tokenizer.json and the convention files beside it (SIDE_FILES) byte for byte into `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        out = [directory / TOKENIZER_FILE]
        shutil.copyfile(self.path, out[0])
        for name in SIDE_FILES:
            if self.path.with_name(name).is_file():
                out.append(directory / name)
                shutil.copyfile(self.path.with_name(name), out[-1])
        return out

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"
