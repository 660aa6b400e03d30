"""Guided generation on the bundled demo model: replies that are valid by construction.

Run: python examples/guided.py [--model demo|ID|PATH]

1. A Lark grammar keeps the model in its own phrasing and fixes the shape; the slots it fills
   become a Person. (chatkit.guided.respond with describe="none": the demo model cannot read a
   description of the grammar; session.respond(..., grammar=...) appends one to the message.)
2. output=Person streams a JSON object: the form fills in field by field (stream.partial), and
   stream.value is the validated Person. (The demo model never saw JSON in training, so the values
   it picks are guesses: the point is that the object is always valid.)
   describe="none" here: by default the JSON Schema is appended to the message for the model to
   read, which the demo model cannot (and its 448-token context has no room for).
3. A regex, and a reply cut short by max_tokens (IncompleteOutputError; the session stays usable).
"""

import argparse
import re
from typing import Annotated

import chatkit
from chatkit import ChatSession, GenerateParams, guided
from chatkit.errors import IncompleteOutputError

from pydantic import BaseModel, Field


class Person(BaseModel):
    name: Annotated[str, Field(max_length=16)]
    city: Annotated[str, Field(max_length=16)]


WORD = r"/[A-Z][a-z]{1,11}/"

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="demo")
args = parser.parse_args()

session = ChatSession.builder(chatkit.load(args.model)).generate_params(GenerateParams(max_tokens=48)).build()
for fact in ("My name is Ada.", "I live in Oslo."):
    print(f"> {fact}\n{session.respond(fact)}")

# 1. The shape from a grammar, the words from the model.
name_reply = guided.respond(session, "What is my name?", grammar=f'start: "Your name is " {WORD} "."', describe="none")
city_reply = guided.respond(session, "Where do I live?", grammar=f'start: "You live in " {WORD} "."', describe="none")
print(f"> What is my name?\n{name_reply}\n> Where do I live?\n{city_reply}")
person = Person(name=re.fullmatch(r"Your name is (\w+)\.", name_reply)[1],
                city=re.fullmatch(r"You live in (\w+)\.", city_reply)[1])
print(f"from the guided replies: {person!r}")

# 2. A JSON object, streamed as partial objects.
print("> Describe me as JSON.  (output=Person, streamed)")
with guided.stream_respond(session, "Describe me as JSON.", output=Person, describe="none") as stream:
    shown = None
    for _chunk in stream:
        if stream.partial != shown:
            shown = stream.partial
            print(f"  partial: {shown}")
print(f"value: {stream.value!r}")
print(f"committed reply: {session.history[-1].content}")
session.undo()  # out of the demo model's world: keep it out of the history

# The session's own keywords do the same, with the grammar described to the model in the message.
NAME_GRAMMAR = f'start: "Your name is " {WORD} "."'
print(f"> What is my name?  (session.respond(..., grammar=...))\n{session.respond('What is my name?', grammar=NAME_GRAMMAR)}")

# 3. A regex, and a reply cut short.
sum_reply = guided.respond(session, "What is 7 + 5?", regex=r"7 \+ 5 = [0-9]{1,3}\.", describe="none")
print(f"> What is 7 + 5?  (regex)\n{sum_reply}")
session.generate_params = GenerateParams(max_tokens=6)
try:
    guided.respond(session, "Describe me as JSON.", output=Person, describe="none")
except IncompleteOutputError as e:
    print(f"max_tokens=6: IncompleteOutputError, partial text {e.text!r}, partial object {e.partial!r}")
session.undo()
session.generate_params = GenerateParams(max_tokens=48)
print(f"> What is my name?\n{session.respond('What is my name?')}")
