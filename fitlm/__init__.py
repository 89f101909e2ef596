"""fitlm: pretrain and fine-tune LLMs on the hardware you actually have."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fitlm")
except PackageNotFoundError:  # run from a source tree without installing
    __version__ = "0.0.0+source"
