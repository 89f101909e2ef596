"""The Ollama Modelfile `fitlm export --format gguf` writes beside the file (fitlm/export/modelfile.py).

Checked for what `ollama create` reads: FROM the GGUF beside it, the Go TEMPLATE of the model's format
(ChatML for Qwen, with its default system prompt as SYSTEM; Llama 3's headers), PARAMETER stop for the
end-of-turn and the tokenizer's stop tokens, and num_ctx = the model's context. How Ollama renders those
templates is checked with Go itself in tests/parity/test_ollama_template.py.
"""

from __future__ import annotations

import re

import pytest

from fitlm.export.modelfile import FORMATS, _quoted, modelfile_text
from tests.unit.model_tokenizers import STYLES
from tests.unit.serve_models import chat_model_dir


def chat_format(template: str) -> str | None:
    """The first format in FORMATS whose markers all appear in the Jinja source (as `match_format` picks its
    candidates, before rendering the probes)."""
    return next((name for name, fmt in FORMATS.items() if all(m in template for m in fmt.markers)), None)


@pytest.mark.parametrize(
    "style, fmt, system, stops",
    [
        ("qwen", "chatml", "You are a helpful assistant.", ['"<|im_end|>"']),
        ("llama3", "llama3", None, ['"<|eot_id|>"', '"<|end_of_text|>"']),
    ],
)
def test_gguf_export_writes_an_ollama_modelfile(tmp_path, style, fmt, system, stops):
    from fitlm.data.tokenizer import Tokenizer
    from fitlm.export.gguf import export_gguf
    from fitlm.models.io import load_model_dir

    loaded = load_model_dir(chat_model_dir(tmp_path, style, context=128))
    summary = export_gguf(loaded, tmp_path / "out" / "chat-f16.gguf", "f16")
    path = tmp_path / "out" / "chat-f16.Modelfile"
    assert summary["modelfile"] == str(path)
    text = path.read_text()
    assert re.search(r"^FROM \./chat-f16\.gguf$", text, re.M)
    blocks = dict(re.findall(r'^(TEMPLATE|SYSTEM) """(.*?)"""$', text, re.M | re.S))
    tok = Tokenizer.from_file(loaded.tokenizer_path)
    assert blocks["TEMPLATE"] == FORMATS[fmt].template(tok.special_tokens["bos"] or "", tok.special_tokens["eos"])
    assert blocks.get("SYSTEM") == system
    params = re.findall(r"^PARAMETER stop (.+)$", text, re.M)
    assert set(stops) <= set(params) and len(params) == len(set(params))
    assert re.search(r"^PARAMETER num_ctx 128$", text, re.M)


def test_formats_are_recognised_and_unknown_ones_left_to_ollama():
    from fitlm.data.chat import BUILTIN_TEMPLATES

    assert [chat_format(BUILTIN_TEMPLATES[n]) for n in ("chatml", "inst", "plain")] == ["chatml", "inst", "plain"]
    assert [chat_format(STYLES[s]["template"]) for s in ("qwen", "llama3", "gemma", "phi3")] == [
        "chatml",
        "llama3",
        "gemma",
        "phi3",
    ]
    unknown = modelfile_text("m.gguf", "{{ messages[0]['content'] }}", None, 64)
    assert "\nTEMPLATE" not in unknown and "# TEMPLATE:" in unknown and "FROM ./m.gguf" in unknown
    assert _quoted('say "hi" \\ bye') == '"say \\"hi\\" \\\\ bye"'
