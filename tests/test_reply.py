"""Structured turns: reasoning / answer / tool-call segments, the state a prompt leaves, the thinking
switch and budget, and the history fields they fill."""

from types import SimpleNamespace

from chatkit import ChatMessage, ChatSession, GenerateParams, InvalidMessageError, ToolCall
from chatkit.testing import Scripted
from chatkit.testing.templates import QWEN3
from chatkit.text.reply import Segmenter, parse_tool_calls

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache
from mlx_lm.tool_parsers import json_tools

QWEN_MARKERS = SimpleNamespace(
    has_thinking=True, think_start="<think>", think_end="</think>",
    has_tool_calling=True, tool_call_start="<tool_call>", tool_call_end="</tool_call>",
    tool_parser=json_tools.parse_tool_call, response_transitions={}, structural_markers=(),
    response_initial_state=None,
)
REPLY = 'A<think>B b</think>C<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>D'
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def run(chunks, final=True, **options):
    seg = Segmenter(QWEN_MARKERS, **options)
    pieces = []
    for i, chunk in enumerate(chunks):
        pieces += seg.feed(chunk, final=final and i == len(chunks) - 1)
    return seg, pieces


def check_reply(seg, pieces):
    assert (seg.text, seg.reasoning) == ("CD".replace("C", "AC", 1), "B b")
    assert [(c.name, c.arguments, c.error) for c in seg.tool_calls] == [("f", {"x": 1}, None)]
    assert all(not any(m in p.text for m in MARKERS) and "<" not in p.text for p in pieces)
    assert "".join(p.text for p in pieces if p.kind == "text") == "ACD"
    assert "".join(p.text for p in pieces if p.kind == "reasoning") == "B b"
    assert [p.tool_call for p in pieces if p.tool_call is not None] == seg.tool_calls


@pytest.mark.parametrize("cut", range(1, len(REPLY)))
def test_every_split_point_of_every_marker(cut):
    check_reply(*run([REPLY[:cut], REPLY[cut:]]))


def test_one_character_at_a_time():
    check_reply(*run(list(REPLY)))


@pytest.mark.parametrize("cut", range(1, len(REPLY)))
def test_closing_in_the_middle_hands_out_no_marker_text(cut):
    # A stream closed after ``cut`` characters: what was handed out holds no part of a marker.
    seg, pieces = run([REPLY[:cut]], final=False)
    handed = "".join(p.text for p in pieces)
    assert "<" not in handed and ">" not in handed


@pytest.mark.parametrize("partial", ["<", "<th", "<tool_ca"])
def test_a_reply_ending_inside_a_marker_drops_the_partial_marker(partial):
    assert run(["Hello " + partial])[0].text == "Hello "


@pytest.mark.parametrize("partial", ["<", "</thin", "<tool_c"])
def test_reasoning_ending_inside_a_marker_drops_the_partial_marker(partial):
    assert run(["<think>Hmm " + partial])[0].reasoning == "Hmm "


def test_a_closing_marker_with_no_block_open_never_reaches_the_text():
    # Weak models write a lone </tool_call> or </think> (the demo did): markers never reach the answer.
    assert run(["a </think> b"])[0].text == "a  b"
    seg, pieces = run(["Sure.</tool_call> Done", "</th", "ink>!"])
    assert seg.text == "Sure. Done!" and seg.tool_calls == [] and "".join(p.text for p in pieces) == "Sure. Done!"
    assert run(["<think>x</think>y</think>z"])[0].text == "yz"


def test_a_stop_string_inside_reasoning_ends_the_reply_and_is_cut():
    seg, _ = run(["<think>abcSTOPdef</think>x"], stop=["STOP"])
    assert (seg.reasoning, seg.text, seg.stopped) == ("abc", "", True)


def test_a_broken_tool_call_becomes_a_call_with_an_error():
    seg, pieces = run(['<tool_call>{"name": "f", "arguments": {"x": </tool_call>'])
    (call,) = seg.tool_calls
    assert call.name == "f" and call.error is not None and call.arguments == {}


@pytest.mark.parametrize("call", [
    '{"name": "f", "arguments": {"x": "\\ud800"}}',   # a lone surrogate, spelt as JSON escapes it
    '{"name": "\\udfff", "arguments": {}}',
    '{"name": "f", "id": "\\ud800", "arguments": {}}',
])
def test_a_call_no_tokenizer_could_take_back_becomes_a_call_with_an_error(call):
    (parsed,) = parse_tool_calls(json_tools.parse_tool_call, call, None, id_basis="t")
    assert parsed.error is not None and parsed.arguments == {} and parsed.text == call
    for value in (parsed.id, parsed.name):  # what the template renders later: it must encode
        value.encode("utf-8")


