"""Prompt data (GRPO, `data.format: prompts`): JSONL rows of a prompt and the columns its reward functions read.

A row is {"prompt": "text", ...} or {"messages": [{"role": ..., "content": ...}, ...], ...}: a text prompt is
encoded as the model reads a text (BOS when it adds one), a conversation is rendered with the model's chat
template and the generation prompt (TRL's `apply_chat_template(..., add_generation_prompt=True)`). Every other
key of the row is kept as a column and handed to the reward functions as a keyword (`answer`, `solution`, ...).

`fitlm data pack --format prompts` checks every row (the file and line of a bad one named), refuses a prompt
longer than --max-length (finetune.grpo.max_prompt_length), and writes a directory of

    manifest.json    format fitlm-packed, data_format "prompts", the tokenizer's ids, counts, longest prompt
    prompts.jsonl    one {"ids": [...], "text": "...", "columns": {...}} per row, in input order
    tokenizer.json   the tokenizer the prompts were encoded with

Prompt sets are small (thousands of rows), so they are read whole (`PromptDataset`); `PromptStream` hands each
data-parallel rank its prompts for a generation batch as a pure function of the batch's index, so a resumed run
reads exactly what the uninterrupted one did.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fitlm.data.chat import ChatEncoder, check_messages, resolve_template
from fitlm.data.errors import DataError
from fitlm.data.format import FORMAT, FORMAT_VERSION, MANIFEST_FILE
from fitlm.data.tokenizer import TOKENIZER_FILE, Tokenizer

PROMPTS_FILE = "prompts.jsonl"
ROW_EXAMPLE = '{"prompt": "What is 2 + 3?", "answer": "5"} or {"messages": [{"role": "user", "content": "..."}], ...}'


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its token ids, the text the reward functions see as the prompt (the rendered template for a
    conversation), and the row's other columns."""

    ids: list[int]
    text: str
    columns: dict[str, Any]


def read_rows(path: Path) -> list[tuple[dict[str, Any], str]]:
    """(row, where) of each non-blank line of a .jsonl file; `where` is "file:line" for error messages."""
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: prompt data must be .jsonl with one {ROW_EXAMPLE} object per line")
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where}: not a JSON object ({e}); each line must be {ROW_EXAMPLE}") from None
            rows.append((record, where))
    return rows


class PromptEncoder:
    """Rows -> PromptRow with one tokenizer and chat template."""

    def __init__(self, tokenizer: Tokenizer, chat: ChatEncoder):
        self.tokenizer, self.chat = tokenizer, chat

    def encode(self, record: Any, where: str) -> PromptRow:
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise DataError(
                f"{where}: a prompt row has exactly one of 'prompt' (text) or 'messages' (a conversation); "
                f"each line must be {ROW_EXAMPLE}"
            )
        columns = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
        if "prompt" in record:
            text = record["prompt"]
            if not isinstance(text, str) or not text.strip():
                raise DataError(f'{where}: "prompt" must be a non-empty string, got {json.dumps(text)[:120]}')
            return PromptRow(self.tokenizer.encode(text, add_bos=self.tokenizer.add_bos), text, columns)
        messages = check_messages(record["messages"], f'{where}: "messages"')
        if messages[-1]["role"] == "assistant":
            raise DataError(
                f"{where}: the conversation ends with an assistant message, but the completion is what GRPO "
                "samples; end it with the user's turn"
            )
        ids, _ = self.chat.encode(messages, add_generation_prompt=True)
        return PromptRow(ids, self.chat.render(messages, add_generation_prompt=True), columns)


