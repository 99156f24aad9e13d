"""A grammar of small causal-LM-ish programs, generated as Python SOURCE text.

`generate(seed)` draws one program: an nn.Module class `Prog` whose forward takes token
ids `x`, targets `y` and sometimes extra inputs (per-sample weights `w` [B], a scalar
`s`, per-token weights `wt` [B, T], teacher probabilities `p` [B, T, V]) and returns a
scalar loss. The source is exec'd into a module, so a failing program prints as the code
a user would have written. The generator attaches feature tags (`Program.tags`) so that a
test can check the grammar reaches each class it was built to reach.
"""
from __future__ import annotations

import dataclasses
import random

import torch

IGNORE = -100
# position dtypes and offsets: narrow types and large offsets wrap or round in eager
POS_DTYPES = {
    "torch.int64": [0, 0, 3],
    "torch.int32": [0, 3, 2**31 - 12],
    "torch.int16": [0, 3, 32760],
    "torch.int8": [0, 3, 120],
    "torch.uint8": [0, 3, 250],
    "torch.float": [0, 0.5, 2**24],
}
NARROW = ("torch.int16", "torch.int8", "torch.uint8")

HEADER = '''import torch
import torch.nn as nn
import torch.nn.functional as F


def rot(t):
    a, b = t.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


'''


@dataclasses.dataclass
class Program:
    seed: int
    source: str
    tags: frozenset
    batch: int
    seq: int
    vocab: int
    heads: int
    extras: tuple          # names of the extra inputs after x, y, in order
    ignore: float          # fraction of targets set to IGNORE

    def build(self) -> torch.nn.Module:
        """A fresh module (parameters drawn from the program's seed)."""
        scope: dict = {}
        exec(compile(self.source, f"<program {self.seed}>", "exec"), scope)  # noqa: S102 - generated
        torch.manual_seed(self.seed)
        return scope["Prog"]()

    def inputs(self) -> tuple:
        gen = torch.Generator().manual_seed(self.seed + 1)
        b, t, v = self.batch, self.seq, self.vocab
        x = torch.randint(0, v, (b, t), generator=gen)
        y = torch.randint(0, v, (b, t), generator=gen)
        if self.ignore:
            y[torch.rand(b, t, generator=gen) < self.ignore] = IGNORE
            y[0, -1] = 1  # one target at least: a mean over none is NaN in both
        made = {"w": lambda: torch.rand(b, generator=gen) + 0.5,
                "s": lambda: torch.tensor(1.75),
                "wt": lambda: torch.rand(b, t, generator=gen),
                "p": lambda: torch.randn(b, t, v, generator=gen).softmax(-1)}
        return (x, y, *(made[e]() for e in self.extras))


