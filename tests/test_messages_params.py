"""Messages and generation parameters: conversion, validation, mapping onto mlx-lm."""

from chatkit import ChatKitError, ChatMessage, GenerateParams, Role
from chatkit.errors import InvalidMessageError, InvalidParamsError

import mlx.core as mx
import pytest


def test_message_constructors_and_dict_round_trip():
    messages = [
        ChatMessage.system("s"),
        ChatMessage.user("u"),
        ChatMessage.assistant("a"),
        ChatMessage.tool('{"ok": true}', name="lookup"),
    ]
    assert [m.role for m in messages] == [Role.SYSTEM, Role.USER, Role.ASSISTANT, Role.TOOL]
    for m in messages:
        assert ChatMessage.from_dict(m.to_dict()) == m
    assert messages[3].to_dict() == {"role": "tool", "content": '{"ok": true}', "name": "lookup"}
    assert ChatMessage("USER", "x").role is Role.USER


@pytest.mark.parametrize(
    "data",
    [
        {"role": "wizard", "content": "x"},
        {"role": "user"},
        {"content": "x"},
        {"role": "user", "content": 3},
        {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},  # only an assistant calls
        "user: hi",
    ],
)
def test_bad_message_dicts_raise_chatkit_errors(data):
    with pytest.raises(InvalidMessageError) as info:
        ChatMessage.from_dict(data)
    assert isinstance(info.value, ChatKitError)


def test_params_validate_names_the_bad_setting():
    for change in [
        dict(max_tokens=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-2),
        dict(min_p=1.5),
        dict(repetition_penalty=0),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(frequency_penalty="1"),
        dict(stop=5),
        dict(stop=[""]),
        dict(logit_bias={"a": 1}),
        dict(seed=1.5),
        dict(max_tokens=True),
    ]:
        name = next(iter(change))
        with pytest.raises(InvalidParamsError, match=name):
            GenerateParams(**change).validate()
    GenerateParams(stop=["x"], logit_bias={3: -1.0}, seed=3).validate()
    GenerateParams(stop="END").validate()  # one stop string, as OpenAI's API and from_dict take it


def test_params_map_onto_mlx_lm_sampler_and_processors():
    def logits():  # fresh each time: mlx-lm's repetition penalty writes into its input
        return mx.array([[0.0, 1.0, 5.0, 2.0]])

    greedy = GenerateParams().make_sampler()
    assert greedy(logits()).item() == 2
    biased = GenerateParams(logit_bias={0: 100.0})
    (processor,) = biased.make_logits_processors()
    assert mx.argmax(processor(mx.array([1]), logits())).item() == 0
    penalty = GenerateParams(repetition_penalty=100.0).make_logits_processors()
    assert len(penalty) == 1
    assert mx.argmax(penalty[0](mx.array([2]), logits())).item() == 3
    mx.random.seed(0)
    # OpenAI's penalties: subtracted once for a token seen (presence), once per time seen (frequency)
    (presence,) = GenerateParams(presence_penalty=1.5).make_logits_processors()
    (frequency,) = GenerateParams(frequency_penalty=1.5).make_logits_processors()
    seen = mx.array([2, 2, 3])
    assert presence(seen, logits()).tolist() == [[0.0, 1.0, 3.5, 0.5]]
    assert frequency(seen, logits()).tolist() == [[0.0, 1.0, 2.0, 0.5]]
    assert GenerateParams(presence_penalty=0.0, frequency_penalty=None).make_logits_processors() == []
    both = GenerateParams(presence_penalty=-1.0, frequency_penalty=2.0, repetition_context_size=7)
    assert GenerateParams.from_dict(both.to_dict()) == both
    hot = GenerateParams(temperature=1.0, top_k=2).make_sampler()
    draws = {hot(logits()).item() for _ in range(50)}
    assert draws <= {2, 3} and len(draws) == 2


def test_params_copy_does_not_share_containers():
    p = GenerateParams(stop=["a"], template_kwargs={"enable_thinking": False})
    q = p.copy(temperature=0.5)
    q.template_kwargs["x"] = 1
    assert p.template_kwargs == {"enable_thinking": False} and q.temperature == 0.5
