"""Guided generation: replies that are valid values by construction.

    from chatkit.guided import output_spec, Constraint, instructions

    spec = output_spec(Person)                 # or a JSON Schema dict, regex="...", grammar="..."
    c = Constraint(spec, lm.tokenizer)         # one per reply; masks every step through llguidance
    # mlx-lm: generate_step(prompt, model, logits_processors=[c]) (or speculative_generate_step)
    person = c.finish()                        # a validated Person, or IncompleteOutputError
    c.partial()                                # while streaming: the complete fields so far

    g = tool_call_grammar(lm.tokenizer, tools)  # strict tool calls: the tools' schemas, the format's markers
    strict = ToolCallConstraint(g, lm.tokenizer)  # a logits processor: free text, constrained calls

``instructions(spec)`` is the text to show the model (it follows a schema it sees with fewer
forced tokens). Needs the ``guided`` extra (llguidance, pydantic).
"""

try:
    import llguidance  # noqa: F401
    import pydantic  # noqa: F401
except ImportError as e:  # an optional extra: say how to get it
    raise ImportError(f"chatkit.guided needs the guided extra: pip install 'chatkit[guided]' ({e}).") from e

from .call_grammar import ToolCallConstraint, ToolCallGrammar, tool_call_grammar
from .constraint import Constraint, constraint
from .describe import instructions, response_format
from .guide import guide, respond, stream_respond
from .partial import partial_json
from .spec import OutputSpec, matches, output_spec, strict_schema
from .tokenizer import llg_tokenizer

__all__ = [
    "Constraint",
    "guide",
    "OutputSpec",
    "constraint",
    "instructions",
    "llg_tokenizer",
    "matches",
    "output_spec",
    "partial_json",
    "respond",
    "response_format",
    "stream_respond",
    "strict_schema",
    "tool_call_grammar",
    "ToolCallConstraint",
    "ToolCallGrammar",
]
