"""Tools: Python functions the model calls, the automatic loop, and the manual mode.

Runs offline on a tiny random-weight model with Qwen3's tokenizer format and chat template. Random
weights cannot write a tool call, so a script forces what a Qwen3 model writes (a <think> block, then
<tool_call> JSON); everything else (segmenting, calling the functions, the history, the template,
cache reuse) is chatkit's real path. With a real model drop the script:
``chatkit.load("Qwen/Qwen3-4B-MLX-4bit")``.
"""

import asyncio

from chatkit import ChatSession, GenerateParams, Role
from chatkit.testing import Scripted, tiny_model


def get_weather(city: str, unit: str = "celsius") -> dict:
    """The current weather of a city.

    Args:
        city: The city's name.
        unit: "celsius" or "fahrenheit".
    """
    return {"city": city, "sky": "sunny", "temperature": 21 if unit == "celsius" else 70}


async def local_time(city: str) -> str:
    """The local time of a city.

    Args:
        city: The city's name.
    """
    await asyncio.sleep(0)  # an async tool: chatkit awaits it
    return f"14:05 in {city}"


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


lm = tiny_model(tokenizer="bpe-think")
script = Scripted(lm.tokenizer, [
    "<think>\nTwo questions: weather and time.\n</think>\n\n"
    + call("get_weather", '{"city": "Lisbon"}') + "\n" + call("local_time", '{"city": "Lisbon"}'),
    "It is sunny and 21 degrees in Lisbon, where it is 14:05.",
    call("get_weather", '{"city": "Porto"}'),
    "Porto is sunny too.",
])
session = (ChatSession.builder(lm)
           .tools([get_weather, local_time])
           .generate_params(GenerateParams(max_tokens=100, logits_processors=[script]))
           .build())

print("== automatic: chatkit calls the tools and loops")
with session.stream_respond("What's the weather in Lisbon, and the time there?") as stream:
    for chunk in stream:
        if chunk.kind == "reasoning":
            print(chunk.text, end="")  # a UI would dim or fold this
        elif chunk.kind == "tool_call" and chunk.tool_call is not None:
            print(f"\n[call] {chunk.tool_call.name}({chunk.tool_call.arguments})")
        elif chunk.kind == "tool_result":
            print(f"[result] {chunk.text}")
        elif chunk.kind == "text" and chunk.text.strip():
            print(chunk.text, end="")
print(f"\nrounds: {stream.rounds}; the round after the results prefilled "
      f"{session.last_stats.prefilled_tokens} of {session.last_stats.prompt_tokens} prompt tokens")
for message in session.history:
    print(f"  {message.role.value:9} content={message.content!r} reasoning={message.reasoning!r} "
          f"calls={[c.name for c in message.tool_calls]} tool_call_id={message.tool_call_id}")

print("== manual: schema dicts only, the app runs the call")
manual = session.fork()
manual.tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
manual.respond("And in Porto?")
(pending,) = manual.pending_tool_calls
print(f"the model asks for {pending.name}({pending.arguments}), id {pending.id}")
print("bot>", manual.respond('{"sky": "sunny"}', role=Role.TOOL, tool_call_id=pending.id))
