"""Model families as their models really answer: a test tokenizer with the family's special tokens
(``chatkit.testing`` FAMILIES), the family's real chat template (tests/data/templates), and the reply
format the model writes when it calls a tool and when it answers. Random weights cannot write these,
so ``script`` forces them (``chatkit.testing.Scripted``). Shared by tests/test_families.py and
bench/tools.py (reuse per template)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chatkit import ChatSession, GenerateParams, Role
from chatkit.testing import Scripted, tiny_model

TEMPLATES = Path(__file__).parent.parent / "data" / "templates"
CITY, RESULT, ANSWER = "Paris", "sunny_result_text", "Sunny in Paris."


def get_weather(city: str) -> str:
    """The weather of a city.

    Args:
        city: The city's name.
    """
    return RESULT


@dataclass(frozen=True)
class Family:
    """One family: ``call(k)`` is the reply calling ``get_weather(city=CITY)`` in the k-th exchange of a
    conversation (ids that count calls differ per call), ``answer`` the reply after the result."""

    name: str
    tokenizer: str
    template: str
    call: Callable[[int], str]
    answer: str
    call_reasoning: str | None = None  # what the call reply's reasoning is committed as
    answer_reasoning: str | None = None
    call_end: str | None = None  # the token a call reply ends with, when not the tokenizer's eos
    rendered_call: str = ""  # how the template renders the call back into the next prompt

    def model(self):
        return tiny_model("qwen3", tokenizer=self.tokenizer, chat_template=TEMPLATES / self.template)

    def script(self, lm, exchanges: int = 1) -> Scripted:
        """A script of ``exchanges`` x (call, answer)."""
        replies = [r for k in range(exchanges) for r in (self.call(k), self.answer)]
        script = Scripted(lm.tokenizer, replies)
        if self.call_end is not None:
            end = lm.tokenizer.convert_tokens_to_ids(self.call_end)
            for k in range(exchanges):
                script.replies[2 * k][-1] = end
        return script


def _json(value) -> str:
    return json.dumps(value)


ARGS = _json({"city": CITY})


def _id(k: int) -> str:
    return f"Call{k:05d}" if k else "a1B2c3D4e"  # 9 alphanumerics, as Mistral's templates require


FAMILIES = [
    Family("qwen3", "bpe-think", "Qwen-Qwen3-0.6B.jinja",
           lambda k: f'<think>\nI need the weather.\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
           f"<think>\nIt is sunny.\n</think>\n\n{ANSWER}", "I need the weather.", "It is sunny.",
           rendered_call=f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'),
    Family("hermes3", "bpe-think", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
           lambda k: f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>', ANSWER,
           rendered_call=f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'),
    Family("llama3.1-json", "llama3", "meta-llama-Llama-3.1-8B-Instruct.jinja",
           lambda k: f'{{"name": "get_weather", "parameters": {ARGS}}}', ANSWER,
           rendered_call=f'{{"name": "get_weather", "parameters": {ARGS}}}<|eot_id|>'),
    Family("llama3.2-python-tag", "llama3", "meta-llama-Llama-3.2-3B-Instruct.jinja",
           lambda k: f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}', ANSWER, call_end="<|eom_id|>",
           rendered_call=f'{{"name": "get_weather", "parameters": {ARGS}}}<|eot_id|>'),
    Family("mistral-nemo", "mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
           lambda k: f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}, "id": "{_id(k)}"}}]', ANSWER,
           rendered_call=f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}, "id": "a1B2c3D4e"}}]</s>'),
    Family("mistral-small-3.1", "mistral", "mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja",
           lambda k: f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}, "id": "{_id(k)}"}}]', ANSWER,
           rendered_call=f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}, "id": "a1B2c3D4e"}}]</s>'),
    Family("deepseek-r1", "deepseek", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
           lambda k: ("I need the weather.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                      f"```json\n{ARGS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
           f"<think>\nIt is sunny.\n</think>\n\n{ANSWER}", "I need the weather.", "It is sunny.",
           rendered_call="<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"),
    Family("deepseek-v3.1", "deepseek", "deepseek-ai-DeepSeek-V3.1.jinja",
           lambda k: ("I need the weather.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                      f"{ARGS}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
           ANSWER, "I need the weather.",  # after a tool's output V3.1 answers without a think block
           rendered_call=f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>"),
    Family("granite-3.3", "granite", "ibm-granite-granite-3.3-2B-Instruct.jinja",
           lambda k: f'<|tool_call|>[{{"name": "get_weather", "arguments": {ARGS}}}]', ANSWER,
           rendered_call='"name": "get_weather"'),
    Family("command-r7b", "command-r", "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
           lambda k: (f'<|START_ACTION|>[\n    {{"tool_call_id": "{k}", "tool_name": "get_weather", "parameters": {ARGS}}}\n'
                      "]<|END_ACTION|>"),
           f"<|START_RESPONSE|>{ANSWER}<|END_RESPONSE|>",
           rendered_call=f'"tool_name": "get_weather", "parameters": {ARGS}}}'),
    Family("kimi-k2", "kimi", "Kimi-K2-Instruct.jinja",
           lambda k: (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:{k}<|tool_call_argument_begin|>"
                      f"{ARGS}<|tool_call_end|><|tool_calls_section_end|>"), ANSWER,
           rendered_call=f"<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{ARGS}<|tool_call_end|>"),
    Family("minimax-m2", "minimax", "MiniMax-M2.jinja",
           lambda k: ('I need the weather.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                      f'<parameter name="city">{CITY}</parameter>\n</invoke>\n</minimax:tool_call>'),
           f"It is sunny.\n</think>\n\n{ANSWER}", "I need the weather.", "It is sunny.",
           rendered_call=f'<invoke name="get_weather">\n<parameter name="city">{CITY}</parameter>\n</invoke>'),
    Family("gpt-oss", "harmony", "openai-gpt-oss-120b.jinja",
           lambda k: ("<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>commentary "
                      f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}"),
           f"<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}",
           "I need the weather.", "It is sunny.", call_end="<|call|>",
           rendered_call=f"to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>"),
]
BY_NAME = {f.name: f for f in FAMILIES}


def session(family: Family, lm, script: Scripted, **tool_options) -> ChatSession:
    params = GenerateParams(max_tokens=120, logits_processors=[script])
    return ChatSession.builder(lm).tools([get_weather], **tool_options).generate_params(params).build()


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(frozen=True)
class Step:
    """One turn of :func:`reuse_over_turns`: what the cache held before it, what the prompt shares with
    that, and what the turn reused."""

    kind: str  # "user" (a new question) or "tool" (the tool result)
    held: int  # tokens in the cache before the turn: the previous prompt and reply
    shared: int  # of those, the prefix the new prompt starts with (the template's ceiling)
    reused: int
    prompt: int
    plan: str | None


def reuse_over_turns(family: Family, exchanges: int = 3, lm=None) -> list[Step]:
    """``exchanges`` questions, each answered by a call, its result and an answer (manual mode, so that
    each turn's stats can be read): what each turn reused, against what its template allows."""
    from conftest import cache_state

    lm = lm or family.model()
    s = session(family, lm, family.script(lm, exchanges), tool_execution="manual")
    steps = []

    def turn(prompt, kind, role=Role.USER):
        held = list(cache_state(s).ledger.tokens)
        ids = lm.tokenizer.encode(s.render(prompt, role=role), add_special_tokens=False)
        s.respond(prompt, role=role)
        stats = s.last_stats
        steps.append(Step(kind, len(held), common_prefix(held, ids), stats.reused_tokens, stats.prompt_tokens, stats.plan))

    for k in range(exchanges):
        turn(f"Question {k}: what is the weather in {CITY}?", "user")
        turn(RESULT, "tool", role=Role.TOOL)  # answers the one pending call
    return steps
