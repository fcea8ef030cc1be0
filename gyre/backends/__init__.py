"""Backends: protocols, the built-in CPU engine and actor, SGLang / Megatron adapters, transfer."""
