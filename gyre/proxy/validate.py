"""Typed field readers for request bodies: a wrong type or range is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from gyre.proxy.errors import ApiError

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


# ---- media for a text-only policy ------------------------------------------------------------
# An image, audio clip or file part becomes one line of text the policy can read (its kind, media
# type and decoded size, or a URL's scheme and host; nothing is fetched), so a harness's first
# screenshot does not end its session. It sits in a user or tool message, so it is context the
# harness injected, never a training target (docs/design.md §5). `proxy.media = reject` turns it
# into a 400 naming the field instead (checked in `Proxy.prepare`).


def b64_size(data: str) -> int:
    """Decoded size of base64 `data` (whitespace-free, as the APIs send it), without decoding."""
    n = len(data)
    pad = 2 if data.endswith("==") else 1 if data.endswith("=") else 0
    return max(0, n * 3 // 4 - pad)


def url_origin(url: str) -> str:
    """`scheme://host` of a URL (paths and queries can carry tokens; they are left out)."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
    except ValueError:
        return "an unparsable URL"
    return f"{u.scheme}://{u.hostname}" if u.scheme and u.hostname else (u.scheme or "an unparsable URL")


def media_text(kind: str, *, media_type: str | None = None, data: str | None = None, url: str | None = None,
               file_id: str | None = None, name: str | None = None) -> str:
    """The placeholder: `[image: image/png, 48213 bytes]`, `[image: https://example.com, not
    fetched]`, `[file: report.pdf, application/pdf, 1024 bytes]`, `[document: file_id file_abc]`.
    A `data:` URL is read as media type + base64 data."""
    if url is not None and url.startswith("data:"):
        head, _, payload = url.partition(",")
        media_type = media_type or head[5:].split(";")[0] or None
        data = payload if ";base64" in head else None
        size = b64_size(payload) if data is not None else len(payload)
        url = None
    else:
        size = b64_size(data) if isinstance(data, str) else None
    what = [name] if name else []
    if url is not None:
        what += [url_origin(url), "not fetched"]
    elif file_id is not None:
        what.append(f"file_id {file_id}")
    if media_type:
        what.append(media_type)
    if size is not None:
        what.append(f"{size} bytes")
    return f"[{kind}: {', '.join(what) or 'no data'}]"
