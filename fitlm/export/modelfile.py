"""An Ollama Modelfile beside each GGUF export, so `ollama create NAME -f model.Modelfile` works.

Ollama renders prompts with Go templates, not Jinja, so the model's chat template is not copied. Each
known format (ChatML, Llama 3 headers, Gemma turns, Phi-3 tags, Llama 2 [INST], fitlm's "plain") is a
Go template over `.Messages` plus the same rendering written in Python; tests/parity/test_ollama_template.py
executes the Go templates with Go's text/template as Ollama's server does and holds the two equal.
A format is written only after the Python rendering reproduced the model's Jinja template on probe
conversations (with and without a system turn, several turns; BOS left out, llama.cpp adds it from the
GGUF's add_bos_token). A default system prompt the Jinja template inserts (Qwen's) becomes SYSTEM,
which Ollama prepends when a conversation has none. A template no format reproduces gets no TEMPLATE
(Ollama then uses its own detection on the GGUF's tokenizer.chat_template) and a comment saying so.
PARAMETER stop lines name the end-of-turn marker and the tokenizer's stop tokens; num_ctx is the
model's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from fitlm.atomic import atomic_file
from fitlm.data.chat import ChatEncoder, resolve_template
from fitlm.data.errors import DataError
from fitlm.data.tokenizer import Tokenizer
from fitlm.models.io import LoadedModel

if TYPE_CHECKING:
    from fitlm.finetune.adapted import StreamedModel

Messages = Sequence[dict[str, str]]


@dataclass(frozen=True)
class Format:
    markers: tuple[str, ...]  # all present in the Jinja source = worth trying this format
    go: str  # Ollama's TEMPLATE (Go text/template over .Messages)
    render: Callable[
        [Messages, str, str], str
    ]  # the same prompt in Python (messages, bos, eos), generation prompt included
    stops: tuple[str, ...]  # end-of-turn strings for PARAMETER stop

    def template(self, bos: str, eos: str) -> str:
        """The Go template for a tokenizer whose BOS/EOS are these (only [INST] writes them: <s>, </s> in `go`)."""
        return self.go.replace("<s>", bos).replace("</s>", eos)


def _turns(head: Callable[[str], str], tail: str, prompt: str) -> Callable[[Messages, str, str], str]:
    """A format where every message is head(role) + content + tail, then the assistant prompt."""
    return lambda msgs, bos, eos: "".join(head(m["role"]) + m["content"] + tail for m in msgs) + prompt


def _gemma(msgs: Messages, bos: str, eos: str) -> str:
    # Gemma 3's template puts the system text before the first user turn's content, not in a turn of its own
    out, sys = [], ""
    for m in msgs:
        if m["role"] == "system":
            sys = m["content"] + "\n\n"
            continue
        role = "model" if m["role"] == "assistant" else "user"
        out.append(f"<start_of_turn>{role}\n{sys}{m['content']}<end_of_turn>\n")
        sys = ""
    return "".join(out) + "<start_of_turn>model\n"


def _inst(msgs: Messages, bos: str, eos: str) -> str:
    # Llama 2: the system block opens the first [INST]; every later [INST] starts a new sequence with BOS
    out, sys, first = [], "", True
    for m in msgs:
        if m["role"] == "system":
            sys = f"<<SYS>>\n{m['content']}\n<</SYS>>\n\n"
        elif m["role"] == "user":
            out.append(("" if first else bos) + f"[INST] {sys}{m['content']} [/INST]")
            sys, first = "", False
        else:
            out.append(f" {m['content']} {eos}")
    return "".join(out)


_PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}

FORMATS: dict[str, Format] = {
    "chatml": Format(
        ("<|im_start|>",),
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
        _turns(lambda r: f"<|im_start|>{r}\n", "<|im_end|>\n", "<|im_start|>assistant\n"),
        ("<|im_end|>", "<|im_start|>"),
    ),
    "llama3": Format(
        ("<|start_header_id|>",),
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
        "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
        _turns(
            lambda r: f"<|start_header_id|>{r}<|end_header_id|>\n\n",
            "<|eot_id|>",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ("<|eot_id|>", "<|start_header_id|>"),
    ),
    "gemma": Format(
        ("<start_of_turn>",),
        '{{- $sys := "" }}{{- range .Messages }}{{ if eq .Role "system" }}{{ $sys = printf "%s\\n\\n" .Content }}'
        '{{ else }}<start_of_turn>{{ if eq .Role "assistant" }}model{{ else }}user{{ end }}\n'
        '{{ $sys }}{{ $sys = "" }}{{ .Content }}<end_of_turn>\n{{ end }}{{ end }}<start_of_turn>model\n',
        _gemma,
        ("<end_of_turn>", "<start_of_turn>"),
    ),
    "phi3": Format(
        ("<|assistant|>", "<|end|>"),
        "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n",
        _turns(lambda r: f"<|{r}|>\n", "<|end|>\n", "<|assistant|>\n"),
        ("<|end|>", "<|user|>"),
    ),
    "inst": Format(
        ("[INST]",),
        '{{- $sys := "" }}{{- $first := true }}{{- range .Messages }}{{ if eq .Role "system" }}'
        '{{ $sys = printf "<<SYS>>\\n%s\\n<</SYS>>\\n\\n" .Content }}'
        '{{ else if eq .Role "user" }}{{ if not $first }}<s>{{ end }}[INST] {{ $sys }}{{ $sys = "" }}'
        "{{ $first = false }}{{ .Content }} [/INST]{{ else }} {{ .Content }} </s>{{ end }}{{ end }}",
        _inst,
        ("[INST]",),
    ),
    "plain": Format(
        ("### ", "Assistant:"),
        '{{- range .Messages }}### {{ if eq .Role "system" }}System{{ else if eq .Role "user" }}User'
        "{{ else }}Assistant{{ end }}:\n{{ .Content }}\n\n{{ end }}### Assistant:\n",
        _turns(lambda r: f"### {_PLAIN_ROLES[r]}:\n", "\n\n", "### Assistant:\n"),
        ("### User:",),
    ),
}

# Conversations an Ollama TEMPLATE must render as the Jinja template does before it is written.
PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    (
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": "Nile."},
        {"role": "user", "content": "And a sea?"},
    ),
    ({"role": "user", "content": "Name a river."},),
    (
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a sea."},
    ),
)


def _specials(tokenizer: Tokenizer) -> tuple[str, str]:
    return tokenizer.special_tokens.get("bos") or "", tokenizer.special_tokens.get("eos") or ""


def _jinja_prompts(template: str, tokenizer: Tokenizer) -> list[tuple[Messages, str]]:
    """(probe, the Jinja prompt without the leading BOS) for each probe the template accepts."""
    encoder = ChatEncoder(tokenizer, template)
    bos = _specials(tokenizer)[0]
    out: list[tuple[Messages, str]] = []
    for probe in PROBES:
        try:
            text = encoder.render(probe, True)
        except DataError:  # e.g. Gemma 2 refuses a system turn; Ollama cannot be told to refuse, so skip it
            continue
        out.append((probe, text.removeprefix(bos) if bos else text))
    return out


def _default_system(render: Callable[[Messages], str], probe: Messages, jinja: str) -> str | None:
    """The system text the Jinja template inserted into a probe without one, if the format can say it."""
    head, _, tail = render([{"role": "system", "content": "\x00"}, *probe]).partition("\x00")
    if len(jinja) > len(head) + len(tail) and jinja.startswith(head) and jinja.endswith(tail):
        return jinja[len(head) : len(jinja) - len(tail)]
    return None


def _with_system(probe: Messages, system: str | None) -> list[dict[str, str]]:
    # what Ollama's chat handler does with a Modelfile SYSTEM
    if system and probe[0]["role"] != "system":
        return [{"role": "system", "content": system}, *probe]
    return list(probe)


def match_format(template: str, tokenizer: Tokenizer) -> tuple[str, str | None] | None:
    """(format name, default SYSTEM or None) whose Go template renders the probes as `template` does, else None."""
    prompts = _jinja_prompts(template, tokenizer)
    bos, eos = _specials(tokenizer)
    for name, fmt in FORMATS.items():
        if not all(m in template for m in fmt.markers):
            continue

        def render(msgs: Messages, fmt: Format = fmt) -> str:
            return fmt.render(msgs, bos, eos)

        system = None
        unsystemed = [(p, j) for p, j in prompts if p[0]["role"] != "system" and render(p) != j]
        if unsystemed:
            system = _default_system(render, *unsystemed[0])
        if prompts and all(render(_with_system(p, system)) == j for p, j in prompts):
            return name, system
    return None


def _quoted(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _block(keyword: str, text: str) -> str:
    if '"""' in text:  # the Modelfile's only quoting of multi-line values
        raise ValueError(f"a {keyword} containing triple quotes cannot be written into a Modelfile")
    return f'{keyword} """{text}"""'


