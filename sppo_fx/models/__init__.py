"""Reference causal LMs used by tests, benchmarks and the demo."""
from sppo_fx.models.gpt import GPT, GPTConfig
from sppo_fx.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "build"]


def build(kind: str, size: str = "tiny", **overrides):
    """Build a reference model by name.

    Args:
        kind: "gpt" or "llama".
        size: a preset name of the config class ("tiny", "small", "bench").
        **overrides: config fields to override.

    Returns:
        The model (fp32, on CPU, in train mode).
    """
    table = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}
    if kind not in table:
        raise ValueError(f"unknown model kind {kind!r}; choose one of {sorted(table)}")
    model_cls, cfg_cls = table[kind]
    return model_cls(cfg_cls.preset(size, **overrides))
