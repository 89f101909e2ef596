"""Export errors: ValueError subclasses, so the CLI prints them as one fixable paragraph."""

from __future__ import annotations


class ExportError(ValueError):
    """An export that cannot be made as asked (bad dtype, output path, adapter, shape...)."""


class ONNXShapeError(ExportError):
    """A static-shape ONNX export fed inputs of another shape; re-export with --dynamic-shape."""
