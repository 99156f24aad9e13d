"""Train a Hugging Face causal LM on a text corpus with sppo_fx under a memory budget.

    python examples/train_hf.py --config llama --corpus my_texts/ --seq-len 1024 \\
        --budget 512MiB --steps 50 --checkpoint ckpt.pt
    python examples/train_hf.py --config path/to/config.json --corpus book.txt --steps 10

--config is a tiny built-in preset (llama, mistral, qwen2, qwen3, gemma3, phi3, gpt2,
gpt_neox, olmo2: 2 layers, hidden 64; no hub access is needed) or a local config.json
(any `AutoModelForCausalLM` architecture whose vocab_size is at least 257).

Data: every *.txt file under --corpus (or the one file) is a document. Text is tokenised
as bytes (ids 0..255) and documents are packed into one stream, separated by an
end-of-document id 256, then cut into [batch, seq_len] windows. By default attention
crosses document boundaries inside a window (one concatenated stream, as many
pre-training pipelines do). With --document-masking each token attends only to its own
document: `position_ids` restart at 0 after every end-of-document id and the model runs
with `use_cache=False`, Hugging Face's packed-sequence convention, which sppo_fx proves
document-causal and chunks exactly (README, "Packed documents"); a chunk then reads no K/V
of documents that ended before it.

Each step prints the loss and tokens/s; the first prints sppo_fx's plan (chunks, what is
offloaded, predicted peak). At the end the loss curve is printed, and with --checkpoint
the model's and the optimizer's state_dicts are saved, loaded into a fresh model and
optimizer, and checked equal (--resume continues from such a file).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

import sppo_fx

EOD = 256  # end-of-document id, after the 256 byte ids
PRESET_VOCAB = 320

_BASE = dict(vocab_size=PRESET_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
PRESETS = {
    "llama": ("LlamaConfig", _BASE),
    "mistral": ("MistralConfig", dict(_BASE, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(_BASE, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(_BASE, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", dict(_BASE, head_dim=16, layer_types=["full_attention"] * 2)),
    "phi3": ("Phi3Config", dict(_BASE, pad_token_id=0)),
    "gpt2": ("GPT2Config", dict(vocab_size=PRESET_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=4096,
                                attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    "gpt_neox": ("GPTNeoXConfig", _BASE),
    "olmo2": ("Olmo2Config", _BASE),
}


def load_config(name: str):
    """A transformers config from a preset name or a local config.json."""
    import transformers
    if os.path.exists(name):
        path = os.path.join(name, "config.json") if os.path.isdir(name) else name
        with open(path) as f:
            config = transformers.AutoConfig.for_model(**json.load(f))
    elif name in PRESETS:
        cls_name, kwargs = PRESETS[name]
        config = getattr(transformers, cls_name)(**kwargs)
    else:
        raise SystemExit(f"--config {name!r}: give a preset ({', '.join(PRESETS)}) or a config.json path")
    if config.vocab_size <= EOD:
        raise SystemExit(f"the config's vocab_size is {config.vocab_size}; byte tokens need at least {EOD + 1}")
    return config


def build_model(config, attn_implementation: str | None):
    import transformers
    if attn_implementation:
        config._attn_implementation = attn_implementation
    return transformers.AutoModelForCausalLM.from_config(config)


def read_documents(corpus: str) -> list[bytes]:
    """Every *.txt file under `corpus` (sorted), or the file itself."""
    if os.path.isfile(corpus):
        paths = [corpus]
    else:
        paths = sorted(os.path.join(root, f) for root, _, files in os.walk(corpus) for f in files
                       if f.endswith(".txt"))
    docs = [open(p, "rb").read() for p in paths]
    docs = [d for d in docs if d]
    if not docs:
        raise SystemExit(f"no text found in {corpus}")
    return docs


def pack(docs: list[bytes]) -> torch.Tensor:
    """One stream of byte ids, each document followed by EOD."""
    ids = []
    for d in docs:
        ids.extend(d)
        ids.append(EOD)
    return torch.tensor(ids, dtype=torch.long)


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document: 0 at a window's first token and after
    every EOD (the EOD closes its document), counting up by one otherwise."""
    t = ids.shape[-1]
    index = torch.arange(t).expand_as(ids)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == EOD
    return index - torch.where(starts, index, 0).cummax(-1).values


def batches(stream: torch.Tensor, batch: int, seq_len: int, seed: int):
    """Endless [batch, seq_len] windows at random offsets of the stream (repeated if short)."""
    need = seq_len + 1
    if stream.numel() < need:
        stream = stream.repeat(math.ceil(need / stream.numel()))
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, stream.numel() - seq_len + 1, (batch,), generator=g)
        yield torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


