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


# The scripted tool caller's two pieces of a call, each one token of its tokenizer (added tokens): the model
# writes OPEN, one digit, CLOSE, then ends its turn (calculator(digit))
OPEN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
CLOSE = '"}}\n</tool_call>'


def make_tool_model(out: Path, src: Path, layers: int = 2, seed: int = 0, steer: float = 3.0) -> Path:
    """A tiny random llama steered to call the calculator in every turn: SmolLM2's tokenizer with the
    Qwen2.5 template and OPEN and CLOSE added as tokens, and weights that carry a bigram over a few tokens
    (after the assistant header's newline OPEN, after OPEN any digit, after a digit CLOSE, after CLOSE the
    end of the turn) on top of the random model: embedding slots 0..12 hold those tokens one-hot, and the
    output head maps each slot to its successors with weight `steer`. The random layers still add a little
    to every logit, so what the model reads (the KV cache) changes its log-probs and its choice of digit."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(src)
    tok.chat_template = QWEN25_TEMPLATE
    tok.add_tokens([AddedToken(OPEN, normalized=False), AddedToken(CLOSE, normalized=False)])
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]   # noqa: E731
    newline, open_id, close_id, end = ids("\n")[-1], tok.convert_tokens_to_ids(OPEN), tok.convert_tokens_to_ids(CLOSE), \
        tok.eos_token_id
    digits = [ids(str(d))[0] for d in range(1, 10)]
    successors = {newline: [open_id], open_id: digits, close_id: [end], **{d: [close_id] for d in digits}}
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=end, pad_token_id=tok.pad_token_id,
                      max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head[:, :len(successors)] = 0
        for slot, (src_id, nxt) in enumerate(successors.items()):
            emb[src_id] = 0
            emb[src_id, slot] = 1.0
            head[nxt, slot] = steer
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


CALCULATOR = '''
import os


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression
    """
    return f"{int(expression) * 11} (process {os.getpid()})"
'''

DIGIT_REWARD = '''
import re


def score(data_source, solution_str, ground_truth, extra_info=None):
    """The first digit the model passed to the calculator, over 9."""
    m = re.search(r'"expression": "(\\d)', solution_str)
    return int(m.group(1)) / 9 if m else 0.0
'''
