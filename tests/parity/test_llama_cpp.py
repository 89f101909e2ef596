"""llama.cpp itself (llama-cpp-python, built from its source package) as the judge of `fitlm export --format gguf`.

For every family fitlm writes to GGUF, on tiny transformers-made checkpoints with real tokenizers of that family's
kind (tests/parity/llama_cpp_models.py), at f32, f16 and q8_0:
- llama.cpp loads the file with no metadata override and tokenizes mixed-script prompts (and its converter's
  own check text) exactly as transformers does with the checkpoint's tokenizer.json;
- teacher-forced on fitlm's greedy tokens, llama.cpp's logits agree with fitlm's within a bound per type (BOUND);
- llama.cpp's rendering of the embedded chat template (its own template engine, llama_chat_apply_template) equals
  fitlm's Jinja rendering for a conversation with a system turn (less the leading BOS text, which llama.cpp adds
  as a token when it tokenizes).
"""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from fitlm.data.chat import ChatEncoder, resolve_template
from fitlm.data.gguf_vocab import CHECK_TEXT
from fitlm.data.tokenizer import Tokenizer
from fitlm.export.gguf import export_gguf
from fitlm.infer import generate
from fitlm.models.io import load_model_dir
from tests.parity.llama_cpp_models import CASES, build
from tests.unit.model_tokenizers import MULTILINGUAL, NUMBERS

PROMPTS = [
    MULTILINGUAL,
    NUMBERS,
    "Hello world! I'm here, DON'T panic:\n\n  indented\ttab   end.",
    CHECK_TEXT,
    "What is a river?  Water   that flows...\r\nend",
]
CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is a river?"},
    {"role": "assistant", "content": "Water that flows."},
    {"role": "user", "content": "And 河流?"},
]
# Largest |llama.cpp - fitlm| logit, relative to the largest |fitlm| logit, over 24 teacher-forced positions, on
# random weights (larger errors than trained ones). f32 measured 1e-6 (2e-4 for Gemma: ggml's GELU goes through an
# f16 table); f16 about 2e-3; q8_0 2-6e-2 (llama.cpp also rounds the activations to 8 bits in q8_0 products).
BOUND = {"f32": 1e-3, "f16": 1e-2, "q8_0": 1e-1}
# The chat formats llama.cpp's template engine recognises among these cases (llama-chat.cpp's detection).
CHAT_CASES = ["llama3", "qwen2.5", "qwen3", "smollm", "fitlm-bpe", "phi3", "gemma2", "gemma3"]


def _quiet(level, text, user_data) -> None:  # llama.cpp's log lines (also non-UTF-8 ones) stay out of the output
    return None


_LOG = llama_cpp.llama_log_callback(_quiet)
llama_cpp.llama_log_set(_LOG, ctypes.c_void_p(0))


def open_llama(path) -> llama_cpp.Llama:
    """The file in llama.cpp, its KV cache in f32 (llama.cpp's default f16 cache would be most of the f32 error)."""
    f32 = llama_cpp.GGML_TYPE_F32
    return llama_cpp.Llama(
        str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0, type_k=f32, type_v=f32
    )


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    d = build(request.param, root)
    return request.param, d, load_model_dir(d), root


@pytest.fixture(scope="module")
def files(case):
    """f32 / f16 / q8_0 exports of the case's checkpoint."""
    name, d, loaded, root = case
    return {dtype: export_gguf(loaded, root / f"m-{dtype}.gguf", dtype) for dtype in BOUND}


def test_llama_cpp_tokenizes_as_transformers(case, files):
    """As the model's tokenizer encodes a prompt: transformers' AutoTokenizer, and fitlm's Tokenizer with the model's
    BOS rule (for fitlm's own tokenizers, whose convention puts BOS first, only fitlm's)."""
    name, d, loaded, _ = case
    tok = Tokenizer.from_file(d)
    hf = None if tok.fitlm_convention else AutoTokenizer.from_pretrained(d)
    llm = open_llama(files["f32"]["out"])
    try:
        for text in PROMPTS:
            ours = tok.encode(text, add_bos=tok.add_bos)
            assert hf is None or ours == hf.encode(text), (name, text)
            assert llm.tokenize(text.encode(), add_bos=True, special=False) == ours, (name, text)
    finally:
        llm.close()


def _fitlm_greedy(loaded, tok: Tokenizer) -> list[int]:
    prompt = tok.encode("What is a river? 你好 1234", add_bos=tok.add_bos)
    torch.manual_seed(0)
    new = generate(loaded.model, prompt, max_new_tokens=24 - len(prompt), eos_id=None)
    return prompt + new