class _Gen:
    def __init__(self, rng: random.Random):
        self.rng, self.init, self.fwd, self.tags, self.n = rng, [], [], set(), 0
        self.extras: list[str] = []
        self.grouped = False  # inside written-out attention over [B, KV, G, T, T] scores

    def c(self, *options):
        return self.rng.choice(options)

    def p(self, prob: float) -> bool:
        return self.rng.random() < prob

    def var(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    def line(self, text: str):
        self.fwd.append(text)

    def param(self, text: str):
        self.init.append(text)

    def extra(self, name: str) -> str:
        if name not in self.extras:
            self.extras.append(name)
        return name

    # ---- positions -------------------------------------------------------------------
    def positions(self, length: str, why: str) -> tuple[str, str]:
        """A position vector of `length` entries from arange in some dtype and offset."""
        dtype = self.c(*POS_DTYPES)
        off = self.c(*POS_DTYPES[dtype])
        name = self.var("i")
        form = self.c("plus", "plus", "start") if off and off < 100 else "plus"
        if form == "start":
            self.line(f"{name} = torch.arange({off}, {off} + {length}, dtype={dtype})")
        else:
            self.line(f"{name} = torch.arange({length}, dtype={dtype})" + (f" + {off}" if off else ""))
        self.tags.add(f"arange:{dtype.split('.')[1]}")
        if off:
            self.tags.add("arange_offset")
        if dtype in NARROW:
            self.tags.add(f"narrow_arange_{why}")
        return name, dtype

    # ---- masks -----------------------------------------------------------------------
    def mask(self, tt: str) -> tuple[str, str]:
        """(expression variable, polarity): "allow" (True where a key is seen), "deny"
        (True where masked) or "add" (a float added to the scores)."""
        kind = self.c(*["causal"] * 6, "window", "window", "document", "document", "offset", "wide")
        build = self.c("tril", "tril", "compare", "compare", "compare", "narrow") if kind != "document" else "compare"
        m = self.var("m")
        self.tags.add(f"mask:{kind}")
        w = self.c(2, 3, 5)
        if build == "narrow":
            self.tags.add("mask_not_TxT")
            form = self.c("row_triu", "col_tril", "full_col", "and_ones", "row_tril")
            if form == "row_triu":
                self.line(f"{m} = torch.ones(1, {tt}, dtype=torch.bool).triu(1)")
                return m, "deny"
            if form == "row_tril":
                self.line(f"{m} = torch.ones(1, {tt}, dtype=torch.bool).tril()")
                return m, "allow"
            if form == "col_tril":
                self.line(f"{m} = torch.ones({tt}, 1, dtype=torch.bool).tril()")
                return m, "allow"
            if form == "full_col":
                self.line(f"{m} = torch.full(({tt}, 1), float('-inf')).triu(1)")
                return m, "add"
            self.line(f"{m} = torch.ones(1, {tt}, dtype=torch.bool).tril() & torch.ones({tt}, {tt}, dtype=torch.bool)")
            return m, "allow"
        if build == "tril":
            base = self.c(f"torch.ones({tt}, {tt}, dtype=torch.bool)", f"torch.ones({tt}, {tt}).bool()")
            d = {"causal": 0, "offset": 1, "wide": 2, "window": 0}[kind]
            if kind == "window":
                self.line(f"{m} = {base}.tril().triu({1 - w})")
                return m, "allow"
            if self.p(0.5):
                self.line(f"{m} = {base}.tril({d})" if d else f"{m} = {base}.tril()")
                return m, "allow"
            if self.p(0.5):
                self.line(f"{m} = torch.tril(torch.ones({tt}, {tt}), diagonal={d}) == 1")
                return m, "allow"
            self.line(f"{m} = {base}.triu({d + 1})")
            return m, "deny"
        i, dtype = self.positions(tt, "mask")
        col, row = f"{i}[:, None]", f"{i}[None, :]"
        if kind in ("causal", "window", "document"):
            form = self.c("ge", "diff", "le", "gt")
            cond = {"ge": f"{col} >= {row}", "diff": f"({col} - {row}) >= 0", "le": f"{row} <= {col}",
                    "gt": f"{row} > {col}"}[form]
            pol = "deny" if form == "gt" else "allow"
            if kind == "window":
                cond = f"({cond}) & ({col} - {row} < {w})" if pol == "allow" else f"({cond}) | ({col} - {row} >= {w})"
            if kind == "document":
                same = f"({col} // {w} == {row} // {w})"
                cond = f"({cond}) & {same}" if pol == "allow" else f"({cond}) | ~{same}"
        else:
            d = 1 if kind == "offset" else 2
            cond, pol = f"{col} + {d} >= {row}", "allow"
        self.line(f"{m} = {cond}")
        return m, pol

    def shaped(self, m: str, tt: str, bb: str) -> str:
        """The mask `m` as [T, T] (or its own shape), [1, 1, T, T] or [B, 1, T, T]."""
        forms = ("plain", "plain", "none2", "view", "batch_expand", "batch_repeat")
        form = self.c(*forms[:3 if self.grouped else 6])  # a batch dim would broadcast against K/V heads
        self.tags.add(f"mask_shape:{form}")
        if form == "plain":
            return m
        if form == "none2":
            return f"{m}[None, None]"
        if form == "view":
            return f"{m}.unsqueeze(0).unsqueeze(0)"
        if form == "batch_expand":
            return f"{m}[None, None].expand({bb}, 1, {tt}, {tt})"
        return f"{m}[None, None].repeat({bb}, 1, 1, 1)" if self.p(0.5) else f"{m}.expand({tt}, {tt})[None, None].repeat({bb}, 1, 1, 1)"

    def sdpa_mask(self, m: str, pol: str, tt: str, bb: str) -> str:
        """An attn_mask for SDPA: bool (True = attend) or float (added)."""
        out = self.var("am")
        if pol == "add":
            self.line(f"{out} = {self.shaped(m, tt, bb)}")
            return out
        allow = m if pol == "allow" else f"~{m}"
        form = self.c("bool", "bool", "zeros_fill", "where", "large_neg")
        self.tags.add(f"sdpa_mask:{form}")
        if form == "bool":
            self.line(f"{out} = {self.shaped(allow if pol == 'allow' else f'({allow})', tt, bb)}")
        elif form == "zeros_fill":
            filled = f"torch.zeros({m}.shape).masked_fill(~({allow}), float('-inf'))"
            self.line(f"{out} = {self.shaped(filled, tt, bb)}")
        elif form == "where":
            where = f"torch.where({allow}, 0.0, float('-inf'))"
            self.line(f"{out} = {self.shaped(where, tt, bb)}")
        else:
            self.line(f"{out} = {self.shaped(f'({allow}).float().sub(1.0).mul(1e9)', tt, bb)}")
        return out

    def apply_mask(self, att: str, m: str, pol: str, tt: str, bb: str):
        """Written-out attention: mask the scores `att` in place of the variable."""
        if pol == "add":
            self.line(f"{att} = {att} + {self.shaped(m, tt, bb)}")
            return
        form = self.c("masked_fill", "where", "additive", "int_fill", "large_neg", "multiply")
        self.tags.add(f"written_mask:{form}")
        deny = m if pol == "deny" else f"~{m}"
        allow = m if pol == "allow" else f"~{m}"
        if form == "masked_fill":
            self.line(f"{att} = {att}.masked_fill({self.shaped(deny, tt, bb)}, float('-inf'))")
        elif form == "where":
            self.line(f"{att} = torch.where({self.shaped(allow, tt, bb)}, {att}, float('-inf'))")
        elif form == "additive":
            add = self.var("add")
            self.line(f"{add} = torch.zeros({tt}, {tt}).masked_fill({deny}, float('-inf'))")
            self.line(f"{att} = {att} + {self.shaped(add, tt, bb)}")
        elif form == "int_fill":
            mi = self.var("mi")
            dt = self.c("torch.int32", "torch.uint8", "torch.int64", "torch.int8")
            self.tags.add("int_mask")
            self.line(f"{mi} = ({allow}).to({dt})")
            self.line(f"{att} = {att}.masked_fill({self.shaped(mi, tt, bb)} == 0, float('-inf'))")
        elif form == "large_neg":
            self.line(f"{att} = {att}.masked_fill({self.shaped(deny, tt, bb)}, {self.c('-1e9', 'torch.finfo(torch.float32).min')})")
        else:  # a mask multiplied in: masked scores become 0, not -inf (a user's mistake)
            self.line(f"{att} = {att} * {self.shaped(allow, tt, bb)}")

    # ---- attention -------------------------------------------------------------------
    def attention(self, a: str, layer: int, cfg: dict, causal: bool = False) -> str:
        """Attention over `a` [bb, tt, D]; returns a variable holding [bb, tt, D] (with
        `causal`, SDPA's is_causal: a fold must not be refused for its mask first)."""
        d, heads, kv = cfg["dim"], cfg["heads"], cfg["kv"]
        hd, g = d // heads, heads // kv
        bb, tt = self.var("b"), self.var("t")
        self.line(f"{bb}, {tt}, _ = {a}.shape")
        if self.p(0.3):
            self.param(f"self.qkv{layer} = nn.Linear({d}, {d + 2 * kv * hd}, bias={self.c(True, False)})")
            self.line(f"q, k, v = self.qkv{layer}({a}).split([{d}, {kv * hd}, {kv * hd}], dim=-1)")
            self.line(f"q = q.view({bb}, {tt}, {heads}, {hd}).transpose(1, 2)")
            self.line(f"k = k.view({bb}, {tt}, {kv}, {hd}).transpose(1, 2)")
            self.line(f"v = v.reshape({bb}, {tt}, {kv}, {hd}).permute(0, 2, 1, 3)")
        else:
            for n, h in (("q", heads), ("k", kv), ("v", kv)):
                self.param(f"self.{n}{layer} = nn.Linear({d}, {h * hd}, bias={self.c(True, False)})")
                self.line(f"{n} = self.{n}{layer}({a}).view({bb}, {tt}, {h}, {hd}).transpose(1, 2)")
        if self.p(0.5):
            self.tags.add("rope")
            self.param(f"self.register_buffer('inv{layer}', 1.0 / 10000 ** (torch.arange(0, {hd}, 2).float() / {hd}), persistent=False)")
            pos, _ = self.positions(tt, "rope")
            self.line(f"ang = {pos}[:, None].float() * self.inv{layer}[None, :]")
            self.line("cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)")
            self.line("q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin")
        kind = "sdpa_causal" if causal else self.c("sdpa_causal", "sdpa_mask", "sdpa_mask", "written", "written")
        self.tags.add(f"attn:{kind}")
        gqa = "none"
        if g > 1:
            gqa = self.c("expand", "repeat_interleave", "enable_gqa" if kind != "written" else "grouped")
            self.tags.add(f"gqa:{gqa}")
            if gqa == "expand":
                self.line(f"k = k[:, :, None].expand({bb}, {kv}, {g}, {tt}, {hd}).reshape({bb}, {heads}, {tt}, {hd})")
                self.line(f"v = v[:, :, None].expand({bb}, {kv}, {g}, {tt}, {hd}).reshape({bb}, {heads}, {tt}, {hd})")
            elif gqa == "repeat_interleave":
                self.line(f"k, v = k.repeat_interleave({g}, dim=1), v.repeat_interleave({g}, dim=1)")
        o = self.var("o")
        if kind.startswith("sdpa"):
            extra = ", enable_gqa=True" if gqa == "enable_gqa" else ""
            if kind == "sdpa_causal":
                self.line(f"{o} = F.scaled_dot_product_attention(q, k, v, is_causal=True{extra})")
            else:
                m, pol = self.mask(tt)
                am = self.sdpa_mask(m, pol, tt, bb)
                self.line(f"{o} = F.scaled_dot_product_attention(q, k, v, attn_mask={am}{extra})")
        else:
            self.grouped = gqa == "grouped"
            if gqa == "grouped":
                self.line(f"q = q.reshape({bb}, {kv}, {g}, {tt}, {hd})")
                self.line("k, v = k[:, :, None], v[:, :, None]")
            att = self.var("att")
            scale = self.c(f"* {hd ** -0.5}", f"/ {hd ** 0.5}")
            self.line(f"{att} = (q @ k.transpose(-2, -1)) {scale}")
            m, pol = self.mask(tt)
            self.apply_mask(att, m, pol, tt, bb)
            self.grouped = False
            self.line(f"{o} = {att}.softmax(dim=-1) @ v" if self.p(0.7) else f"{o} = F.softmax({att}.float(), dim=-1).to(q.dtype) @ v")
            if gqa == "grouped":
                self.line(f"{o} = {o}.reshape({bb}, {heads}, {tt}, {hd})")
        merge = self.c(f"{o}.transpose(1, 2).reshape({bb}, {tt}, {d})", f"{o}.transpose(1, 2).flatten(2)",
                       f"{o}.permute(0, 2, 1, 3).contiguous().view({bb}, {tt}, {d})")
        self.param(f"self.o{layer} = nn.Linear({d}, {d}, bias={self.c(True, False)})")
        out = self.var("y")
        self.line(f"{out} = self.o{layer}({merge})")
        return out

    def norm(self, layer, d: int, x: str) -> str:
        kind = self.c("layer", "rms", "hand_rms")
        name = f"n{layer}"
        if kind == "layer":
            self.param(f"self.{name} = nn.LayerNorm({d})")
            return f"self.{name}({x})"
        if kind == "rms":
            self.param(f"self.{name} = nn.RMSNorm({d}, eps=1e-5)")
            return f"self.{name}({x})"
        self.param(f"self.{name} = nn.Parameter(torch.ones({d}))")
        return f"({x} * torch.rsqrt({x}.pow(2).mean(-1, keepdim=True) + 1e-5) * self.{name})"

    # ---- around the sequence dim ------------------------------------------------------
    def reshuffle(self, d: int):
        """A token-local reshape / view / transpose / stack / flatten of h [B, T, D]."""
        form = self.c("flatten_bt", "transpose_tb", "stack_last", "stack_first", "split_feat", "unflatten",
                      "cat_feat")
        self.tags.add(f"reshape:{form}")
        if form == "flatten_bt":
            self.line("h = (h.reshape(B * T, D) * 1.5).view(B, T, D)" if self.p(0.5)
                      else "h = h.flatten(0, 1).unflatten(0, (B, T))")
        elif form == "transpose_tb":
            self.param(f"self.tg{self.n} = nn.Parameter(torch.ones({d}))")
            self.line(f"h = (h.transpose(0, 1) * self.tg{self.n}).transpose(0, 1)")
        elif form == "stack_last":
            self.line("h = torch.stack([h, F.silu(h)], dim=-1).sum(-1)")
        elif form == "stack_first":
            self.line("h = torch.stack([h, h * 0.5], dim=1).mean(1)")
        elif form == "split_feat":
            self.line("h = h.view(B, T, 2, D // 2).transpose(2, 3).reshape(B, T, D)")
        elif form == "unflatten":
            self.line("h = h.unflatten(-1, (2, D // 2)).flatten(-2)")
        else:
            self.line("h = torch.cat([h[..., :D // 2], h[..., D // 2:] * 2], dim=-1)")

    def block(self, layer: int, cfg: dict):
        d = cfg["dim"]
        fold = self.p(0.08)
        if fold:  # a leading dim folded into the sequence dim before attention
            self.tags.add("fold_into_T")
            form = self.c("batch", "stack", "cat")
            self.tags.add(f"fold:{form}")
            src = {"batch": "h.reshape(1, B * T, D)", "stack": "torch.stack([h, h * 0.5], 1).reshape(B, 2 * T, D)",
                   "cat": "torch.cat([h, h * 0.5], dim=1)"}[form]
            self.line(f"g = {self.norm(layer, d, src)}")
            y = self.attention("g", layer, cfg, causal=self.p(0.7))
            back = {"batch": f"{y}.reshape(B, T, D)", "stack": f"{y}.reshape(B, 2, T, D).sum(1)",
                    "cat": f"{y}[:, :T] + {y}[:, T:]"}[form]
            self.line(f"h = h + {back}")
        else:
            self.line(f"a = {self.norm(layer, d, 'h')}")
            y = self.attention("a", layer, cfg)
            self.line(f"h = h + {y}")
        if self.p(0.3):
            self.param(f"self.u{layer} = nn.Linear({d}, {2 * d})")
            self.param(f"self.dn{layer} = nn.Linear({2 * d}, {d})")
            act = self.c("F.gelu", "F.relu", "F.silu")
            self.line(f"h = h + self.dn{layer}({act}(self.u{layer}({self.norm(f'm{layer}', d, 'h')})))")

    # ---- losses ----------------------------------------------------------------------
    def probs(self, v: int) -> str:
        form = self.c("onehot", "input", "teacher")
        self.tags.add(f"probs:{form}")
        if form == "onehot":
            self.line(f"probs = F.one_hot(y.clamp(min=0), {v}).float() * 0.9 + {0.1 / v}")
        elif form == "input":
            self.line(f"probs = {self.extra('p')}")
        else:
            self.param(f"self.teach = nn.Linear(D_, {v})".replace("D_", str(self.dim)))
            self.line(f"probs = torch.softmax(self.teach(h){'.detach()' if self.p(0.5) else ''}, dim=-1)")
        return "probs"

    def loss_term(self, v: int) -> str:
        kind = self.c("ce", "ce", "ce", "soft_ce", "kl", "nll", "mse", "weighted_ce")
        self.tags.add(f"loss:{kind}")
        flat = self.c("logits.flatten(0, 1)", f"logits.view(-1, {v})", f"logits.reshape(B * T, {v})")
        if kind == "ce":
            red = self.c("mean", "mean", "sum", "none_mean", "none_sum")
            kw = []
            tgt = "y"
            if self.p(0.3):
                ii = self.c(-100, 0, 3)
                kw.append(f"ignore_index={ii}")
                self.tags.add("ignore_index")
                tgt = "y" if ii == -100 else "y.clamp(min=0)"  # IGNORE is out of range for another index
            if self.p(0.3):
                kw.append(f"label_smoothing={self.c(0.1, 0.25)}")
                self.tags.add("label_smoothing")
            kw.append(f"reduction='{red.split('_')[0]}'")
            layout = self.c("flat", "flat", "class_dim")
            args = f"{flat}, {tgt}.flatten()" if layout == "flat" else f"logits.transpose(1, 2), {tgt}"
            expr = f"F.cross_entropy({args}, {', '.join(kw)})"
            return expr + (f".{red.split('_')[1]}()" if "_" in red else "")
        if kind == "soft_ce":
            p = self.probs(v)
            red = self.c("mean", "mean", "sum")
            self.tags.add(f"soft_ce_{red}")
            ls = f", label_smoothing={self.c(0.1, 0.2)}" if self.p(0.2) else ""
            if self.p(0.6):
                return f"F.cross_entropy({flat}, {p}.flatten(0, 1), reduction='{red}'{ls})"
            return f"F.cross_entropy(logits.transpose(1, 2), {p}.transpose(1, 2), reduction='{red}'{ls})"
        if kind == "kl":
            p = self.probs(v)
            red = self.c("mean", "sum", "batchmean", "none")
            self.tags.add(f"kl_{red}")
            logt = self.p(0.3)
            tgt = f"{p}.log()" if logt else p
            lp = self.c("F.log_softmax(logits, dim=-1)", f"F.log_softmax({flat}, dim=-1)")
            if lp != "F.log_softmax(logits, dim=-1)":
                tgt = f"{tgt}.flatten(0, 1)"
            expr = f"F.kl_div({lp}, {tgt}, reduction='{'none' if red == 'none' else red}', log_target={logt})"
            return expr + (".sum()" if red == "none" else "")
        if kind == "nll":
            ii = f", ignore_index=2" if self.p(0.3) else ""
            return f"F.nll_loss(F.log_softmax({flat}, dim=-1), y{'.clamp(min=0)' if ii else ''}.flatten(){ii}, reduction='{self.c('mean', 'sum')}')"
        if kind == "mse":
            p = self.probs(v)
            return f"F.mse_loss(logits.softmax(-1), {p}, reduction='{self.c('mean', 'sum')}')"
        # per-token weights: an input with the sequence dim
        wt = self.extra("wt")
        self.tags.add("loss_uses_input")
        red = self.c("sum", "mean", "norm")
        self.line(f"tok = F.cross_entropy({flat}, y.flatten(), reduction='none') * {wt}.flatten()")
        return {"sum": "tok.sum()", "mean": "tok.mean()", "norm": f"tok.sum() / {wt}.sum()"}[red]

    def loss(self, v: int):
        self.line(f"loss = {self.loss_term(v)}")
        if self.p(0.2):
            self.line(f"loss = loss + {self.c(0.5, 1.0)} * {self.loss_term(v)}")
        if self.p(0.15):
            self.tags.add("z_loss")
            self.line("loss = loss + 1e-3 * torch.logsumexp(logits, dim=-1).pow(2).mean()")
        if self.p(0.15):
            self.tags.add("loss_uses_input")
            form = self.c("w_mean", "s_mul", "s_div", "w_per_sample")
            self.tags.add(f"weight:{form}")
            if form == "w_mean":
                self.line(f"loss = loss * {self.extra('w')}.mean()")
            elif form == "s_mul":
                self.line(f"loss = loss * {self.extra('s')}")
            elif form == "s_div":
                self.line(f"loss = loss / {self.extra('s')}")
            else:
                self.line(f"loss = loss + (F.cross_entropy(logits.transpose(1, 2), y, reduction='none').mean(1) "
                          f"* {self.extra('w')}).sum()")


def generate(seed: int) -> Program:
    """One program, a pure function of `seed`."""
    rng = random.Random(seed)
    g = _Gen(rng)
    v, d = g.c(11, 17), g.c(8, 16)
    heads = g.c(1, 2, 2, 4)
    kv = g.c(*[k for k in (1, 2, 4) if heads % k == 0])
    g.dim = d
    batch, seq = g.c(1, 2), rng.randint(8, 24)
    cfg = {"dim": d, "heads": heads, "kv": kv}
    g.param(f"self.tok = nn.Embedding({v}, {d})")
    g.line("B, T = x.shape")
    g.line(f"D = {d}")
    g.line("h = self.tok(x)")
    learned = g.c("none", "none", "table", "slice", "table_dtype")
    if learned != "none":
        g.tags.add(f"pos_table:{learned}")
        g.param(f"self.pos = nn.Embedding(32, {d})")
        if learned == "table":
            g.line(f"h = h + self.pos(torch.arange(T) + {g.c(0, 2)})")
        elif learned == "slice":
            g.line("h = h + self.pos.weight[:T]")
        else:
            i, _ = g.positions("T", "table")
            g.line(f"h = h + self.pos({i}.long() % 32)")
    layers = g.c(1, 1, 1, 1, 2)  # export dominates the cost: mostly one layer
    for layer in range(layers):
        if g.p(0.2):
            g.reshuffle(d)
        g.block(layer, cfg)
    if g.p(0.1):
        g.reshuffle(d)
    g.line(f"h = {g.norm('f', d, 'h')}")
    tied = g.p(0.3)
    g.param(f"self.head = nn.Linear({d}, {v}, bias={g.c(True, False)})")
    if tied:
        g.param("self.head.weight = self.tok.weight")
    g.line("logits = self.head(h)")
    ignore = g.c(0.0, 0.0, 0.3)
    if ignore:
        g.tags.add("ignored_targets")
    g.loss(v)
    g.line("return loss")
    if heads % 2 == 0:
        g.tags.add("seq_parallel_ok")
    args = ", ".join(["x", "y", *g.extras])
    src = (HEADER + "class Prog(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
           + "".join(f"        {line}\n" for line in g.init)
           + f"\n    def forward(self, {args}):\n" + "".join(f"        {line}\n" for line in g.fwd))
    return Program(seed, src, frozenset(g.tags), batch, seq, v, heads, tuple(g.extras), ignore)
