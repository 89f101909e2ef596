"""k-quants for `--format gguf --dtype q4_k_m | q5_k_m | q6_k`, by llama.cpp's own quantizer.

The files people pull for Ollama and LM Studio are Q4_K_M and Q5_K_M: not one type, but llama.cpp's mixture per
tensor (Q4_K_M keeps some attention-value and FFN-down matrices and the output head at more bits, and falls back
to other types for rows that are not a multiple of 256 wide). That mixture is llama.cpp's policy, so fitlm
does not re-implement it: the model is written at f16 (fitlm/export/gguf.py), then llama.cpp's
llama_model_quantize (through llama-cpp-python, the `llamacpp` extra) makes the k-quant file from it, keeping every
metadata key (tokenizer, chat template, fitlm's export record).
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from pathlib import Path

from fitlm.export.errors import ExportError

KQUANTS = {
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
}
BITS_PER_WEIGHT = {"q4_k_m": 4.9, "q5_k_m": 5.7, "q6_k": 6.6}  # about, with llama.cpp's mixture (disk estimate)


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise ExportError(
            "--dtype q4_k_m / q5_k_m / q6_k use llama.cpp's quantizer, which fitlm calls through "
            "llama-cpp-python: pip install 'fitlm[llamacpp]' (a 10-15 minute build; "
            "CMAKE_ARGS='-DLLAMA_CURL=OFF' skips its download support). Or export --dtype f16 and run "
            "llama.cpp's own `llama-quantize model.gguf out.gguf Q4_K_M`"
        ) from None
    return llama_cpp


def quantize(src: Path, dst: Path, dtype: str, threads: int | None = None) -> None:
    """Write `dst`, the k-quant `dtype` of the f16/f32 GGUF file `src`, with llama.cpp's per-tensor mixture."""
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, KQUANTS[dtype])
    params.nthread = threads or os.cpu_count() or 1
    # llama.cpp logs a line per tensor to the process's stderr (C code: not sys.stderr); kept aside, shown on failure
    with tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if rc != 0:
            log.seek(0)
            tail = log.read().decode("utf-8", "replace").strip().splitlines()[-5:]
            raise ExportError(
                f"llama.cpp's quantizer failed ({rc}) making {dtype} from {src}: "
                f"{' / '.join(tail)}; export --dtype q8_0 or f16 instead"
            )


__all__ = ["BITS_PER_WEIGHT", "KQUANTS", "quantize"]
