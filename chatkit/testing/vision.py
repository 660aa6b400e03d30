"""Tiny random-weight vision-language models of real mlx-vlm architectures, built offline.

    from chatkit.testing.vision import VISION_ARCHS, tiny_vision_model, tiny_vision_model_path

``"qwen2_vl"``: Qwen2-VL (a ViT over 14x14 patches merged 2x2; ``<|vision_start|><|image_pad|>*N<|vision_end|>``;
M-RoPE positions), Qwen's byte-level BPE and the Qwen2-VL chat template, mlx-vlm's Qwen2-VL processor
(``preprocessor_config.json``: images are resized to 56x56 .. 112x112 pixels, 4 .. 16 image tokens).
``"qwen2_vl_tools"``: the same Qwen2-VL with Qwen2.5-VL's tool tokens (``<tool_call>`` ...) and a template
with tools that places images in tool results too (``QWEN_VL_TOOLS_TEMPLATE``).
``"gemma3"``: Gemma 3 (a SigLIP ViT pooled to ``mm_tokens_per_image`` soft tokens; the template writes one
``<start_of_image>`` per image, which the processor replaces by the text ``\n\n<start_of_image>`` + 4 x
``<image_soft_token>`` + ``<end_of_image>\n\n`` before tokenizing; plain RoPE, sliding-window layers), a
Gemma-style tokenizer and Gemma 3's chat template, mlx-vlm's Gemma 3 processor (28x28 images).
``"llava"``: LLaVA-1.5 (CLIP ViT + MLP projector over a Llama; one ``<image>`` expanded to one token per
patch, plain RoPE), a SentencePiece-style tokenizer with ``<image>``, LLaVA's ``USER: <image>\\n... ASSISTANT:``
template, and its processor (``processor_config.json`` + a CLIP image processor at 28x28: 4 image tokens).
Weights are float32 NumPy draws seeded by ``(seed, parameter name)``: the same files in every process.
Keyword overrides of the language model's sizes (``TEXT_SIZES``: ``hidden_size=512, num_hidden_layers=8`` ...)
give bigger text towers of the same architecture, e.g. for benchmarks (the vision tower stays tiny).
Needs the ``vision`` extra (mlx-vlm, pillow) besides ``testing``.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidParamsError
from .models import _init_weights, _keep_mlx_random_state, _lock, _root_dir
from .tokenizers import TokenizerFiles, _files, _qwen_bpe, _sentencepiece_like

if TYPE_CHECKING:
    from ..model.loaded import LoadedModel

VISION_ARCHS: tuple[str, ...] = ("qwen2_vl", "llava", "gemma3", "qwen2_vl_tools")
TEXT_SIZES: tuple[str, ...] = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads")

# Qwen2-VL's chat template (as released), which also reads plain string content.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2-VL's content parts with Qwen2.5's tools, tool calls and <tool_response> results (as Qwen3-VL's template
# does): image parts are placed in every role's content, tool results too. (Newlines after a tag are written
# as {{ NL }}: Hugging Face renders with trim_blocks, which drops a newline right after a tag.)
QWEN_VL_TOOLS_TEMPLATE = (
    "{% set NL = '\\n' %}{% macro render(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for part in content %}{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% if tools %}<|im_start|>system{{ NL }}{% if messages[0]['role'] == 'system' %}{{ render(messages[0]['content']) }}"
    "{{ NL }}{{ NL }}{% endif %}# Tools{{ NL }}{{ NL }}<tools>{% for tool in tools %}{{ NL }}{{ tool | tojson }}{% endfor %}"
    "{{ NL }}</tools>{{ NL }}{{ NL }}For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags.<|im_end|>{{ NL }}{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system{{ NL }}{{ render(messages[0]['content']) }}<|im_end|>{{ NL }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}<|im_start|>user{{ NL }}{{ render(message['content']) }}"
    "<|im_end|>{{ NL }}{% elif message['role'] == 'assistant' %}<|im_start|>assistant{{ NL }}{{ render(message['content']) }}"
    "{% for tool_call in message['tool_calls'] or [] %}{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    "{% if message['content'] or not loop.first %}{{ NL }}{% endif %}<tool_call>{{ NL }}{\"name\": \"{{ tool_call.name }}\", "
    "\"arguments\": {% if tool_call.arguments is string %}{{ tool_call.arguments }}{% else %}{{ tool_call.arguments | tojson }}{% endif %}}"
    "{{ NL }}</tool_call>{% endfor %}<|im_end|>{{ NL }}{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}{{ NL }}<tool_response>"
    "{{ NL }}{{ render(message['content']) }}{{ NL }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ NL }}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)

# LLaVA-1.5's template (images first, then the text of each message), reading string content too, and
# writing the BOS its tokenizer adds (chatkit tokenizes what templates write, adding nothing).
LLAVA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endif %}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Gemma 3's chat template (as released): images as <start_of_image>, the system text before the first user's.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}"
    "{%- endif -%}"
)

_QWEN_VL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                     "<|image_pad|>", "<|video_pad|>")
_MEAN, _STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def _qwen_vl_tokenizer() -> TokenizerFiles:
    from tokenizers import AddedToken

    tok = _qwen_bpe()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _QWEN_VL_SPECIALS])
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "errors": "replace", "clean_up_tokenization_spaces": False, "split_special_tokens": False,
              "chat_template": QWEN2_VL_TEMPLATE}
    return _files("qwen2_vl", tok, config, bos=None, eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>")


def _qwen_vl_tools_tokenizer() -> TokenizerFiles:
    """Qwen2.5-VL's specials (``<tool_call>`` ... as single tokens) and a template with tools."""
    from tokenizers import AddedToken

    tok = _qwen_bpe()
    specials = (*_QWEN_VL_SPECIALS, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "errors": "replace", "clean_up_tokenization_spaces": False, "split_special_tokens": False,
              "chat_template": QWEN_VL_TOOLS_TEMPLATE}
    return _files("qwen2_vl_tools", tok, config, bos=None, eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>")


def _llava_tokenizer() -> TokenizerFiles:
    tok = _sentencepiece_like(("<unk>", "<s>", "</s>", "<image>", "<pad>"), bos="<s>", unk="<unk>", dummy_prefix=True)
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
              "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": LLAVA_TEMPLATE}
    return _files("llava", tok, config, bos="<s>", eos=("</s>",), pad="<pad>")


