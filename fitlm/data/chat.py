"""Chat / SFT data: render a conversation with a template, tokenize it, and mark the assistant tokens.

A template is Jinja source, as in Hugging Face's `tokenizer_config.json` (`chat_template`), rendered in
jinja2's ImmutableSandboxedEnvironment: a template is untrusted input and must not reach Python
internals. fitlm's built-in templates are Jinja too, so there is one code path:

    render(messages) -> text -> spans of each message's content (found in order) -> segments
    -> token ids + loss mask (1 on assistant content and the end-of-turn marker that closes it)

Special-token strings (e.g. "</s>", "<|eos|>") become control ids only where the *template* wrote them;
inside message content they stay plain text, so a user cannot forge a turn boundary.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitlm.data.errors import DataError
from fitlm.data.tokenizer import TOKENIZER_CONFIG_FILE, Tokenizer

ROLES = ("system", "user", "assistant")

# Built-in templates. "inst" is the Llama-2 chat format ([INST] ... [/INST], system in <<SYS>>).
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "inst": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set sys = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}{% set msgs = messages[1:] %}"
        "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
        "{% for m in msgs %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {% if loop.first %}{{ sys }}{% endif %}"
        "{{ m['content'] }} [/INST]{% elif m['role'] == 'assistant' %} {{ m['content'] }} {{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    "plain": (
        "{% for m in messages %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
    ),
}
BUILTIN_TEMPLATES["llama2"] = BUILTIN_TEMPLATES["inst"]
DEFAULT_TEMPLATE = "chatml"


def resolve_template(spec: str | None, tokenizer_path: Path | None = None) -> tuple[str, str]:
    """(name, Jinja source) for `--template`: a built-in name, a tokenizer_config.json (its chat_template),
    a .jinja file, or None = the chat_template beside the tokenizer if it has one, else chatml."""
    if spec is None:
        cfg = Path(tokenizer_path).parent / TOKENIZER_CONFIG_FILE if tokenizer_path else None
        if tokenizer_path and Path(tokenizer_path).is_dir():
            cfg = Path(tokenizer_path) / TOKENIZER_CONFIG_FILE
        if cfg is not None and cfg.is_file() and _config_template(cfg, required=False):
            return str(cfg), _config_template(cfg, required=True)
        return DEFAULT_TEMPLATE, BUILTIN_TEMPLATES[DEFAULT_TEMPLATE]
    if spec in BUILTIN_TEMPLATES:
        return spec, BUILTIN_TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"--template {spec!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) nor an "
                        "existing file; name a built-in, a tokenizer_config.json with a chat_template, or a .jinja file")
    if path.suffix == ".json":
        return str(path), _config_template(path, required=True)
    return str(path), path.read_text(encoding="utf-8")


def _config_template(path: Path, required: bool) -> str | None:
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        if not required:
            return None
        raise DataError(f"{path} is not valid JSON ({e}); fix it or pass --template NAME") from None
    tmpl = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(tmpl, list):  # HF allows [{"name": "default", "template": ...}, ...]
        tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(tmpl, str):
        if required:
            raise DataError(f"{path} has no string chat_template; pass --template with a built-in "
                            f"({', '.join(BUILTIN_TEMPLATES)}) or a .jinja file")
        return None
    return tmpl


def _raise(message: str) -> None:
    raise DataError(f"the chat template raised: {message}")


def compile_template(source: str, name: str = "template"):
    """A jinja2 Template in a sandbox (no attribute access to Python internals, no mutation of inputs)."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("chat data needs jinja2 (`pip install jinja2`); it renders chat templates in a sandbox") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise DataError(f"chat template {name} does not compile ({e}); fix it or pass another --template") from None


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """Validate one conversation: a non-empty list of {role, content} with known roles and string content."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f'{where}: message {i} must be {{"role": one of {"/".join(ROLES)}, "content": "text"}}, '
                            f"got {json.dumps(m)[:120]}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


@dataclass
class ChatEncoder:
    """Turns conversations into (ids, loss mask) with one tokenizer and one template."""

    tokenizer: Tokenizer
    source: str
    name: str = "template"

    def __post_init__(self) -> None:
        self._template = compile_template(self.source, self.name)
        decoder = self.tokenizer.backend.get_added_tokens_decoder()
        self._special = {t.content: i for i, t in decoder.items() if t.special and t.content}
        for key in ("bos", "eos", "pad"):
            name = self.tokenizer.special_tokens[key]
            self._special.setdefault(name, self.tokenizer.token_to_id(name))
        longest_first = sorted(self._special, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(s) for s in longest_first)) if longest_first else None
        self._eos_text = self.tokenizer.special_tokens["eos"]

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError
        from jinja2.exceptions import SecurityError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.tokenizer.special_tokens["bos"], eos_token=self._eos_text)
        except SecurityError as e:
            raise DataError(f"chat template {self.name} tried an unsafe operation ({e}); it was stopped by the "
                            "sandbox; use a trusted template") from None
        except TemplateError as e:
            raise DataError(f"chat template {self.name} failed to render ({e})") from None

    def _spans(self, text: str, messages: Sequence[dict[str, str]]) -> list[tuple[int, int, int, bool]]:
        """(start, content end, span end, trained) of each rendered message content, in order; an
        assistant span extends past its content over the end-of-turn marker."""
        spans, pos = [], 0
        for i, m in enumerate(messages):
            content = m["content"].strip()
            if not content:
                continue
            at = text.find(content, pos)
            if at < 0:
                raise DataError(f"chat template {self.name} does not reproduce message {i} ({m['role']}) verbatim, so "
                                "its tokens cannot be located for the loss mask; use a template that inserts "
                                "message content unchanged")
            end = content_end = at + len(content)
            if m["role"] == "assistant":
                nxt = [text.find(n["content"].strip(), end) for n in messages[i + 1:] if n["content"].strip()]
                limit = min([x for x in nxt if x >= 0], default=len(text))
                gap = text[end:limit]
                # Train on the end-of-turn marker too: through the EOS string, else up to the line end.
                k = gap.find(self._eos_text)
                end += k + len(self._eos_text) if k >= 0 else len(gap.split("\n", 1)[0])
            spans.append((at, content_end, end, m["role"] == "assistant"))
            pos = end
        return spans

    def _encode_template_text(self, text: str, ids: list[int], mask: list[int], trained: bool) -> None:
        last = 0
        if self._special_re is not None:
            for match in self._special_re.finditer(text):
                if match.start() > last:
                    piece = self.tokenizer.encode(text[last:match.start()])
                    ids += piece
                    mask += [int(trained)] * len(piece)
                ids.append(self._special[match.group()])
                mask.append(int(trained))
                last = match.end()
        if last < len(text):
            piece = self.tokenizer.encode(text[last:])
            ids += piece
            mask += [int(trained)] * len(piece)

    def encode(self, messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
        """(ids, mask) of one conversation, BOS first and EOS last; mask 1 = train on this token."""
        text = self.render(messages)
        ids: list[int] = []
        mask: list[int] = []
        pos = 0
        for start, content_end, end, trained in self._spans(text, messages):
            self._encode_template_text(text[pos:start], ids, mask, False)
            # Content is plain text: special-token strings inside it stay text, so no turn can be forged.
            piece = self.tokenizer.encode(text[start:content_end])
            ids += piece
            mask += [int(trained)] * len(piece)
            self._encode_template_text(text[content_end:end], ids, mask, trained)  # the end-of-turn marker
            pos = end
        self._encode_template_text(text[pos:], ids, mask, False)
        if not ids or ids[0] != self.tokenizer.bos_id:
            ids.insert(0, self.tokenizer.bos_id)
            mask.insert(0, 0)
        if ids[-1] != self.tokenizer.eos_id:
            ids.append(self.tokenizer.eos_id)
            mask.append(int(messages[-1]["role"] == "assistant"))  # learn to stop after the last answer
        return ids, mask


__all__ = ["BUILTIN_TEMPLATES", "ChatEncoder", "DEFAULT_TEMPLATE", "ROLES", "check_messages", "compile_template",
           "resolve_template"]
