"""Chat templates with tool support for the tiny test models (written here, nothing downloaded), and tool
files for the tests."""

from __future__ import annotations

from pathlib import Path

# Qwen2.5's chat template as its tokenizer_config.json on the Hugging Face Hub gives it (the tools in the
# system turn, <tool_call> JSON in the assistant's turn, results as <tool_response> in a user turn)
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

# Qwen3's way with an assistant turn that ends the conversation: an empty <think> block before its content
# (the turn rendered when it is the last differs from the same turn followed by tool results)
QWEN3_LIKE_TEMPLATE = QWEN25_TEMPLATE.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    "{%- if message.role == 'assistant' and loop.last %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + "
    "message.content + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>' + '\\n' }}{%- endif %}")

# Llama 3.1's tool turns in short: JSON calls, results in an ipython turn
LLAMA3_LIKE_TEMPLATE = r"""{{- '<|im_start|>system\nEnvironment: ipython<|im_end|>\n' }}
{%- if tools %}{{- '<|im_start|>user\nFunctions: ' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}
{%- for message in messages %}
    {%- if message.role == "tool" or message.role == "ipython" %}{{- '<|im_start|>ipython\n' + message.content + '<|im_end|>' }}
    {%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""


def tool_tokenizer(src: Path, out: Path, template: str = QWEN25_TEMPLATE):
    """The tokenizer at `src` with `template` as its chat template, saved to `out`."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = template
    tok.save_pretrained(out)
    return tok


HOSTILE_TOOLS = '''
import os, sys, time


def hang(x: int) -> str:
    """Never returns, and swallows the stop.

    Args:
        x: anything
    """
    while True:
        try:
            time.sleep(1)
        except BaseException:
            pass


def boom(x: int) -> str:
    """Raises.

    Args:
        x: anything
    """
    raise KeyError("nope")


def loud(x: int) -> str:
    """Prints megabytes and returns megabytes.

    Args:
        x: anything
    """
    for _ in range(20):
        print("y" * 1_000_000)
    os.write(1, b"z" * 1_000_000)
    return "x" * 5_000_000


def thing(x: int) -> str:
    """Returns an object.

    Args:
        x: anything
    """
    return object()


def writer(path: str) -> str:
    """Writes a file.

    Args:
        path: where
    """
    with open(path, "w") as f:
        f.write("hi")
    return "wrote " + path


def leave(x: int) -> str:
    """Ends its process.

    Args:
        x: anything
    """
    os._exit(7)


def hog(x: int) -> str:
    """Allocates 4 GiB.

    Args:
        x: anything
    """
    return str(len(bytearray(4 * 2**30)))


def secret(x: int, *, answer: str = "") -> str:
    """Reads a hidden argument from the data row.

    Args:
        x: anything
    """
    return f"{x}:{answer}:{os.getpid()}"
'''