def test_the_prompt_leaving_think_open_starts_in_reasoning(tiny):
    tok = tiny(tokenizer="bpe-think").tokenizer
    opened = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert Segmenter(tok, prompt=opened).state == "reasoning"
    assert Segmenter(tok, prompt=closed).state == "normal"


# -- over a real session: a Qwen3-format tokenizer and template, output forced by a script --------------
THINK_OPEN = QWEN3.replace(
    "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
    "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking",
)


def scripted_session(lm, replies, *, template=None, **params):
    script = Scripted(lm.tokenizer, replies)
    builder = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=80, logits_processors=[script], **params))
    if template is not None:
        builder = builder.chat_template(template)
    return builder.build()


def test_a_reply_with_reasoning_and_a_tool_call_fills_the_history_fields(tiny):
    lm = tiny(tokenizer="bpe-think")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    session = scripted_session(lm, [f"<think>\nIt asks for weather.\n</think>\n\n{call}"])
    with session.stream_respond("Weather in Paris?") as stream:
        chunks = list(stream)
    # The newlines next to the markers are template glue: the committed fields are without them.
    assert stream.reasoning == "It asks for weather." and stream.text == ""
    (made,) = stream.tool_calls
    assert (made.name, made.arguments) == ("get_weather", {"city": "Paris"}) and len(made.id) == 9 and made.id.isalnum()
    assert [c.tool_call for c in chunks if c.tool_call] == [made]
    assert {c.kind for c in chunks} == {"reasoning", "text", "tool_call"}
    assert all("<" not in c.text for c in chunks if c.kind != "tool_call")
    reply = session.history[-1]
    assert (reply.content, reply.reasoning, reply.tool_calls) == ("", "It asks for weather.", (made,))
    # The model's own template renders the fields back: the reasoning and the call are in the prompt.
    rendered = session.render()
    assert "<think>\nIt asks for weather.\n</think>" in rendered and '"city": "Paris"' in rendered
    session.respond("And tomorrow?")  # Qwen3 drops the earlier reasoning: the cache is trimmed, visibly
    assert session.last_stats.plan == "trim"
    assert_ledger_matches_cache(session)


def test_a_prompt_ending_inside_think_starts_the_reply_in_reasoning(tiny):
    lm = tiny(tokenizer="bpe-think")
    session = scripted_session(lm, ["thinking here\n</think>\n\nThe answer."], template=THINK_OPEN)
    assert session.respond("Q?") == "The answer."
    assert session.history[-1].reasoning == "thinking here"


def test_thinking_false_renders_the_templates_switch_and_the_reply_is_all_answer(tiny):
    lm = tiny(tokenizer="bpe-think")
    session = scripted_session(lm, ["Just the answer."], template=THINK_OPEN, thinking=False)
    assert session.render("Q?").endswith("<think>\n<think>\n\n</think>\n\n")
    assert session.respond("Q?") == "Just the answer." and session.history[-1].reasoning is None


def ban(*ids):
    def processor(tokens, logits):
        return logits + mx.array([-1e9 if i in ids else 0.0 for i in range(logits.shape[-1])], dtype=logits.dtype)

    return processor


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_max_thinking_tokens_forces_the_end_of_thinking_and_the_model_answers(tiny, budget):
    lm = tiny(tokenizer="bpe-think")
    tok = lm.tokenizer
    (end,) = tok.think_end_tokens
    never_stop = ban(end, *tok.eos_token_ids)  # left alone, this model would think until max_tokens
    session = (ChatSession.builder(lm).chat_template(THINK_OPEN)
               .generate_params(GenerateParams(max_tokens=budget + 6, max_thinking_tokens=budget, logits_processors=[never_stop]))
               .build())
    with session.stream_respond("Q?") as stream:
        for _ in stream:
            pass
    tokens = stream.tokens
    assert tokens[budget] == end and end not in tokens[:budget]
    assert stream.reasoning == tok.decode(tokens[:budget]).strip("\n") and stream.text == tok.decode(tokens[budget + 1 :]).strip("\n")


def budget_run(lm, budget, speculative=None, copy=False):
    tok = lm.tokenizer
    (end,) = tok.think_end_tokens
    processors = [ban(end, *tok.eos_token_ids)]  # left alone, the model would think until max_tokens
    if copy:
        from test_speculative import copier

        processors.insert(0, copier)  # the reply copies its prompt: prompt lookup's drafts are accepted
    builder = (ChatSession.builder(lm).chat_template(THINK_OPEN)
               .generate_params(GenerateParams(max_tokens=budget + 8, max_thinking_tokens=budget, logits_processors=processors)))
    if speculative is not None:
        builder = builder.speculative(speculative)
    session = builder.build()
    # The prompt's last tokens, "<think>\n", come earlier followed by text: the copier copies that text.
    prompt = "Say: <think>\nthe red fox jumps over the lazy dog and the red fox jumps again over the lazy dog"
    with session.stream_respond(prompt) as stream:
        for _ in stream:
            pass
    return stream.tokens, session.last_stats


