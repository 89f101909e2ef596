"""Export a trained model for inference: Hugging Face safetensors, GGUF, ONNX; and a terminal chat.

One module per format (hf.py, gguf.py, onnx.py); source.py loads MODEL (merging a LoRA adapter),
metadata.py writes and checks the provenance record every export carries.
"""

from fitlm.export.errors import ExportError, ONNXShapeError

__all__ = ["ExportError", "ONNXShapeError"]
