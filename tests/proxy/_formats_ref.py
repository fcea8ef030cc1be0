"""SGLang 0.5.23's own parsers, loaded standalone from the unpacked wheel, as the reference the
format tests compare Gyre's parsers with. Skipped (None) when the wheel is not unpacked:

    pip download sglang==0.5.23 --no-deps -d /tmp/sg && cd /tmp/sg && unzip -q sglang-*.whl

(or set GYRE_SGLANG_SRC to the directory holding `sglang/`). The detectors are pure Python; the
few heavy imports around them (the OpenAI protocol models, envs, xgrammar, partial_json_parser,
the other reasoning families) are stubbed, and the reasoning classes are taken out of
reasoning_parser.py by their source (the module imports half of SGLang)."""

from __future__ import annotations

import ast
import importlib
import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

SRC = Path(os.environ.get("GYRE_SGLANG_SRC", "/tmp/sg"))
_FC = SRC / "sglang" / "srt" / "function_call"


def available() -> bool:
    return (_FC / "qwen25_detector.py").exists() and (SRC / "sglang" / "srt" / "parser" / "reasoning_parser.py").exists()


@dataclass
class _Function:
    name: str
    parameters: dict | None = None
    description: str = ""
    strict: bool = False


@dataclass
class Tool:
    function: _Function
    type: str = "function"


def sg_tools(tools: list[dict] | None) -> list[Tool]:
    return [Tool(_Function(t["function"]["name"], t["function"].get("parameters"))) for t in tools or ()]


def _stub(name: str, **attrs) -> types.ModuleType:
    m = sys.modules.get(name)
    if m is None:
        m = types.ModuleType(name)
        sys.modules[name] = m
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


_loaded: dict = {}


def _load_function_call() -> None:
    if "fc" in _loaded:
        return
    for pkg, path in (("sglang", SRC / "sglang"), ("sglang.srt", SRC / "sglang" / "srt"), ("sglang.srt.function_call", _FC),
                      ("sglang.srt.entrypoints", None), ("sglang.srt.entrypoints.openai", None)):
        m = _stub(pkg)
        m.__path__ = [str(path)] if path else []

    class _Flag:
        def get(self):
            return False

    class _Envs:
        def __getattr__(self, name):
            return _Flag()

    _stub("sglang.srt.entrypoints.openai.protocol", Tool=Tool, ToolChoice=object)
    _stub("sglang.srt.environ", envs=_Envs())
    try:
        import partial_json_parser  # noqa: F401
    except ImportError:
        class _Allow:
            ALL = 0
            STR = 1
            OBJ = 2
            ARR = 4
        _stub("partial_json_parser", loads=lambda s, *a, **k: json.loads(s))
        _stub("partial_json_parser.core")
        _stub("partial_json_parser.core.exceptions", MalformedJSON=ValueError)
        _stub("partial_json_parser.core.options", Allow=_Allow)
    _loaded["fc"] = True


_DETECTORS = {"qwen25": ("qwen25_detector", "Qwen25Detector"), "qwen3_coder": ("qwen3_coder_detector", "Qwen3CoderDetector"),
              "llama3": ("llama32_detector", "Llama32Detector")}


def _detector_classes() -> dict:
    """The three detector classes, imported once under stub packages that are then taken out of
    sys.modules again: a stub `sglang` left behind (no __spec__) would make every later
    `importlib.util.find_spec("sglang")` in the same process raise, and one with a spec would make
    the factory believe SGLang is installed."""
    if "classes" not in _loaded:
        before = set(sys.modules)
        try:
            _load_function_call()
            _loaded["classes"] = {k: getattr(importlib.import_module("sglang.srt.function_call." + mod), cls)
                                  for k, (mod, cls) in _DETECTORS.items()}
        finally:
            for name in set(sys.modules) - before:
                if name.split(".")[0] in ("sglang", "partial_json_parser"):
                    del sys.modules[name]
            _loaded.pop("fc", None)
    return _loaded["classes"]


def detector(name: str):
    """A fresh SGLang detector: qwen25 | qwen3_coder | llama3."""
    return _detector_classes()[name]()


def reasoning_detector(force: bool = False):
    """A fresh sglang Qwen3Detector (reasoning_parser.py), from its source."""
    if "reasoning" not in _loaded:
        path = SRC / "sglang" / "srt" / "parser" / "reasoning_parser.py"
        tree = ast.parse(path.read_text())
        keep = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("StreamingParseResult", "BaseReasoningFormatDetector", "Qwen3Detector")]
        ns: dict = {}
        exec("from typing import Dict, List, Optional, Tuple, Type\nPreTrainedTokenizerBase = object\nAnswerFrame = object\n", ns)
        exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)
        _loaded["reasoning"] = ns["Qwen3Detector"]
    return _loaded["reasoning"](force_reasoning=force)


def sglang_calls(name: str, text: str, tools: list[dict] | None) -> tuple[str, list[tuple[str, dict]]]:
    """(normal_text, [(name, arguments)]) of SGLang's one-shot parse."""
    res = detector(name).detect_and_parse(text, sg_tools(tools))
    return res.normal_text, [(c.name, json.loads(c.parameters)) for c in res.calls]


def sglang_reasoning(text: str, force: bool = False) -> tuple[str, str]:
    """(reasoning_text, normal_text) of SGLang's qwen3 one-shot reasoning parse."""
    res = reasoning_detector(force).detect_and_parse(text)
    return res.reasoning_text, res.normal_text
