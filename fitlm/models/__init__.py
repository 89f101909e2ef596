"""Model families (importing this registers every built-in family) and their weight formats.

Registration order is the README families table's order; each line is the one registration of a family.
"""

from fitlm.models import gemma, gpt2, llama, phi3, qwen  # noqa: F401  (each registers its families)
from fitlm.models.gemma.model import Gemma2ForCausalLM, Gemma3ForCausalLM
from fitlm.models.gpt2.model import GPT2LMHeadModel
from fitlm.models.hf import (
    HFFormatError,
    config_from_hf,
    config_to_hf,
    from_hf_state_dict,
    load_hf_dir,
    save_hf_dir,
    to_hf_state_dict,
)
from fitlm.models.io import LoadedModel, ModelDirError, load_model_dir, resolve_model_path, save_model_dir
from fitlm.models.layers import KVCache
from fitlm.models.llama.model import LlamaForCausalLM
from fitlm.models.phi3.model import Phi3ForCausalLM
from fitlm.models.qwen.model import Qwen2ForCausalLM, Qwen3ForCausalLM

__all__ = [
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "GPT2LMHeadModel",
    "KVCache",
    "HFFormatError",
    "config_from_hf",
    "config_to_hf",
    "to_hf_state_dict",
    "from_hf_state_dict",
    "load_hf_dir",
    "save_hf_dir",
    "LoadedModel",
    "ModelDirError",
    "load_model_dir",
    "save_model_dir",
    "resolve_model_path",
]
