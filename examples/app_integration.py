"""A session driven the way a Mac app's UI drives it: from an asyncio event loop, with a Stop button.

Run: python examples/app_integration.py [--model demo]
The UI loop keeps ticking while replies stream on a worker thread; "Stop" cancels a reply mid-way and
what was shown stays in the conversation. A second part drives a session from a worker thread.
"""

import argparse
import asyncio
import threading

import chatkit  # before mlx: on Linux chatkit can then give MLX the system's faster OpenBLAS
from chatkit import ChatSession, GenerateParams

import mlx.core as mx  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="demo")
args = parser.parse_args()
lm = chatkit.load(args.model)


async def ui() -> None:
    session = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=64)).build()
    print("bot>", await session.arespond("My name is Ada."))

    shown = []

    async def render_reply(prompt: str) -> None:
        async with session.astream_respond(prompt) as stream:
            async for chunk in stream:
                shown.append(chunk.text)

    reply = asyncio.create_task(render_reply("What can you do?"))  # a long reply, to stop mid-way
    ticks = 0
    while not reply.done() and len(shown) < 5:  # the UI stays responsive while the reply streams
        await asyncio.sleep(0.001)
        ticks += 1
    reply.cancel()  # the Stop button
    try:
        await reply
    except asyncio.CancelledError:
        pass
    # The history keeps the reply as far as it was generated: what was shown, plus at most the two
    # chunks the worker may compute ahead of the UI (chatkit.session.aio.LOOKAHEAD).
    kept = session.history[-1].content
    print(f"stopped after {len(shown)} chunks ({ticks} UI ticks); shown: {''.join(shown)!r}; kept: {kept!r}")
    print("bot>", await session.arespond("What is my name?"))


asyncio.run(ui())


def worker(out: list) -> None:
    session = ChatSession.builder(lm).tools(chatkit.demo.tools()).generate_params(GenerateParams(max_tokens=32)).build()
    out.append(session.respond("What is 2 + 3?"))  # the demo calls its calculate tool, then answers
    mx.clear_streams()  # MLX asks a thread that ran MLX work to destroy its streams before it ends


out: list = []
thread = threading.Thread(target=worker, args=(out,))
thread.start()
thread.join()
print("worker thread bot>", out[0])
