"""An input that is all ones (a tokenizer's attention_mask of unpadded sequences) -> a constant.

Hugging Face models build their attention mask, and OPT and Bloom their positions, from
`attention_mask` when it is given. As a graph input the mask is data: the mask proof
(`passes/masks/proof.py`) cannot show what it lets a query see, and a cumsum over it
(`passes/positions.py`) is not a position range, so the program is refused. Yet the mask a
tokenizer gives for unpadded training batches (and HF Trainer passes) is all ones, and
over ones these are the same graphs the models build with no mask, which are proven.

So when the program with the input is refused, and the example call's value of an input
named in `CompileOptions.ones_inputs` is all ones, `specialise_ones` replaces every use of
that input by `aten.ones` of its shape and dtype (the factory the mask proof evaluates as
the constant 1) and runs the passes again. The input stays a placeholder (the call's
signature does not change), and the graph's meta records a guard,
gm.meta["sppo_ones_inputs"]: `mask_values.check_ones_inputs` checks at every call, before
any work of the call, that each guarded input is still all ones, and refuses a padded one
by name; without the guard a padded mask would silently train as unpadded.

An input that is not all ones in the example call is left alone (today's refusal, or the
general program where the passes accept it). A program accepted with the input as data is
never specialised, so such a model keeps taking any mask.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from sppo_fx.capture import Captured
from sppo_fx.util.log import get_logger
from sppo_fx.passes.masks.proof import MaskEvaluator
from sppo_fx.passes.masks.values import Band, Const, NotProvable

log = get_logger(__name__)
aten = torch.ops.aten

ONES_INPUTS = ("attention_mask",)
GUARD_KEY = "sppo_ones_inputs"


@dataclasses.dataclass(frozen=True)
class OnesGuard:
    """A user input the program assumes all ones: its place among the call's flat input
    tensors and its name in the call."""

    index: int
    label: str


def example_inputs(captured: Captured) -> list[torch.Tensor]:
    """The example call's flat input tensors, in the order of `captured.input_names`."""
    module = captured.module
    return [module._leaves[i] for i in module._slots]


def _all_ones(t: torch.Tensor) -> bool:
    return t.numel() > 0 and not t.is_complex() and bool((t == 1).all())


def ones_candidates(captured: Captured, names) -> list[OnesGuard]:
    """The inputs named in `names` (matched by their call keyword, `input_labels`) whose
    example value is all ones."""
    labels = captured.input_labels or []
    examples = example_inputs(captured)
    return [OnesGuard(i, label) for i, label in enumerate(labels)
            if label in set(names) and i < len(examples) and _all_ones(examples[i])]


def specialise_ones(gm: fx.GraphModule, captured: Captured, guards: list[OnesGuard]) -> fx.GraphModule:
    """Replace every use of each guarded input by a tensor of ones of its shape and dtype;
    record the guards in gm.meta (module docstring). Modifies `gm` in place and returns it."""
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    kept = []
    for guard in guards:
        node = placeholders.get(captured.input_names[guard.index])
        if node is None or not node.users:
            continue
        val = node.meta["val"]
        users = list(node.users)
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(last):
            ones = gm.graph.call_function(aten.ones.default, ([],), {"dtype": val.dtype, "device": val.device})
        with gm.graph.inserting_before(ones):
            sizes = []
            for d, s in enumerate(val.shape):
                if isinstance(s, torch.SymInt):  # the size at run time, read from the input itself
                    size = gm.graph.call_function(aten.sym_size.int, (node, d))
                    size.meta["val"] = s
                    s = size
                sizes.append(s)
        ones.args = (sizes,)
        with val.fake_mode:
            ones.meta["val"] = torch.ones(val.shape, dtype=val.dtype, device=val.device)
        ones.meta["stack_trace"] = f"the input {guard.label}, all ones (guarded at every call)"
        for user in users:
            user.replace_input_with(node, ones)
        kept.append(guard)
        log.info("%s is all ones in the example call: the program treats it as a constant of ones and "
                 "checks that every call passes ones", guard.label)
    gm.meta[GUARD_KEY] = tuple(kept)
    if kept:
        _fold_gathers(gm, captured)
    gm.recompile()
    return gm


_GATHERS = {aten.index.Tensor, aten.index_select.default, aten.gather.default}


def _fold_gathers(gm: fx.GraphModule, captured: Captured) -> None:
    """An element gathered from a tensor of one value is that value: HF's padding mask reads
    `attention_mask[batch_idx, kv_idx]` (aten.index), which the mask proof does not model;
    over the ones it is a tensor of ones of the index's shape, which it does. Only sources
    the mask proof evaluates to one constant are folded."""
    evaluator = MaskEvaluator(captured.seq, captured.param_value)
    sizes = {}  # symbolic size -> (placeholder, dim) that has it, to rebuild shapes from
    for n in gm.graph.nodes:
        if n.op == "placeholder" and isinstance(v := n.meta.get("val"), torch.Tensor):
            for d, s in enumerate(v.shape):
                if isinstance(s, torch.SymInt):
                    sizes.setdefault(str(s.node.expr), (n, d))
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _GATHERS:
            continue
        try:
            value = evaluator.value(node.args[0])
        except NotProvable:
            continue
        if isinstance(value, Band) and not value.form and value.values.numel() == 1:
            fill = value.values.reshape(())
        elif isinstance(value, Const) and torch.as_tensor(value.value).numel() == 1:
            fill = torch.as_tensor(value.value).reshape(())
        else:
            continue
        out = node.meta["val"]
        shape = []
        with gm.graph.inserting_before(node):
            for s in out.shape:
                if isinstance(s, torch.SymInt):
                    if str(s.node.expr) not in sizes:
                        break
                    src, d = sizes[str(s.node.expr)]
                    size = gm.graph.call_function(aten.sym_size.int, (src, d))
                    size.meta["val"] = s
                    s = size
                shape.append(s)
            else:
                fill = fill.to(out.dtype).item()
                full = gm.graph.call_function(aten.full.default, (shape, fill),
                                              {"dtype": out.dtype, "device": out.device})
                full.meta.update(node.meta)
                node.replace_all_uses_with(full)
                gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()


__all__ = ["ONES_INPUTS", "GUARD_KEY", "OnesGuard", "ones_candidates", "specialise_ones", "example_inputs"]
