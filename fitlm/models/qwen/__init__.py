"""The Qwen2 / Qwen3 family folder: `spec.py` (torch-free: what config validation reads), `model.py`, `hf.py` and
`family.py` (the torch `Family`, registered at import). This file imports nothing, so importing the spec
runs no model code."""
