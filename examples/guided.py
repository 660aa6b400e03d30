"""Guided generation on the bundled demo model: replies that are valid by construction.

Run: python examples/guided.py [--model demo|ID|PATH]

1. output=Person: a message becomes a validated Person. The JSON Schema is described at the end of
   the message (the demo was trained on that description) and the reply is constrained token by
   token, so it parses whatever the model would have written. (The demo fills forms right 67 %
   of the time on held-out dialogues, see docs/demo.md: the value is always valid, not always right.)
2. Streamed: the form fills in field by field (stream.partial); stream.value is the final object.
3. A regex sent without its description (include_schema=False: the demo never saw a regex described,
   and a description it does not know would only confuse it; the shape is right by construction
   either way), and a reply cut short by max_tokens (IncompleteOutputError; the session stays usable).
"""

import argparse

import chatkit
from chatkit import ChatSession, GenerateParams
from chatkit.errors import IncompleteOutputError

from pydantic import BaseModel


class Person(BaseModel):
    name: str
    city: str


class Profile(BaseModel):
    name: str
    city: str
    colour: str


parser = argparse.ArgumentParser()
parser.add_argument("--model", default="demo")
args = parser.parse_args()

session = ChatSession.builder(chatkit.load(args.model)).generate_params(GenerateParams(max_tokens=48)).build()

# 1. A validated object from one message.
person = session.respond("My name is Ada and I live in Oslo.", output=Person)
print(f"> My name is Ada and I live in Oslo.  (output=Person)\n{person!r}")

# 2. A form filled in from the conversation, streamed as partial objects.
print(f"> My favourite colour is teal.\n{session.respond('My favourite colour is teal.')}")
print("> Fill in my profile.  (output=Profile, streamed)")
with session.stream_respond("Fill in my profile.", output=Profile) as stream:
    shown = None
    for _chunk in stream:
        if stream.partial != shown:
            shown = stream.partial
            print(f"  partial: {shown}")
print(f"value: {stream.value!r}")
print(f"committed reply: {session.history[-1].content}")

# 3. A regex, and a reply cut short.
name_reply = session.respond("What is my name?", regex=r"Your name is [A-Z][a-z]+\.", include_schema=False)
print(f"> What is my name?  (regex)\n{name_reply}")
session.generate_params = GenerateParams(max_tokens=6)
try:
    session.respond("Fill in my profile.", output=Profile)
except IncompleteOutputError as e:
    print(f"max_tokens=6: IncompleteOutputError, partial text {e.text!r}, partial object {e.partial!r}")
    session.undo()  # the cut reply was committed as far as it went: drop it
session.generate_params = GenerateParams(max_tokens=48)
print(f"> What is my favourite colour?\n{session.respond('What is my favourite colour?')}")
