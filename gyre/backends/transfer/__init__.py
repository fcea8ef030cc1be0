"""Moving tensors between ranks (docs/design.md §3; docs/backends.md): the policy's weights
(snapshots, transports, buckets, coverage and read-back checks) and a running request's KV cache
(migration and its cost rule). Nothing is imported here.
"""
