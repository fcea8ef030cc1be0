"""Qwen3-Coder: ChatML turns, XML function calls, no reasoning.

    <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

Tools are declared in the system turn in the template's own XML (tests/chat_templates/
qwen3-coder.jinja). Parameter values are text; they are typed by the tool's JSON schema as
SGLang 0.5.23 does (sglang/srt/function_call/qwen3_coder_detector.py:108-192,
`_convert_param_value`): "null" is None, string types stay text, integer / number / boolean
types are converted (text when that fails), object / array are JSON (else a Python literal, else
text), other types a Python literal (else text). A parameter not in the schema stays text.

Parsing follows the detector's one-shot `detect_and_parse` (:194-266): calls are the
`<tool_call>...</tool_call>` blocks, each holding `<function=NAME>` blocks whose parameters end
at `</parameter>`, the next `<parameter=` or `</function>`; one leading and one trailing newline
of a value are the template's. Differences, on purpose (nothing the model wrote is dropped):
content is the text before the first call with trailing whitespace removed (the template renders
`content | trim` before the calls), text after the calls is kept, a block with no function and an
unclosed block (a call cut by max_tokens) come back as text, and calls to functions that are
not among the request's tools are returned as written (SGLang warns and keeps them too).
"""

from __future__ import annotations

import ast
import json
import logging
import re
import warnings
from typing import Any

from gyre.proxy.formats.base import CHATML, ChatFormat
from gyre.proxy.textstream import ToolCall, _prefix_overlap

logger = logging.getLogger(__name__)

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
# qwen3_coder_detector.py:37-43
_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)


def _literal(text: str) -> Any:
    with warnings.catch_warnings():  # invalid escapes are kept as written (sglang utils._run_ast_quiet)
        warnings.simplefilter("ignore")
        return ast.literal_eval(text)


def schema_type(schema: Any) -> str | None:
    """The primary JSON-schema type of a parameter (sglang function_call/utils.py:326-420,
    `infer_type_from_json_schema`): `type` (first non-null of a list), anyOf / oneOf (one type,
    an optional type, else string if present, else the first), enum by its values, allOf (first
    non-string), `properties` -> object, `items` -> array."""
    if not isinstance(schema, dict):
        return None
    if "type" in schema:
        tv = schema["type"]
        if isinstance(tv, str):
            return tv
        if isinstance(tv, list) and tv:
            nn = [t for t in tv if t != "null"]
            return nn[0] if nn else "string"
    if "anyOf" in schema or "oneOf" in schema:
        subs = schema.get("anyOf") or schema.get("oneOf")
        types = [t for t in (schema_type(s) for s in subs) if t] if isinstance(subs, list) else []
        if types:
            if len(set(types)) == 1:
                return types[0]
            if len(set(types)) == 2 and "null" in types:
                return [t for t in types if t != "null"][0]
            return "string" if "string" in types else types[0]
    if isinstance(schema.get("enum"), list):
        if not schema["enum"]:
            return "string"
        kinds = {"null" if v is None else "boolean" if isinstance(v, bool) else "integer" if isinstance(v, int) else
                 "number" if isinstance(v, float) else "string" if isinstance(v, str) else "array" if isinstance(v, list) else
                 "object" if isinstance(v, dict) else "string" for v in schema["enum"]}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        for s in schema["allOf"]:
            t = schema_type(s)
            if t and t != "string":
                return t
        return "string"
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _properties(schema: Any) -> dict:
    """Top-level properties, through anyOf / oneOf / allOf (sglang utils.py:307-323)."""
    if not isinstance(schema, dict):
        return {}
    props = schema.get("properties")
    if isinstance(props, dict):
        return props
    merged: dict = {}
    for kw in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(kw) or ():
            for k, v in _properties(branch).items():
                merged.setdefault(k, v)
    return merged


def parameter_schemas(name: str, tools: list[dict] | None) -> dict:
    """Parameter name -> schema of function `name` (qwen3_coder_detector.py:60-90)."""
    for t in tools or ():
        fn = t.get("function", t)
        if fn.get("name") == name:
            params = fn.get("parameters")
            if isinstance(params, dict):
                props = _properties(params)
                return props if (props or "properties" in params) else params
            return {}
    return {}