def _gemma3_tokenizer() -> TokenizerFiles:
    specials = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                "<end_of_image>", "<image_soft_token>")
    tok = _sentencepiece_like(specials, bos="<bos>", unk="<unk>", dummy_prefix=False)
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
              "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": GEMMA3_TEMPLATE, "extra_special_tokens": {
                  "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}}
    return _files("gemma3", tok, config, bos="<bos>", eos=("<eos>", "<end_of_turn>"), pad="<pad>")


def _text(vocab: int, sizes: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, **sizes, "rms_norm_eps": 1e-6, "vocab_size": vocab,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32", **extra}


def _qwen2_vl(tok: TokenizerFiles, ids: dict[str, int], sizes: dict[str, int]) -> tuple[dict[str, Any], ...]:
    text = _text(tok.vocab_size, sizes)
    half = text["hidden_size"] // text["num_attention_heads"] // 2  # M-RoPE sections split half a head: 2:3:3
    config = {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
        **text, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "bos_token_id": None, "eos_token_id": list(tok.eos_token_ids), "pad_token_id": tok.pad_token_id,
        "vision_config": {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": text["hidden_size"],
                          "num_heads": 2,
                          "mlp_ratio": 2, "in_channels": 3, "patch_size": 14, "spatial_patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2},
    }
    image = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
             "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
             "min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "merge_size": 2,
             "temporal_patch_size": 2, "image_mean": _MEAN, "image_std": _STD}
    return config, image, {"processor_class": "Qwen2VLProcessor"}


def _llava(tok: TokenizerFiles, ids: dict[str, int], sizes: dict[str, int]) -> tuple[dict[str, Any], ...]:
    config = {
        "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
        "text_config": {"model_type": "llama", **_text(tok.vocab_size, sizes, rope_theta=10000.0)},
        "vision_config": {"model_type": "clip_vision_model", "num_hidden_layers": 2, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                          "projection_dim": 32, "num_channels": 3, "layer_norm_eps": 1e-5},
        "image_token_index": ids["<image>"], "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "vocab_size": tok.vocab_size, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_ids[0],
        "pad_token_id": tok.pad_token_id,
    }
    image = {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
             "do_resize": True, "size": {"shortest_edge": 28}, "do_center_crop": True,
             "crop_size": {"height": 28, "width": 28}, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "do_convert_rgb": True, "image_mean": _MEAN, "image_std": _STD, "resample": 3}
    processor = {"processor_class": "LlavaProcessor", "patch_size": 14, "image_token": "<image>",
                 "num_additional_image_tokens": 1, "vision_feature_select_strategy": "default"}
    return config, image, processor


def _gemma3(tok: TokenizerFiles, ids: dict[str, int], sizes: dict[str, int]) -> tuple[dict[str, Any], ...]:
    text = _text(tok.vocab_size, sizes)
    config = {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"model_type": "gemma3_text", **text, "head_dim": text["hidden_size"] // text["num_attention_heads"],
                        "query_pre_attn_scalar": text["hidden_size"] // text["num_attention_heads"],
                        "sliding_window": 512, "sliding_window_pattern": 2, "mm_tokens_per_image": 4},
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 2, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "image_size": 28, "patch_size": 7,
                          "layer_norm_eps": 1e-6},
        "image_token_index": ids["<image_soft_token>"], "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"], "mm_tokens_per_image": 4, "hidden_size": text["hidden_size"],
        "vocab_size": tok.vocab_size, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
        "eos_token_id": list(tok.eos_token_ids),
    }
    image = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
             "do_resize": True, "size": {"height": 28, "width": 28}, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "do_convert_rgb": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
             "resample": 2, "do_pan_and_scan": False}
    return config, image, {"processor_class": "Gemma3Processor", "image_seq_length": 4}