@pytest.mark.parametrize("budget", [2, 5])
@pytest.mark.parametrize("mode", ["draft-model", "prompt-lookup"])
def test_max_thinking_tokens_with_speculative_decoding_forces_the_end_at_the_budget_as_plain_decoding(tiny, mode, budget):
    """The budget is a function of the tokens shown: a draft model runs it on its drafts too (it drafts the
    forced marker), and drafts the target rejects do not spend it."""
    from chatkit import SpeculativeConfig

    lm = tiny(tokenizer="bpe-think")
    (end,) = lm.tokenizer.think_end_tokens
    if mode == "draft-model":  # the target as its own draft: every draft is accepted, also the forced marker
        config, copy = SpeculativeConfig(tiny(tokenizer="bpe-think"), 3), False
    else:
        config, copy = SpeculativeConfig("prompt_lookup", 3, ngram_min=1), True
    expected, _ = budget_run(lm, budget, copy=copy)
    got, stats = budget_run(lm, budget, config, copy=copy)
    assert expected[budget] == end and end not in expected[:budget]
    assert got == expected
    assert stats.draft_tokens_accepted > 0


def test_history_fields_round_trip_through_dicts_and_old_dicts_still_load():
    call = ToolCall("abc123XYZ", "f", {"x": [1, "two"]})
    messages = [
        ChatMessage.user("hi"),
        ChatMessage.assistant("", reasoning="hmm", tool_calls=[call]),
        ChatMessage.tool("42", name="f", tool_call_id="abc123XYZ"),
    ]
    dicts = [m.to_dict() for m in messages]
    assert dicts[1] == {
        "role": "assistant", "content": "", "reasoning_content": "hmm",
        "tool_calls": [{"id": "abc123XYZ", "type": "function", "function": {"name": "f", "arguments": {"x": [1, "two"]}}}],
    }
    assert dicts[2] == {"role": "tool", "content": "42", "name": "f", "tool_call_id": "abc123XYZ"}
    assert [ChatMessage.from_dict(d) for d in dicts] == messages
    # OpenAI-style input: content None, arguments as a JSON string, reasoning under another name.
    openai = {"role": "assistant", "content": None, "thinking": "hmm",
              "tool_calls": [{"id": "abc123XYZ", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, "two"]}'}}]}
    assert ChatMessage.from_dict(openai) == messages[1]
    assert ChatMessage.from_dict({"role": "user", "content": "hi"}) == messages[0]  # a file from before


def test_save_and_restore_keep_reasoning_and_tool_calls_and_the_next_turn_is_exact(tiny, tmp_path):
    lm = tiny(tokenizer="bpe-think")
    call = '<tool_call>\n{"name": "f", "arguments": {"q": "x"}}\n</tool_call>'
    session = scripted_session(lm, [f"<think>\nr\n</think>\n\nok{call}"])
    session.respond("go")
    session.save_cache(tmp_path / "s.safetensors")
    again = ChatSession.builder(lm).cache(tmp_path / "s.safetensors").build()
    assert again.history == session.history and again.history[-1].tool_calls[0].arguments == {"q": "x"}
    # Invariant 5: the next turn equals a fresh session replaying that history (greedy).
    again.generate_params = GenerateParams(max_tokens=8)
    with again.stream_respond(ChatMessage.tool("sunny", name="f", tool_call_id=session.history[-1].tool_calls[0].id)) as s:
        for _ in s:
            pass
    assert s.tokens == fresh_reply_tool(again, lm)
    assert_ledger_matches_cache(again)


def test_save_and_restore_keep_a_broken_calls_error_and_text(tiny, tmp_path):
    lm = tiny(tokenizer="bpe-think")
    session = scripted_session(lm, ['<tool_call>\n{"name": "f", "arguments": {"q": </tool_call>'])
    session.respond("go")
    (call,) = session.history[-1].tool_calls
    assert call.error is not None and call.text is not None
    session.save_cache(tmp_path / "s.safetensors")
    again = ChatSession.builder(lm).cache(tmp_path / "s.safetensors").build()
    assert again.history == session.history
    assert (again.history[-1].tool_calls[0].error, again.history[-1].tool_calls[0].text) == (call.error, call.text)
    # The OpenAI form leaves them out (templates and the server's conversation keys read it).
    assert set(call.to_dict()) == {"id", "type", "function"}


@pytest.mark.parametrize("key", ["error", "text"])
def test_a_tool_calls_error_or_text_that_is_not_a_str_is_refused(key):
    with pytest.raises(InvalidMessageError, match=key):
        ToolCall.from_dict({"id": "a", "function": {"name": "f", "arguments": {}}, key: 5})


def fresh_reply_tool(session, lm):
    history = session.history
    fresh = ChatSession.builder(lm).history(history[:-2]).generate_params(GenerateParams(max_tokens=8)).build()
    with fresh.stream_respond(history[-2]) as s:
        for _ in s:
            pass
    return s.tokens


# -- formats mlx-lm does not parse (chatkit/text/formats/), each as its family's model writes it ------------
def family(*specials, thinking=False):
    return SimpleNamespace(
        has_thinking=thinking, think_start="<think>" if thinking else None, think_end="</think>" if thinking else None,
        has_tool_calling=False, tool_parser=None, response_transitions={}, structural_markers=(),
        response_initial_state=None, get_vocab=lambda: {s: i for i, s in enumerate(specials)},
    )


HARMONY = family("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
FAMILY_REPLIES = [
    (HARMONY, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "", "Need the weather."),
    (HARMONY, '<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary '
              'json<|message|>{"city": "Paris"}', "", "Hmm."),
    (family("<|python_tag|>", "<|eom_id|>"), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", ""),
    (family("<|python_tag|>", "<|eom_id|>"), '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", ""),  # bare JSON
    (family("<|python_tag|>", "<|eom_id|>"), '\n { "type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}', "", ""),
    (family("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", thinking=True),
     "<think>R1 thinks.</think>Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me check.", "R1 thinks."),
    (family("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", thinking=True),
     '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", ""),
    (family("<|tool_call|>", "<|start_of_role|>"), '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", ""),
    (family("<|START_ACTION|>", "<|END_ACTION|>"),
     "<|START_THINKING|>Plan.<|END_THINKING|><|START_ACTION|>"
     '[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}]<|END_ACTION|>', "", "Plan."),
]


@pytest.mark.parametrize("tokenizer, reply, text, reasoning", FAMILY_REPLIES)
def test_formats_mlx_lm_does_not_parse_at_every_split_point(tokenizer, reply, text, reasoning):
    for cut in range(1, len(reply)):
        seg = Segmenter(tokenizer)
        pieces = seg.feed(reply[:cut]) + seg.feed(reply[cut:], final=True)
        assert (seg.text, seg.reasoning) == (text, reasoning), cut
        assert [(c.name, c.arguments, c.error) for c in seg.tool_calls] == [("get_weather", {"city": "Paris"}, None)], cut
        assert all("<|" not in p.text and "<｜" not in p.text for p in pieces if p.kind != "tool_call"), cut


def test_a_harmony_final_answer_after_analysis():
    seg = Segmenter(HARMONY)
    seg.feed("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi there.", final=True)
    assert (seg.reasoning, seg.text, seg.tool_calls) == ("Think.", "Hi there.", [])


@pytest.mark.parametrize("reply", ['{"answer": 42}', 'Sure: {"name": "get_weather"}', "{ plain braces }", "{", ' {"na'])
def test_a_llama3_reply_that_only_starts_like_a_json_call_stays_text(reply):
    llama3 = family("<|python_tag|>", "<|eom_id|>")
    for cut in range(1, len(reply)):
        seg = Segmenter(llama3)
        pieces = seg.feed(reply[:cut]) + seg.feed(reply[cut:], final=True)
        assert (seg.text, seg.tool_calls) == (reply, []), cut
        assert "".join(p.text for p in pieces) == reply


def test_piece_kinds_are_one_enum_equal_to_their_strings():
    from chatkit import PieceKind

    seg, pieces = run([REPLY])
    assert {p.kind for p in pieces} == {PieceKind.TEXT, PieceKind.REASONING, PieceKind.TOOL_CALL}
    assert all(isinstance(p.kind, PieceKind) for p in pieces)
    assert PieceKind.TOOL_CALL == "tool_call" and f"{PieceKind.REASONING}" == "reasoning"
    assert [PieceKind(k) for k in ("text", "reasoning", "tool_call", "tool_result")] == list(PieceKind)
    cut = Segmenter(QWEN_MARKERS)  # inside a call, the segmenter's kind says so (mlx-lm's state is "tool")
    cut.feed('A<tool_call>{"name": "f"')
    assert cut.state == "tool" and cut.kind is PieceKind.TOOL_CALL


def test_a_chunk_with_a_plain_string_kind_reads_as_its_piece_kind():
    from chatkit import PieceKind, StreamChunk
    from chatkit.server.wire import Deltas

    deltas = Deltas()
    assert deltas.feed(StreamChunk("Hm", 1, kind="reasoning")) == [(PieceKind.REASONING, "Hm")]
    call = ToolCall("c1", "f", {"x": 1})
    assert deltas.feed(StreamChunk("", 2, kind="tool_call", tool_call=call)) == [(PieceKind.TOOL_CALL, call)]
    assert deltas.feed(StreamChunk("Hi", 3, kind="text")) == [("text", "Hi")]