def modelfile_text(gguf_name: str, template: str | None, tokenizer: Tokenizer | None, context: int) -> str:
    """The Modelfile for a GGUF file named `gguf_name` in the same directory."""
    lines = ["# Written by `fitlm export --format gguf`. Use: ollama create NAME -f THIS_FILE", f"FROM ./{gguf_name}"]
    matched = match_format(template, tokenizer) if template and tokenizer is not None else None
    stops: list[str] = []
    if matched is not None:
        name, system = matched
        assert tokenizer is not None  # (a format is matched only with a tokenizer)
        lines.append(_block("TEMPLATE", FORMATS[name].template(*_specials(tokenizer))))
        if system:
            lines.append(_block("SYSTEM", system))
        stops.extend(FORMATS[name].stops)
    elif template:
        lines.append(
            "# TEMPLATE: no Go template fitlm writes renders this chat template as its Jinja does; "
            "Ollama falls back to its own reading of the GGUF's tokenizer.chat_template"
        )
    if tokenizer is not None:
        stops.extend(t for t in (tokenizer.id_to_token(i) for i in tokenizer.stop_ids) if t)
    lines += [f"PARAMETER stop {_quoted(s)}" for s in dict.fromkeys(stops)]
    lines.append(f"PARAMETER num_ctx {context}")
    return "\n".join(lines) + "\n"


def modelfile_path(gguf: Path) -> Path:
    return gguf.with_suffix(".Modelfile")


def write_modelfile(loaded: LoadedModel | StreamedModel, gguf: str | Path) -> Path:
    """Write `<gguf stem>.Modelfile` beside the exported GGUF file; return its path."""
    gguf = Path(gguf)
    tok = template = None
    if loaded.tokenizer_path is not None:
        tok = Tokenizer.from_file(loaded.tokenizer_path)
        template = resolve_template(None, loaded.tokenizer_path)[1]
    text = modelfile_text(gguf.name, template, tok, loaded.config.model.max_seq_len)
    out = modelfile_path(gguf)
    with atomic_file(out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return out


__all__ = ["FORMATS", "PROBES", "Format", "match_format", "modelfile_path", "modelfile_text", "write_modelfile"]
