"""Real chat templates (tests/data/templates, from llama.cpp's collection): every template renders every
conversation chatkit can hold (instructions, reasoning, tool calls, tool results), adapted to what each
template was probed to support; a prompt that leaves <think> open starts the reply in reasoning."""

import warnings
from pathlib import Path

from chatkit import ChatMessage, ChatSession, GenerateParams, ToolCall
from chatkit.testing import Scripted

import pytest

TEMPLATES = Path(__file__).parent / "data" / "templates"
ALL = sorted(p.name for p in TEMPLATES.glob("*.jinja"))
IGNORE_TOOLS = {  # these templates never render the tools they are given: chatkit warns
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-ai-DeepSeek-V3.1.jinja",
    "google-gemma-2-2b-it.jinja", "microsoft-Phi-3.5-mini-instruct.jinja",
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = ToolCall("Xy12ab34c", "get_weather", {"city": "Lisbon"})
HISTORY = [
    ChatMessage.user("Weather in Lisbon?"),
    ChatMessage.assistant("", reasoning="I should look it up.", tool_calls=[CALL]),
    ChatMessage.tool("sunny_result_text", name="get_weather", tool_call_id=CALL.id),
    ChatMessage.assistant("It is sunny in Lisbon."),
]


@pytest.fixture(scope="module")
def lm():
    from chatkit.testing import tiny_model

    return tiny_model(tokenizer="bpe-think")


@pytest.mark.parametrize("name", ALL)
def test_every_template_renders_a_conversation_with_instructions_tools_and_tool_turns(lm, name):
    session = (ChatSession.builder(lm).chat_template(TEMPLATES / name).instructions("Instructions_text.")
               .tools([WEATHER]).history(HISTORY).build())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prompt = session.render("Thanks!")
    for text in ("Instructions_text.", "Weather in Lisbon?", "Lisbon", "sunny_result_text", "It is sunny in Lisbon.", "Thanks!"):
        assert text in prompt, f"{name} lost {text!r}"
    said = " ".join(str(w.message) for w in caught)
    assert ("does not render the tools" in said) == (name in IGNORE_TOOLS), said


@pytest.mark.parametrize("name", ALL)
def test_every_template_renders_a_session_without_tools(lm, name):
    # Hermes-3 loops over `tools` when it is defined: chatkit passes [] where None would fail.
    session = ChatSession.builder(lm).chat_template(TEMPLATES / name).instructions("Be brief.").build()
    assert "Hi there" in session.render("Hi there")


def test_gemma2_has_no_system_role_so_the_instructions_open_the_first_user_message(lm):
    session = ChatSession.builder(lm).chat_template(TEMPLATES / "google-gemma-2-2b-it.jinja").instructions("Be brief.").build()
    assert "<start_of_turn>user\nBe brief.\n\nHello<end_of_turn>" in session.render("Hello")


@pytest.mark.parametrize("name", ["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "Qwen-QwQ-32B.jinja"])
def test_a_generation_prompt_ending_in_think_starts_the_reply_in_reasoning(lm, name):
    script = Scripted(lm.tokenizer, ["The user greets me.\n</think>\n\nHello!"])
    session = (ChatSession.builder(lm).chat_template(TEMPLATES / name)
               .generate_params(GenerateParams(max_tokens=40, logits_processors=[script])).build())
    assert session.render("Hi").endswith("<think>\n")
    with session.stream_respond("Hi") as stream:
        kinds = [c.kind for c in stream]
    assert stream.text == "Hello!" and stream.reasoning == "The user greets me."
    assert kinds[0] == "reasoning" and session.history[-1].reasoning == "The user greets me."


def test_generated_tool_call_ids_render_in_mistral_templates_that_require_nine_alphanumerics(lm):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    script = Scripted(lm.tokenizer, [call])
    session = (ChatSession.builder(lm).chat_template(TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja")
               .tools([WEATHER], tool_execution="manual")
               .generate_params(GenerateParams(max_tokens=40, logits_processors=[script])).build())
    session.respond("Weather in Rome?")
    (pending,) = session.pending_tool_calls
    prompt = session.render(ChatMessage.tool("rain", tool_call_id=pending.id))
    assert f'"id": "{pending.id}"' in prompt and '"call_id": "' + pending.id in prompt


def test_a_template_that_changes_its_own_lists_renders_calls_in_its_own_format(lm):
    # Kimi-K2 queues call ids with list.append, which transformers' immutable sandbox refuses: chatkit
    # renders it in jinja's plain sandbox instead of falling back to calls written as JSON text.
    session = (ChatSession.builder(lm).chat_template(TEMPLATES / "Kimi-K2-Instruct.jinja").tools([WEATHER])
               .history(HISTORY).build())
    prompt = session.render("Thanks!")
    assert '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Lisbon"}' in prompt
    assert "## Return of functions.get_weather:0\nsunny_result_text" in prompt and '{"tool_calls"' not in prompt
