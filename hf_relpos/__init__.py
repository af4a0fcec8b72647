"""hf_relpos: relative-position attention schemes as Hugging Face Transformers models."""

from . import functional

__version__ = "0.1.0"
__all__ = ["functional"]