_ARCHS = {"qwen2_vl": (_qwen_vl_tokenizer, _qwen2_vl), "qwen2_vl_tools": (_qwen_vl_tools_tokenizer, _qwen2_vl), "llava": (_llava_tokenizer, _llava),
          "gemma3": (_gemma3_tokenizer, _gemma3)}


def _build(folder: Path, arch: str, seed: int, sizes: dict[str, int]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    tokenizer, configs = _ARCHS[arch]
    tok = tokenizer()
    ids = json.loads(tok.tokenizer_json)["added_tokens"]
    ids = {t["content"]: t["id"] for t in ids}
    config, image, processor = configs(tok, ids, sizes)
    module, _ = get_model_and_args(config)
    copy = json.loads(json.dumps(config))
    model_config = update_module_configs(module.ModelConfig.from_dict(copy), module, copy, ["text", "vision"])
    model = module.Model(model_config)
    _init_weights(model, arch, seed)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    mx.save_safetensors(str(partial / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    (partial / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (partial / "processor_config.json").write_text(json.dumps(processor, indent=2))
    generation = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (partial / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tok.write(partial)
    partial.rename(folder)


@functools.cache
def _path(arch: str, seed: int, sizes: tuple[tuple[str, int], ...]) -> Path:
    with _lock:
        name = "".join(f"-{k}{v}" for k, v in sizes)
        folder = _root_dir() / f"vision-{arch}-seed{seed}{name}"
        with _keep_mlx_random_state():
            _build(folder, arch, seed, dict(sizes))
        return folder


def _check(arch: str, seed: int, sizes: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    if arch not in VISION_ARCHS:
        raise InvalidParamsError(f"Unknown test vision arch {arch!r}; choose one of {', '.join(VISION_ARCHS)}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidParamsError(f"seed must be a non-negative int, got {seed!r}.")
    for key, value in sizes.items():
        if key not in TEXT_SIZES:
            raise InvalidParamsError(f"Unknown text size {key!r}; choose among {', '.join(TEXT_SIZES)}.")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidParamsError(f"{key} must be a positive int, got {value!r}.")
    text = _text(0, sizes)
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    if text["hidden_size"] % (heads * 16) or heads % kv:
        raise InvalidParamsError("hidden_size must be a multiple of 16 x num_attention_heads, and "
                                 "num_attention_heads a multiple of num_key_value_heads.")
    return tuple(sorted(sizes.items()))


def tiny_vision_model_path(arch: str = "qwen2_vl", seed: int = 0, **text_sizes: int) -> Path:
    """The folder of a tiny random ``arch`` vision-language model (one of VISION_ARCHS), built once per
    process into a temporary directory; ``mlx_vlm.load`` and ``chatkit.load`` read it. ``text_sizes``
    (see ``TEXT_SIZES``) make its language model bigger, e.g. ``hidden_size=512, num_hidden_layers=8``."""
    return _path(arch, seed, _check(arch, seed, text_sizes))


@functools.cache
def _loaded(arch: str, seed: int, sizes: tuple[tuple[str, int], ...]) -> LoadedModel:
    from ..model.load import load

    path = tiny_vision_model_path(arch, seed, **dict(sizes))
    with _lock, _keep_mlx_random_state():
        return load(path)


def tiny_vision_model(arch: str = "qwen2_vl", seed: int = 0, **text_sizes: int) -> LoadedModel:
    """The ``chatkit.load`` result of :func:`tiny_vision_model_path`, loaded once per process (shared)."""
    return _loaded(arch, seed, _check(arch, seed, text_sizes))


__all__ = ["GEMMA3_TEMPLATE", "LLAVA_TEMPLATE", "QWEN2_VL_TEMPLATE", "QWEN_VL_TOOLS_TEMPLATE", "TEXT_SIZES", "VISION_ARCHS", "tiny_vision_model", "tiny_vision_model_path"]