def _compare(model, path, ids: list[int]) -> tuple[np.ndarray, np.ndarray, float]:
    """(fitlm's logits, llama.cpp's logits of the file at `path`, largest difference relative to fitlm's largest)."""
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].float().numpy()
    llm = open_llama(path)
    try:
        llm.eval(ids)
        theirs = np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
    return ours, theirs, float(np.abs(theirs - ours).max() / np.abs(ours).max())


@pytest.mark.parametrize("dtype", list(BOUND))
def test_llama_cpp_logits_follow_fitlm_teacher_forced(case, files, dtype):
    name, d, loaded, _ = case
    ids = _fitlm_greedy(loaded, Tokenizer.from_file(d))
    ours, theirs, err = _compare(loaded.model, files[dtype]["out"], ids)
    print(f"{name} {dtype}: relative logit error {err:.2e}")
    assert err <= BOUND[dtype], f"{name} {dtype}: relative logit error {err:.2e} > {BOUND[dtype]:.0e}"
    if dtype == "f32":  # and the greedy tokens are fitlm's
        assert (theirs[:-1].argmax(-1) == ours[:-1].argmax(-1)).all()


def _llama_cpp_chat(template: str, messages: list[dict[str, str]]) -> str:
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in messages]
    )
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(messages), True, buf, len(buf))
    assert n > 0, "llama.cpp does not recognise the embedded chat template"
    return buf.raw[:n].decode()


@pytest.mark.parametrize("case", CHAT_CASES, indirect=True)
def test_llama_cpp_renders_the_embedded_chat_template_as_fitlm(case, files):
    from gguf import GGUFReader

    name, d, loaded, _ = case
    embedded = str(GGUFReader(files["f32"]["out"]).fields["tokenizer.chat_template"].contents())
    tok = Tokenizer.from_file(d)
    assert embedded == resolve_template(None, tok.path)[1]
    ours = ChatEncoder(tok, embedded).render(CONVERSATION, add_generation_prompt=True)
    bos = tok.special_tokens["bos"]
    if tok.add_bos and bos and ours.startswith(bos):
        ours = ours[len(bos) :]  # llama.cpp's formats leave BOS to the tokenizer (add_bos_token)
    assert _llama_cpp_chat(embedded, CONVERSATION) == ours


# k-quants: llama.cpp's logits on the file against fitlm's on the same file imported (so the same dequantized
# weights; what is left is llama.cpp rounding activations to 8 bits in its k-quant products). The error against
# the f32 model is the type's own, reported by bench/gguf_quants.py and the README, not asserted.
KQUANT_BOUND = 5e-2
KQUANT_TYPES = {"q4_k_m": {"Q4_K", "Q6_K"}, "q5_k_m": {"Q5_K", "Q6_K"}, "q6_k": {"Q6_K"}}


@pytest.fixture(scope="module")
def kquant_case(tmp_path_factory):
    from tests.parity.llama_cpp_models import KQUANT_CASE

    root = tmp_path_factory.mktemp("kquant")
    d = build("llama3-256", root, spread=False, case=KQUANT_CASE)
    return d, load_model_dir(d), root


@pytest.mark.parametrize("dtype", list(KQUANT_TYPES))
def test_k_quants_are_llama_cpps_mixture_and_read_alike(kquant_case, dtype):
    from gguf import GGUFReader

    from fitlm.export.gguf import read_export_metadata

    d, loaded, root = kquant_case
    summary = export_gguf(loaded, root / f"m-{dtype}.gguf", dtype)
    reader = GGUFReader(summary["out"])
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    assert KQUANT_TYPES[dtype] <= kinds, kinds  # llama.cpp's per-tensor mixture, not one type
    assert read_export_metadata(summary["out"])["dtype"] == dtype and summary["vocabulary"] == "gpt2 llama-bpe"
    ids = _fitlm_greedy(loaded, Tokenizer.from_file(d))
    back = load_model_dir(summary["out"])  # fitlm's GGUF import dequantizes the k-quant blocks
    _, _, err = _compare(back.model, summary["out"], ids)
    llm = open_llama(summary["out"])
    try:
        assert llm.tokenize(PROMPTS[0].encode(), add_bos=True) == back_tokens(back, PROMPTS[0])
    finally:
        llm.close()
    print(f"{dtype}: {summary['bytes']} bytes, relative logit error {err:.2e} against fitlm on the same file")
    assert err <= KQUANT_BOUND, f"{dtype}: relative logit error {err:.2e} > {KQUANT_BOUND}"


