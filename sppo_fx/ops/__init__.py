"""Custom operators used by sppo_fx (chunk attention with Triton kernels)."""
__all__ = ["chunk_attention", "chunk_attention_with_lse", "segmented_chunk_attention"]


def __getattr__(name: str):
    # the chunk-attention ops (Triton, and torch._inductor through `triton_op`) load when
    # first used, not with every `sppo_fx.ops.*` module
    if name in __all__:
        import importlib
        module = importlib.import_module("sppo_fx.chunk_attention.op")
        # the functions, not the submodule of the same name, as when they were imported here
        globals().update({n: getattr(module, n) for n in __all__})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
