"""Chat templates of the test tokenizers, modelled on real model families' templates.

Each keeps the semantics that matter to chat sessions: where the system prompt goes, how
assistant turns end, which roles raise, and (``QWEN3``) how earlier reasoning is dropped.
"""

# The tools block of Qwen2.5 / Qwen3: JSON schemas inside <tools></tools> in the system turn.
_QWEN_TOOLS = """\
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"""

_QWEN_SYSTEM = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
""" + _QWEN_TOOLS + """
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
"""

# Renders message.tool_calls after the assistant text (content), Qwen style.
_QWEN_TOOL_CALLS = """\
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and content) or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}"""

# Tool results: consecutive tool messages share one user turn, each in <tool_response>.
_QWEN_TOOL_RESPONSE = """\
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}"""

_CONTENT = """\
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
"""

# ChatML as in Qwen2.5 (tools, tool role, tool calls), but without a default system prompt.
CHATML = (
    _QWEN_SYSTEM
    + "{%- for message in messages %}\n"
    + _CONTENT
    + """\
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'system' %}
    {%- elif message.role == 'assistant' and not message.tool_calls %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if content %}
            {{- '\\n' + content }}
        {%- endif %}
        {{- '\\n' }}
"""
    # Qwen2.5 puts a newline before every tool call, Qwen3 only between text and calls.
    + _QWEN_TOOL_CALLS.replace("(loop.first and content) or not loop.first", "not loop.first")
    + "\n"
    + _QWEN_TOOL_RESPONSE
    + """
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)

# Qwen3: reasoning of assistant turns before the last user query is dropped; the turns after
# it keep theirs (the last assistant turn always gets a <think> block, empty if need be), and
# enable_thinking=False makes the generation prompt end with an empty think block.
QWEN3 = (
    _QWEN_SYSTEM
    + """\
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
"""
    + _CONTENT
    + """\
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'system' %}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
"""
    + _QWEN_TOOL_CALLS
    + "\n"
    + _QWEN_TOOL_RESPONSE
    + """
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
)

# Llama 2 chat: every user turn is "<s>[INST] ... [/INST]", the system prompt is folded into the
# first one inside <<SYS>>, each assistant reply is followed by "</s>". No generation prompt needed.
LLAMA2 = """\
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set loop_messages = messages[1:] %}
    {%- set system_message = messages[0]['content'] %}
{%- else %}
    {%- set loop_messages = messages %}
    {%- set system_message = none %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles are supported, with an optional first system message.') }}
    {%- endif %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if loop.first and system_message is not none %}
        {%- set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}
    {%- else %}
        {%- set content = message['content'] %}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
    {%- else %}
        {{- ' ' + content.strip() + ' ' + eos_token }}
    {%- endif %}
{%- endfor %}
"""

# Gemma 3: "<bos>" once, turns between <start_of_turn>ROLE and <end_of_turn>, the assistant is
# "model", and the system prompt is prepended to the first user turn.
GEMMA = """\
{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles are supported, with an optional first system message.') }}
    {%- endif %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""

__all__ = ["CHATML", "QWEN3", "LLAMA2", "GEMMA"]
