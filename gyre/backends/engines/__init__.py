"""Rollout engines (docs/design.md §1; docs/backends.md, docs/gpu-sglang.md), and how an engine in
one process is served to the proxy in another (host thread, HTTP + websocket). Nothing is
imported here.
"""