def save_checkpoint(path: str, model, optimizer, step: int, config, losses: list[float]):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "config": config.to_dict(), "losses": losses}, path)


def check_reload(path: str, model, optimizer, args) -> int:
    """Load the checkpoint into a fresh model and optimizer; returns the tensors compared."""
    import transformers
    ckpt = torch.load(path, weights_only=True)  # data only: a checkpoint from elsewhere runs no code
    config = transformers.AutoConfig.for_model(**ckpt["config"])
    fresh = build_model(config, args.attn_implementation)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=args.lr)
    fresh_opt.load_state_dict(ckpt["optimizer"])
    compared = 0
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        if not torch.equal(a, b):
            raise SystemExit(f"checkpoint reload: {name} differs")
        compared += 1
    for a, b in zip(optimizer.state.values(), fresh_opt.state.values()):
        for key in a:
            if isinstance(a[key], torch.Tensor):
                if not torch.equal(a[key], b[key]):
                    raise SystemExit(f"checkpoint reload: optimizer state {key} differs")
                compared += 1
    return compared


def loss_curve(losses: list[float], width: int = 40) -> str:
    """A text plot: one row per step, a bar proportional to the loss."""
    hi, lo = max(losses), min(losses)
    rows = []
    for i, loss in enumerate(losses):
        n = 1 + int((width - 1) * (loss - lo) / (hi - lo)) if hi > lo else width
        rows.append(f"  step {i + 1:4d} {loss:8.4f} {'#' * n}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama", help=f"preset ({', '.join(PRESETS)}) or path to config.json")
    p.add_argument("--corpus", required=True, help="a .txt file or a folder of .txt files")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--budget", default="512MiB",
                   help="peak extra memory per step (e.g. 512MiB); 'none' to use --chunks instead")
    p.add_argument("--chunks", type=int, default=4, help="chunk count when --budget none")
    p.add_argument("--no-compile", action="store_true", help="run chunk programs eagerly (no Inductor)")
    p.add_argument("--attn-implementation", default=None, help='e.g. "eager" (default: the model\'s)')
    p.add_argument("--offload-dir", default=None, help="folder for the disk tier's files")
    p.add_argument("--checkpoint", default=None, help="save (and verify the reload of) model+optimizer here")
    p.add_argument("--resume", default=None, help="continue from a checkpoint written by --checkpoint")
    p.add_argument("--document-masking", action="store_true",
                   help="attention within each document only (position_ids restarting after each "
                        "end-of-document id, use_cache=False)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    config = load_config(args.config)
    model = build_model(config, args.attn_implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, start = [], 0
    if args.resume:
        ckpt = torch.load(args.resume, weights_only=True)  # data only: a checkpoint from elsewhere runs no code
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        losses, start = list(ckpt.get("losses", [])), int(ckpt["step"])
        print(f"resumed from {args.resume} at step {start}")
    n_params = sum(p.numel() for p in model.parameters())
    docs = read_documents(args.corpus)
    stream = pack(docs)
    print(f"model {type(model).__name__}: {n_params / 1e6:.2f}M parameters; corpus {len(docs)} documents, "
          f"{stream.numel()} tokens (bytes, documents packed into one stream; attention "
          f"{'within each document' if args.document_masking else 'across documents'})")

    if args.offload_dir:
        os.makedirs(args.offload_dir, exist_ok=True)
    options = dict(compile=not args.no_compile, offload_dir=args.offload_dir)
    if args.budget.lower() == "none":
        compiled = sppo_fx.compile(model, chunks=args.chunks, **options)
    else:
        compiled = sppo_fx.compile(model, budget=args.budget, **options)
    data = batches(stream, args.batch, args.seq_len, args.seed + start)
    model.train()
    for step in range(start, start + args.steps):
        ids = next(data)
        t0 = time.perf_counter()
        if args.document_masking:
            loss = compiled(input_ids=ids, labels=ids, position_ids=document_positions(ids), use_cache=False)
        else:
            loss = compiled(input_ids=ids, labels=ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if step == start:
            print(compiled.plan)
        print(f"step {step + 1}: loss {losses[-1]:.4f}  {ids.numel() / dt:,.0f} tokens/s  ({dt:.2f} s)", flush=True)
    print("loss curve:")
    print(loss_curve(losses))
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model, optimizer, start + args.steps, config, losses)
        compared = check_reload(args.checkpoint, model, optimizer, args)
        print(f"checkpoint {args.checkpoint}: saved and reloaded into a fresh model and optimizer "
              f"({compared} tensors equal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
