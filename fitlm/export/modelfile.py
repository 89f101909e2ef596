"""An Ollama Modelfile beside each GGUF export, so `ollama create NAME -f model.Modelfile` works.

Ollama renders prompts with Go templates, not Jinja, so the model's chat template is not copied: its
format is recognised by its markers (ChatML, Llama 3 headers, Gemma turns, Phi-3 tags, Llama 2
[INST], fitlm's "plain") and written as the equivalent Go template over `.Messages`, ending with the
assistant prompt. PARAMETER stop lines name the end-of-turn marker and the tokenizer's stop tokens;
num_ctx is the model's context. A template of no known format gets no TEMPLATE (Ollama then uses its
own detection on the GGUF's tokenizer.chat_template) and a comment saying so. BOS is not in the
templates: llama.cpp adds it from the GGUF's add_bos_token, as fitlm's export sets it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fitlm.atomic import atomic_file
from fitlm.data.chat import resolve_template
from fitlm.data.tokenizer import Tokenizer
from fitlm.models.io import LoadedModel

if TYPE_CHECKING:
    from fitlm.finetune.adapted import StreamedModel

# format -> (markers that identify it in the Jinja source, Go template, end-of-turn stop strings)
FORMATS: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    "chatml": (("<|im_start|>",),
               "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
               "<|im_start|>assistant\n", ("<|im_end|>", "<|im_start|>")),
    "llama3": (("<|start_header_id|>",),
               "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
               "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n", ("<|eot_id|>", "<|start_header_id|>")),
    "gemma": (("<start_of_turn>",),
              '{{- range .Messages }}<start_of_turn>{{ if eq .Role "assistant" }}model{{ else }}user{{ end }}\n'
              "{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n", ("<end_of_turn>", "<start_of_turn>")),
    "phi3": (("<|assistant|>", "<|end|>"),
             "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n",
             ("<|end|>", "<|user|>")),
    "inst": (("[INST]",),
             '{{- $sys := "" }}{{- range .Messages }}{{ if eq .Role "system" }}'
             '{{ $sys = printf "<<SYS>>\\n%s\\n<</SYS>>\\n\\n" .Content }}'
             '{{ else if eq .Role "user" }}[INST] {{ $sys }}{{ $sys = "" }}{{ .Content }} [/INST]'
             "{{ else }} {{ .Content }} </s>{{ end }}{{ end }}", ("[INST]",)),
    "plain": (("### ", "Assistant:"),
              '{{- range .Messages }}### {{ if eq .Role "system" }}System{{ else if eq .Role "user" }}User'
              "{{ else }}Assistant{{ end }}:\n{{ .Content }}\n\n{{ end }}### Assistant:\n", ("### User:",)),
}


def chat_format(template: str) -> str | None:
    """The known format a Jinja chat template writes, by its markers (first match in FORMATS order)."""
    for name, (markers, _, _) in FORMATS.items():
        if all(m in template for m in markers):
            return name
    return None


def _quoted(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def modelfile_text(gguf_name: str, template: str | None, tokenizer: Tokenizer | None, context: int) -> str:
    """The Modelfile for a GGUF file named `gguf_name` in the same directory."""
    lines = ["# Written by `fitlm export --format gguf`. Use: ollama create NAME -f THIS_FILE", f"FROM ./{gguf_name}"]
    fmt = chat_format(template) if template else None
    stops: list[str] = []
    if fmt is not None:
        _, go, turn_stops = FORMATS[fmt]
        if '"""' in go:  # cannot happen with FORMATS; guards the Modelfile quoting
            raise ValueError("a Go template containing triple quotes cannot be written into a Modelfile")
        lines.append(f'TEMPLATE """{go}"""')
        stops.extend(turn_stops)
    elif template:
        lines.append("# TEMPLATE: the chat template is of no format fitlm converts to Ollama's Go templates; "
                     "Ollama falls back to its own reading of the GGUF's tokenizer.chat_template")
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


__all__ = ["FORMATS", "chat_format", "modelfile_path", "modelfile_text", "write_modelfile"]
