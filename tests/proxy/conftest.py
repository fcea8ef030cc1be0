"""Proxy test fixtures: a running proxy (own thread + loop) with deterministic engines."""

import json

import pytest

from gyre.backends.models.tokenizer import byte_token_ids, load_tokenizer
from gyre.proxy import Proxy, ProxyConfig, serve_proxy
from gyre.backends.engines.det_engine import DeterministicEngine

TOOLS_OPENAI = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}}, "required": ["cmd"]},
        },
    }
]
TOOLS_ANTHROPIC = [{"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]} for t in TOOLS_OPENAI]

TOOL_ARGS = [{"cmd": "ls -la", "timeout": 5}, {"cmd": "cat a.py", "timeout": 7}]


def agent_script(input_ids):
    """A scripted 'model': two tool calls, then an answer (by how many tool results it has seen)."""
    tok = load_tokenizer()
    prompt = tok.decode(input_ids)
    k = prompt.count("<tool_response>")
    if k < len(TOOL_ARGS):
        return f"Step {k}: I will run a command.\n<tool_call>\n" + json.dumps({"name": "bash", "arguments": TOOL_ARGS[k]}) + "\n</tool_call>"
    return "All done: found 2 files."


def scripted_engine(name="scripted"):
    return DeterministicEngine(name, script=agent_script, byte_ids=byte_token_ids(load_tokenizer()))


def reference_tokens(salt, prompt, n, eos_prob=0.0):
    """What a DeterministicEngine with `salt` emits after `prompt` (recomputed token by token)."""
    e = DeterministicEngine("ref", salt=salt, eos_prob=eos_prob)
    seq, out = list(prompt), []
    for _ in range(n):
        ev = e.token_after(seq)
        out.append(ev)
        seq.append(ev.token_id)
        if ev.token_id == 2:
            break
    return out


@pytest.fixture
def make_server():
    handles = []

    def make(engines=(), config=None, sink=None):
        proxy = Proxy(config or ProxyConfig(), sink=sink)
        for eng, kind, index in engines:
            proxy.router.add_engine(eng, kind=kind, index=index)
        h = serve_proxy(proxy)
        handles.append(h)
        return proxy, h

    yield make
    for h in handles:
        h.stop()
