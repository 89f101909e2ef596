"""Model families (importing this registers `llama` and `gpt2`) and their weight formats."""

from fitlm.models.gpt2 import GPT2LMHeadModel
from fitlm.models.hf import HFFormatError, config_from_hf, config_to_hf, from_hf_state_dict, load_hf_dir, \
    save_hf_dir, to_hf_state_dict
from fitlm.models.io import LoadedModel, ModelDirError, load_model_dir, resolve_model_path, save_model_dir
from fitlm.models.layers import KVCache
from fitlm.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "GPT2LMHeadModel", "KVCache", "HFFormatError", "config_from_hf", "config_to_hf",
           "to_hf_state_dict", "from_hf_state_dict", "load_hf_dir", "save_hf_dir", "LoadedModel", "ModelDirError",
           "load_model_dir", "save_model_dir", "resolve_model_path"]
