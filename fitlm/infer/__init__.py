"""Inference: KV-cached generation (and, beside it, chat)."""

from fitlm.infer.generate import generate, sample_next

__all__ = ["generate", "sample_next"]
