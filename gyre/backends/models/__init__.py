"""The model code engines and actors share (docs/backends.md): which architectures run (`arch/`),
the HF models, GGUF conversion, parameter counts, the tokenizers and the run's vocabulary.
Nothing is imported here.
"""
