"""Typed field readers for request bodies: a wrong type or range is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from gyre.proxy.core import ApiError

_MISSING = object()


def bad(field: str, msg: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{field}: {msg}", param=field)


def get_obj(d: dict, key: str, where: str = "") -> dict:
    v = d.get(key)
    if not isinstance(v, dict):
        raise bad(where + key, "must be an object")
    return v


def opt_str(d: dict, key: str, where: str = "", default: Any = None) -> Any:
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, str):
        raise bad(where + key, "must be a string")
    return v


def req_str(d: dict, key: str, where: str = "") -> str:
    v = d.get(key, _MISSING)
    if v is _MISSING:
        raise bad(where + key, "is required")
    if not isinstance(v, str):
        raise bad(where + key, "must be a string")
    return v


def opt_bool(d: dict, key: str, default: bool = False, where: str = "") -> bool:
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise bad(where + key, "must be a boolean")
    return v


def opt_int(d: dict, key: str, default: Any = None, lo: int | None = None, hi: int | None = None, where: str = "") -> Any:
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad(where + key, "must be an integer")
    if lo is not None and v < lo:
        raise bad(where + key, f"must be >= {lo}")
    if hi is not None and v > hi:
        raise bad(where + key, f"must be <= {hi}")
    return v


def opt_num(d: dict, key: str, default: float, lo: float, hi: float, where: str = "") -> float:
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(where + key, "must be a number")
    v = float(v)
    if not (lo <= v <= hi):
        raise bad(where + key, f"must be between {lo:g} and {hi:g}")
    return v


def opt_list(d: dict, key: str, where: str = "") -> list | None:
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        return None
    if not isinstance(v, list):
        raise bad(where + key, "must be an array")
    return v


def stop_list(v: Any, field: str, max_items: int = 16) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(field, "must be a string or an array of strings")
    if len(v) > max_items:
        raise bad(field, f"at most {max_items} stop sequences")
    return [s for s in v if s]
