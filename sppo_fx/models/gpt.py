"""GPT-2 style causal LM: learned positions, LayerNorm, GELU MLP, SDPA causal attention,
tied input/output embeddings.

`forward(idx, targets=None)` returns logits, or the mean next-token cross-entropy when
`targets` is given (targets are already shifted by the caller, as in nanoGPT).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class GPTConfig:
    """Size of a GPT-2 style model.

    Attributes:
        vocab_size: number of token ids.
        block_size: number of learned positions (the longest sequence).
        n_layer: transformer blocks.
        n_head: attention heads.
        n_embd: hidden size (divisible by n_head).
        bias: use biases in Linear and LayerNorm.
    """

    vocab_size: int = 256
    block_size: int = 1024
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True

    PRESETS = {
        "tiny": dict(vocab_size=97, block_size=512, n_layer=2, n_head=4, n_embd=32),
        "small": dict(vocab_size=256, block_size=4096, n_layer=4, n_head=8, n_embd=256),
        # ~100M parameters (GPT-2 small shape with a byte vocabulary)
        "bench": dict(vocab_size=256, block_size=32768, n_layer=12, n_head=12, n_embd=768),
    }

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in cls.PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 style decoder (nanoGPT layout)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