def convert_value(value: str, pname: str, schemas: dict) -> Any:
    """A parameter's text typed by its schema (qwen3_coder_detector.py:108-192)."""
    if value.lower() == "null":
        return None
    if pname not in schemas:
        return value
    kind = str(schema_type(schemas[pname]) or "string").strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            integral = not ("." in value or "e" in value.lower())
            f = float(value)
            return int(f) if integral and f.is_integer() else f
        except ValueError:
            return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return _literal(value)
    except Exception:  # noqa: BLE001 - anything literal_eval rejects stays text
        return value


def parse_block(body: str, tools: list[dict] | None) -> list[tuple[str, dict]]:
    """(name, arguments) of each `<function=...>` in the text between `<tool_call>` tags."""
    calls = []
    for m in _FUNCTION.findall(body):
        fbody = m[0] or m[1]
        if ">" not in fbody:
            continue
        name, params = fbody[: fbody.index(">")], fbody[fbody.index(">") + 1 :]
        schemas = parameter_schemas(name, tools)
        args: dict = {}
        for p in _PARAMETER.findall(params):
            if ">" not in p:
                continue
            pname, value = p[: p.index(">")], p[p.index(">") + 1 :]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            args[pname] = convert_value(value, pname, schemas)
        calls.append((name, args))
    return calls


class XmlToolParser:
    """Streaming Qwen3-Coder tool calls (see the module docstring); same interface and text
    conventions as textstream.ToolCallParser (Hermes)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools
        self.buf = ""
        self.ws = ""  # whitespace held back before a block: dropped if it is a call, kept if not
        self.in_tools = False
        self.ncalls = 0

    def push(self, text: str) -> list:
        self.buf += text
        out: list = []
        while self.buf:
            if not self.in_tools:
                i = self.buf.find(TOOL_START)
                if i < 0:
                    keep = _prefix_overlap(self.buf, TOOL_START)
                    head = self.buf[: len(self.buf) - keep]
                    emit = head.rstrip()  # whitespace before a call is the template's
                    if emit:
                        out.append(emit)
                    self.buf = self.buf[len(emit):]
                    break
                head = self.buf[:i].rstrip()
                if head:
                    out.append(head)
                self.ws = self.buf[len(head) : i]
                self.buf = self.buf[i:]
                self.in_tools = True
            body = self.buf.lstrip()
            lead = self.buf[: len(self.buf) - len(body)]
            if not body or (TOOL_START.startswith(body) and body != TOOL_START):
                break  # whitespace or a partial opening: wait
            if not body.startswith(TOOL_START):
                self.in_tools = False  # text after the calls: kept, up to the next call
                continue
            j = body.find(TOOL_END)
            if j < 0:
                self.ws += lead
                self.buf = body
                break
            calls = parse_block(body[len(TOOL_START) : j], self.tools)
            if calls:
                for name, args in calls:
                    out.append(ToolCall(name=name, arguments=args, index=self.ncalls))
                    self.ncalls += 1
            else:
                out.append(self.ws + lead + body[: j + len(TOOL_END)])  # not a call: its text, as written
            self.ws = ""
            self.buf = body[j + len(TOOL_END):]
        return out

    def flush(self) -> list:
        out, self.buf = self.buf, ""
        ws, self.ws = self.ws, ""
        if not out or (self.in_tools and not out.strip() and self.ncalls):
            return []
        return [ws + out]


def tool_call_opening(name: str | None) -> str:
    """The template's call opening: `<tool_call>\\n<function=NAME>\\n` (the model writes the
    parameters), or `<tool_call>\\n<function=` for any function (the model writes the name)."""
    return TOOL_START + "\n<function=" + (name + ">\n" if name is not None else "")


def detect(template: str) -> bool:
    return "<|im_start|>" in template and "<function=" in template and "<parameter=" in template and "<think>" not in template


FORMAT = ChatFormat(
    name="qwen3-coder",
    description="Qwen3-Coder: ChatML, XML <function=...> tool calls",
    **CHATML,
    tool_syntax="xml",
    make_tool_parser=XmlToolParser,
    tool_call_opening=tool_call_opening,
    detect=detect,
    sglang_tool_parser="qwen3_coder",
)
