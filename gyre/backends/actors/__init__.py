"""Training actors (docs/design.md §3, §6): forward/backward on micro-steps, gradient reduce over
a prefix group, the core's optimizer step.

    cpu_actor.py       CpuActor: GSPO forward/backward on packed micro-steps, core-only AdamW
    megatron_actor.py  MegatronActor (GPU): megatron-core GPTModel from a config or a checkpoint read lazily
    mcore_mapping.py   HF ⇄ megatron-core names and shards per family (local / TE layouts, TP / EP), layout checks
    memory.py          ActorMemory: an actor's state to (pinned) host memory entering rollout, back entering training

Nothing is imported here.
"""
