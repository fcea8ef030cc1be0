"""Moving tensors between ranks (docs/design.md §3): the policy's weights, and a request's KV cache.

    snapshots.py   flat snapshot layout + CRC, broadcast / Mooncake primitives, retention, byte counts
    weights.py     the WeightTransports: SnapshotBoard (store), TorchWeights (gloo p2p), MooncakeWeights
    migration.py   KV-cache migration of a running request between engines: packed state, KV
                   transports (gloo p2p, Mooncake, in-process), held buffers, tickets, the cost rule

Nothing is imported here.
"""
