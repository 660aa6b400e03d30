"""GGUF files (llama.cpp, Ollama, LM Studio) as mlx-lm models: read with ``mx.load``, converted once.

``prepare(path)`` returns a cached mlx-lm folder for the file; ``chatkit.load`` calls it for paths
that are GGUF files.
"""

from .arch import SUPPORTED
from .convert import CONVERTER_VERSION, file_sha256, prepare
from .reader import is_gguf, tensor_types

__all__ = ["CONVERTER_VERSION", "SUPPORTED", "file_sha256", "is_gguf", "prepare", "tensor_types"]