def pack_prompts(
    inputs: list[Path], tokenizer_path: Path, out: Path, template: str | None, max_length: int | None, overwrite: bool
) -> dict[str, Any]:
    """Check and encode the .jsonl files `inputs` into the prompts directory `out`; returns its manifest."""
    from fitlm.data.prep.sources import expand_inputs

    tok = Tokenizer.from_file(tokenizer_path)
    name, source = resolve_template(template, tok.path)
    encoder = PromptEncoder(tok, ChatEncoder(tok, source, name))
    files = expand_inputs(inputs)
    if not files:
        raise DataError(f"no input files in {', '.join(map(str, inputs))}; pass .jsonl files of {ROW_EXAMPLE}")
    rows = []
    for path in files:
        for record, where in read_rows(path):
            row = encoder.encode(record, where)
            if max_length is not None and len(row.ids) > max_length:
                raise DataError(
                    f"{where}: the prompt has {len(row.ids)} tokens, over --max-length {max_length} "
                    "(finetune.grpo.max_prompt_length); shorten it, drop the row, or raise both "
                    "max_prompt_length and --max-length"
                )
            rows.append(row)
    if not rows:
        raise DataError(f"{', '.join(map(str, files))}: no prompt rows; each line must be {ROW_EXAMPLE}")
    names = sorted({k for r in rows for k in r.columns})
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise DataError(f"{out} exists and is not empty; pass --overwrite to replace it, or choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / PROMPTS_FILE).open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"ids": r.ids, "text": r.text, "columns": r.columns}, ensure_ascii=False) + "\n")
    tok.copy_to(out)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "data_format": "prompts",
        "vocab_size": tok.vocab_size,
        "tokenizer_sha256": tok.sha256,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "chat_template": name,
        "num_prompts": len(rows),
        "max_prompt_tokens": max(len(r.ids) for r in rows),
        "max_length": max_length,
        "columns": names,
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


class PromptDataset:
    """A directory written by `fitlm data pack --format prompts`, read whole."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        mpath = self.path / MANIFEST_FILE
        hint = f"pack it with `fitlm data pack ... --format prompts --out {self.path}`"
        if not mpath.is_file():
            raise DataError(f"{self.path} is not packed prompt data (it has no {MANIFEST_FILE}); {hint}")
        self.manifest = json.loads(mpath.read_text(encoding="utf-8"))
        if self.manifest.get("data_format") != "prompts":
            raise DataError(
                f"{self.path} holds {self.manifest.get('data_format')!r} data, not prompts, but finetune.objective: "
                f"grpo samples completions for prompts; {hint}"
            )
        with (self.path / PROMPTS_FILE).open(encoding="utf-8") as f:
            self.rows = [PromptRow(**json.loads(line)) for line in f if line.strip()]
        if len(self.rows) != self.manifest["num_prompts"]:
            raise DataError(f"{self.path}: {PROMPTS_FILE} does not hold the manifest's prompts; {hint} again")

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER_FILE

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.manifest["tokenizer_sha256"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def pad_id(self) -> int:
        return int(self.manifest["pad_id"])

    @property
    def max_prompt_tokens(self) -> int:
        return int(self.manifest["max_prompt_tokens"])

    @property
    def columns(self) -> list[str]:
        return list(self.manifest["columns"])


class PromptStream:
    """The prompts of generation batch g for one data-parallel rank: an endless stream of epochs, each a
    permutation of the dataset seeded by (seed, epoch), cut into global batches of `per_rank × world_size`
    prompts, rank r taking the r-th slice. A pure function of g: nothing to save but the seed."""

    def __init__(self, data: PromptDataset, per_rank: int, seed: int, rank: int, world_size: int):
        self.data, self.per_rank, self.seed, self.rank, self.world_size = data, per_rank, seed, rank, world_size
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.data.rows))}
        return self._orders[epoch]

    def first(self, g: int) -> int:
        """The place of this rank's first prompt of generation batch g in the global batch."""
        return self.rank * self.per_rank

    def batch(self, g: int) -> list[PromptRow]:
        """Generation batch g's prompts for this rank (0-based g)."""
        n = len(self.data.rows)
        start = g * self.world_size * self.per_rank + self.first(g)
        return [self.data.rows[int(self._order(i // n)[i % n])] for i in range(start, start + self.per_rank)]

    # The trainer's checkpoints keep a "loader" entry: the stream has no position of its own (see the class).
    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "num_prompts": len(self.data.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_prompts") != len(self.data.rows):
            raise DataError(
                f"the checkpoint was trained on {state.get('num_prompts')} prompts but {self.data.path} holds "
                f"{len(self.data.rows)}; resume with the same data.train"
            )


__all__ = ["PROMPTS_FILE", "PromptDataset", "PromptEncoder", "PromptRow", "PromptStream", "pack_prompts"]
