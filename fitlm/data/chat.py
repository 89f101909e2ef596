"""Chat / SFT data: render a conversation with a template, tokenize it, and mark the assistant tokens.

A template is Jinja source, as in Hugging Face's `chat_template.jinja` / `tokenizer_config.json`
(`chat_template`), rendered in jinja2's ImmutableSandboxedEnvironment: a template is untrusted input and
must not reach Python internals. The environment offers what Hugging Face templates expect (messages,
add_generation_prompt, bos_token/eos_token/pad_token, raise_exception, strftime_now, tojson, loop
controls, {% generation %}). fitlm's built-in templates are Jinja too, so there is one code path:

    render(messages) -> text -> spans of each message's content (found in order)
    -> text cut at the special tokens the template wrote; the text between two is encoded whole, as
       transformers' apply_chat_template does -> token ids
    -> loss mask from character offsets: 1 on tokens over assistant content and the end-of-turn marker
       that closes it (the first stop token after it, else the rest of its line)

BOS is put first only when the model's tokenizer adds one and the template did not write it; EOS is
appended only when no stop token (EOS, end of turn) already closes the last message. Special-token
strings (e.g. "</s>", "<|eos|>") become control ids only where the *template* wrote them; inside message
content they stay plain text, so a user cannot forge a turn boundary.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from fitlm.data.conventions import config_chat_template, model_chat_template
from fitlm.data.errors import DataError
from fitlm.data.tokenizer import Tokenizer

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
    """(name, Jinja source) for `--template`: a built-in name, a model directory, a tokenizer_config.json (its
    chat_template), a .gguf file (tokenizer.chat_template), a .jinja file; or None = the model's own template
    beside the tokenizer (chat_template.jinja, else tokenizer_config.json's), else chatml."""
    if spec is None:
        folder = Path(tokenizer_path) if tokenizer_path else None
        found = model_chat_template(folder if folder.is_dir() else folder.parent) if folder else None
        return found or (DEFAULT_TEMPLATE, BUILTIN_TEMPLATES[DEFAULT_TEMPLATE])
    if spec in BUILTIN_TEMPLATES:
        return spec, BUILTIN_TEMPLATES[spec]
    path = Path(spec)
    if path.is_dir():
        found = model_chat_template(path)
        if found is None:
            raise DataError(
                f"--template {spec}: the directory holds neither chat_template.jinja nor a "
                "tokenizer_config.json with a chat_template; pass a built-in name or a .jinja file"
            )
        return found
    if not path.is_file():
        raise DataError(
            f"--template {spec!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) nor an "
            "existing file; name a built-in, a tokenizer_config.json with a chat_template, or a .jinja file"
        )
    if path.suffix == ".json":
        return str(path), config_chat_template(path)
    if path.suffix == ".gguf":
        from fitlm.data.gguf_tokenizer import gguf_chat_template

        return str(path), gguf_chat_template(path)
    return str(path), path.read_text(encoding="utf-8")


def _raise(message: str) -> None:
    raise DataError(f"the chat template raised: {message}")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &); Hugging Face templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _environment():
    """The sandboxed Jinja environment, configured as transformers renders chat templates (so the text is
    the same): trim_blocks, lstrip_blocks, no kept trailing newline, loop controls, {% generation %}."""
    try:
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError(
            "chat data needs jinja2 (`pip install jinja2`); it renders chat templates in a sandbox"
        ) from None

    class Generation(Extension):
        """{% generation %}...{% endgeneration %} marks assistant text in HF templates; it renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_template(source: str, name: str = "template"):
    """A jinja2 Template in a sandbox (no attribute access to Python internals, no mutation of inputs)."""
    from jinja2 import TemplateError

    env = _environment()
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
            raise DataError(
                f'{where}: message {i} must be {{"role": one of {"/".join(ROLES)}, "content": "text"}}, '
                f"got {json.dumps(m)[:120]}"
            )
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
        tok = self.tokenizer
        added = tok.backend.get_added_tokens_decoder()
        self._special = {t.content: i for i, t in added.items() if t.special and t.content}
        self._stop_texts = [tok.id_to_token(i) for i in tok.stop_ids]
        added_names = {t.content for t in added.values()}
        for name in [*tok.special_tokens.values(), *(s for s in self._stop_texts if s in added_names)]:
            if name is not None:
                # (tokens of the vocabulary: Tokenizer.from_file checked the specials, stops are added tokens)
                self._special.setdefault(name, cast(int, tok.token_to_id(name)))
        longest_first = sorted(self._special, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(s) for s in longest_first)) if longest_first else None
        # The variables transformers passes: the named special tokens that exist.
        self._names = {f"{k}_token": v for k, v in tok.special_tokens.items() if v is not None}

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError
        from jinja2.exceptions import SecurityError

        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._names,
            )
        except SecurityError as e:
            raise DataError(
                f"chat template {self.name} tried an unsafe operation ({e}); it was stopped by the "
                "sandbox; use a trusted template"
            ) from None
        except TemplateError as e:
            raise DataError(f"chat template {self.name} failed to render ({e})") from None

    def _spans(
        self, text: str, messages: Sequence[dict[str, str]], strict: bool = True
    ) -> list[tuple[int, int, int, bool]]:
        """(start, content end, span end, trained) of each rendered message content, in order; an
        assistant span extends past its content over the end-of-turn marker. Not strict (a prompt): a
        message the template does not reproduce verbatim is skipped."""
        spans, pos = [], 0
        for i, m in enumerate(messages):
            content = m["content"].strip()
            if not content:
                continue
            at = text.find(content, pos)
            if at < 0:
                if not strict:
                    continue
                raise DataError(
                    f"chat template {self.name} does not reproduce message {i} ({m['role']}) verbatim, so "
                    "its tokens cannot be located for the loss mask; use a template that inserts "
                    "message content unchanged"
                )
            end = content_end = at + len(content)
            if m["role"] == "assistant":
                nxt = [text.find(n["content"].strip(), end) for n in messages[i + 1 :] if n["content"].strip()]
                limit = min([x for x in nxt if x >= 0], default=len(text))
                gap = text[end:limit]
                # Train on the end-of-turn marker too: through the first stop token, else up to the line end.
                hits = sorted((k, -len(s)) for s in self._stop_texts if s and (k := gap.find(s)) >= 0)
                end += hits[0][0] - hits[0][1] if hits else len(gap.split("\n", 1)[0])
            spans.append((at, content_end, end, m["role"] == "assistant"))
            pos = end
        return spans

    def _tokens(self, text: str, protected: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character spans of `text`: special-token strings outside `protected` become control ids,
        every run of text between them is encoded whole."""
        ids: list[int] = []
        where: list[tuple[int, int]] = []

        def plain(a: int, b: int) -> None:
            if a < b:
                enc = self.tokenizer.backend.encode(text[a:b], add_special_tokens=False)
                ids.extend(enc.ids)
                where.extend((a + s, a + e) for s, e in enc.offsets)

        last = 0
        for m in self._special_re.finditer(text) if self._special_re is not None else ():
            if any(m.start() < b and m.end() > a for a, b in protected):
                continue  # inside message content: plain text, so a user cannot forge a control token
            plain(last, m.start())
            ids.append(self._special[m.group()])
            where.append((m.start(), m.end()))
            last = m.end()
        plain(last, len(text))
        return ids, where

    def encode(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False
    ) -> tuple[list[int], list[int]]:
        """(ids, mask) of one conversation; mask 1 = train on this token. BOS first when the model adds one,
        EOS last unless a stop token already ends the last turn; with add_generation_prompt (a prompt to
        generate from) nothing is appended."""
        tok = self.tokenizer
        text = self.render(messages, add_generation_prompt)
        spans = self._spans(text, messages, strict=not add_generation_prompt)
        ids, where = self._tokens(text, [(a, ce) for a, ce, _, _ in spans])
        trained = [(a, e) for a, _, e, t in spans if t]
        mask = [int(any(s < b and e > a for a, b in trained)) for s, e in where]
        if tok.add_bos and ids[:1] != [tok.bos_id]:
            ids.insert(0, cast(int, tok.bos_id))  # (add_bos: the model has a BOS token)
            mask.insert(0, 0)
            where.insert(0, (0, 0))
        if not add_generation_prompt:
            last_content = spans[-1][1] if spans else 0
            closed = any(i in tok.stop_ids for i, (s, _) in zip(ids, where) if s >= last_content)
            if not closed:
                ids.append(tok.eos_id)
                mask.append(int(messages[-1]["role"] == "assistant"))  # learn to stop after the last answer
        return ids, mask


__all__ = [
    "BUILTIN_TEMPLATES",
    "ChatEncoder",
    "DEFAULT_TEMPLATE",
    "ROLES",
    "check_messages",
    "compile_template",
    "resolve_template",
]
