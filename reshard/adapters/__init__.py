"""Engine and framework adapters (vLLM, SGLang, Megatron-Core).

They import their engine lazily; the core packages never import adapters.
"""