@pytest.fixture(scope="module")
def kquant_moe_cases(tmp_path_factory):
    from tests.parity.llama_cpp_models import KQUANT_MOE_CASES

    root = tmp_path_factory.mktemp("kquant-moe")
    built = {}
    for name, case in KQUANT_MOE_CASES.items():
        d = build(name, root / name, spread=False, case=case)
        _decisive_routers(d)
        built[name] = (d, load_model_dir(d), root / name)
    return built


def _decisive_routers(d) -> None:
    """Routers 30× transformers' initialisation: at std 0.02 every token's expert scores nearly tie, so llama.cpp's
    8-bit activations in the k-quant products flip top-k choices that a trained router makes with a margin."""
    from safetensors.torch import load_file, save_file

    f = d / "model.safetensors"
    weights = load_file(str(f))
    router = ("mlp.gate.weight", "block_sparse_moe.gate.weight")  # Qwen-MoE, Mixtral
    save_file({k: v * 30 if k.endswith(router) else v for k, v in weights.items()}, str(f), {"format": "pt"})


@pytest.mark.parametrize(
    "family,dtype",
    [("qwen3-moe", "q4_k_m"), ("qwen3-moe", "q5_k_m"), ("qwen3-moe", "q6_k"), ("qwen2-moe", "q4_k_m")]
    + [("mixtral", "q4_k_m")],
)
def test_moe_k_quants_are_llama_cpps_mixture_and_read_alike(kquant_moe_cases, family, dtype):
    """The stacked experts ([E, I, H] as ffn_*_exps) quantized by llama.cpp's per-tensor mixture (Q4_K_M gives
    some blocks' ffn_down_exps Q6_K); llama.cpp runs the file and follows fitlm's logits on it as for dense models."""
    from gguf import GGUFReader

    d, loaded, root = kquant_moe_cases[family]
    summary = export_gguf(loaded, root / f"m-{dtype}.gguf", dtype)
    experts = {t.name: t.tensor_type.name for t in GGUFReader(summary["out"]).tensors if "_exps." in t.name}
    assert experts and set(experts.values()) <= KQUANT_TYPES[dtype], experts
    assert KQUANT_TYPES[dtype] <= {t for n, t in experts.items()} | {"Q6_K"}  # the type itself is used
    back = load_model_dir(summary["out"])  # fitlm's GGUF import dequantizes the k-quant blocks
    ids = _fitlm_greedy(back, Tokenizer.from_file(d))
    _, _, err = _compare(back.model, summary["out"], ids)
    print(f"{family} {dtype}: {summary['bytes']} bytes, relative logit error {err:.2e} against fitlm on the same file")
    assert err <= KQUANT_BOUND, f"{family} {dtype}: relative logit error {err:.2e} > {KQUANT_BOUND}"


def back_tokens(back, text: str) -> list[int]:
    """fitlm's encoding with the tokenizer imported from the GGUF file itself."""
    from fitlm.infer.text import load_tokenizer

    tok = load_tokenizer(back, back.path)
    return tok.encode(text, add_bos=tok.add_bos)


@pytest.mark.parametrize("case", ["llama3", "qwen2.5", "gemma3", "phi3"], indirect=True)
def test_gguf_import_then_export_keeps_the_tokenizer(case, files, tmp_path):
    """GGUF -> fitlm import -> GGUF again: the same vocabulary kind and name, tokens, merges or scores' order,
    specials, BOS rule and chat template; llama.cpp tokenizes the second file as the first."""
    from gguf import GGUFReader

    from fitlm.finetune.importer import import_model

    first = files["f32"]["out"]
    import_model(first, tmp_path / "imported")
    again = export_gguf(load_model_dir(tmp_path / "imported"), tmp_path / "again.gguf", "f32")
    a, b = (GGUFReader(str(f)).fields for f in (first, again["out"]))
    keys = [k for k in a if k.startswith("tokenizer.") and k != "tokenizer.ggml.scores"]
    assert {k: a[k].contents() for k in keys} == {k: b[k].contents() for k in keys if k in b}
    assert set(keys) <= set(b)
    if "tokenizer.ggml.scores" in a:  # SentencePiece: the merge order (scores' ranking) is what tokenizes
        sa, sb = (np.array(f["tokenizer.ggml.scores"].contents()) for f in (a, b))
        assert (np.argsort(-sa, kind="stable") == np.argsort(-sb, kind="stable")).all()
    llm1, llm2 = open_llama(first), open_llama(again["out"])
    try:
        for text in PROMPTS:
            assert llm1.tokenize(text.encode(), add_bos=True) == llm2.tokenize(text.encode(), add_bos=True)
    finally:
        llm1.close()
        llm2.close()
