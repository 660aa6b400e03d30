"""gpt-oss end to end: a test model with the harmony special tokens and gpt-oss's own chat template
(tests/data/templates). Reasoning (analysis), the answer (final) and tool calls (commentary to=functions)
land in their fields, the template renders them back (reasoning under ``thinking``), and the tool loop runs."""

import json
import shutil

import chatkit
from chatkit import ChatSession, GenerateParams
from chatkit.testing import Scripted, tiny_model_path

import pytest
from test_real_templates import TEMPLATES

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """The tiny qwen3 test model with harmony's specials added (its embedding grown to match)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, save_model

    folder = tmp_path_factory.mktemp("gpt-oss-like")
    shutil.copytree(tiny_model_path(arch="qwen3", tokenizer="bpe"), folder, dirs_exist_ok=True)
    tok = json.loads((folder / "tokenizer.json").read_text())
    first = max(t["id"] for t in tok["added_tokens"]) + 1
    ids = {s: first + i for i, s in enumerate(SPECIALS)}
    tok["added_tokens"] += [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for s, i in ids.items()]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(chat_template=(TEMPLATES / "openai-gpt-oss-120b.jinja").read_text(), eos_token="<|return|>")
    cfg.pop("added_tokens_decoder", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    config = json.loads((folder / "config.json").read_text())
    model, _ = load_model(folder)
    old = model.model.embed_tokens.weight
    mx.random.seed(0)
    grown = mx.concatenate([old, 0.02 * mx.random.normal((len(SPECIALS) + 1, old.shape[1]))])
    model.model.embed_tokens.weight = grown
    config.update(vocab_size=grown.shape[0], eos_token_id=[ids["<|return|>"], ids["<|call|>"]])
    (folder / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        (folder / extra).unlink(missing_ok=True)
    save_model(folder, model)
    (folder / "config.json").write_text(json.dumps(config))
    return chatkit.load(str(folder))


def weather(city: str) -> str:
    """The weather.

    Args:
        city: The city.
    """
    return f"sunny in {city}"


def test_gpt_oss_channels_map_to_reasoning_answer_and_tool_calls_and_the_loop_runs(gpt_oss):
    tok = gpt_oss.tokenizer
    call = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}')
    final = "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny in Oslo."
    script = Scripted(tok, [call, final], end_token=None)
    script.replies[0][-1] = tok.convert_tokens_to_ids("<|call|>")  # a call ends with <|call|>, an answer with <|return|>
    session = (ChatSession.builder(gpt_oss).tools([weather])
               .generate_params(GenerateParams(max_tokens=80, logits_processors=[script])).build())
    assert session.render("Weather in Oslo?").endswith("<|start|>assistant")
    with session.stream_respond("Weather in Oslo?") as stream:
        chunks = list(stream)
    assert stream.text == "Sunny in Oslo." and stream.reasoning == "It is sunny."
    user, asked, result, answer = session.history
    assert asked.reasoning == "Need the weather." and [(c.name, c.arguments) for c in asked.tool_calls] == [("weather", {"city": "Oslo"})]
    assert (result.content, result.name, result.tool_call_id) == ("sunny in Oslo", "weather", asked.tool_calls[0].id)
    assert answer.content == "Sunny in Oslo." and answer.reasoning == "It is sunny."
    assert all("<|" not in c.text for c in chunks if c.kind in ("text", "reasoning"))
    # gpt-oss's template renders the call from the fields (and the reasoning from `thinking`).
    rendered = session.render("And tomorrow?")
    assert 'to=functions.weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>' in rendered
    assert "sunny in Oslo" in rendered and "<|channel|>final<|message|>Sunny in Oslo.<|end|>" in rendered
