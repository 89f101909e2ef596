"""The model `fitlm serve` serves: weights (with a LoRA adapter merged), tokenizer and chat template.

Loading goes through the loaders the other commands use: `fitlm export`'s (MODEL + --adapter merged),
`fitlm generate`'s tokenizer lookup (tokenizer.json, or the one inside a GGUF file) and `fitlm chat`'s
template resolution, so a chat completion sees the prompt `fitlm chat` would build.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch.nn as nn

from fitlm.config import ModelConfig
from fitlm.data.chat import BUILTIN_TEMPLATES, DEFAULT_TEMPLATE, ChatEncoder, resolve_template
from fitlm.data.errors import DataError
from fitlm.data.tokenizer import Tokenizer


@dataclass
class ServedModel:
    name: str  # the id clients pass as "model"
    model: nn.Module
    tokenizer: Tokenizer
    chat: ChatEncoder
    template_name: str
    path: Path

    @property
    def context(self) -> int:
        return int(cast(ModelConfig, self.model.config).max_seq_len)  # (a fitlm model's config)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation rendered with the model's template plus the assistant prompt, as `fitlm chat` does."""
        return self.chat.encode(messages, add_generation_prompt=True)[0]

    def text_ids(self, prompt: str) -> list[int]:
        """A plain completion prompt, encoded as `fitlm generate` encodes --prompt (BOS when the model adds one)."""
        return self.tokenizer.encode(prompt, add_bos=self.tokenizer.add_bos)


def _template(loaded, tokenizer: Tokenizer) -> tuple[str, str]:
    if loaded.source == "gguf":  # the template travels inside the file
        try:
            return resolve_template(str(loaded.path))
        except DataError:
            return DEFAULT_TEMPLATE, BUILTIN_TEMPLATES[DEFAULT_TEMPLATE]
    return resolve_template(None, tokenizer.path)


def default_name(model_path: str | Path) -> str:
    """The served model id: the MODEL argument's last path part (a GGUF file without .gguf)."""
    p = Path(model_path).expanduser().absolute()
    return p.stem if p.suffix == ".gguf" else p.name


def load_served(model_path: str | Path, adapter: str | Path | None = None, name: str | None = None) -> ServedModel:
    """Load MODEL for serving; a bad path or adapter raises the CLI's one-paragraph user errors."""
    from fitlm.export.source import load_for_export
    from fitlm.infer.text import load_tokenizer

    loaded = load_for_export(model_path, adapter)
    tok = load_tokenizer(loaded, model_path)
    template_name, source = _template(loaded, tok)
    return ServedModel(
        name or default_name(model_path),
        loaded.model,
        tok,
        ChatEncoder(tok, source, template_name),
        template_name,
        loaded.path,
    )


__all__ = ["ServedModel", "default_name", "load_served"]
