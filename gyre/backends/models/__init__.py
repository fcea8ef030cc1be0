"""The model code engines and actors share: which architectures run, the HF models, the tokenizer.

    arch/          the registry: one module per family (qwen2, qwen3, qwen3_moe, llama), SUPPORTED,
                   family_of; `python -m gyre.backends.models.arch` prints the table
    hf.py          HF models of the arch families; Qwen2 size presets ('tiny', 'small'), packed
                   forward, checkpoints
    bytetable.py   any fast tokenizer: loaded from a directory, the exact bytes of every id
    tokenizer.py   the repo's byte-level BPE with a chat template (the built-in presets)
    vocab.py       the run's tokenizer (a checkpoint's own, else the project's): stop ids, size checks

Nothing is imported here.
"""
