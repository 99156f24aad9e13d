"""Unit tests of the sequence-dimension analysis on hand-built FX graphs."""
from __future__ import annotations

import operator

import pytest
import torch

from sppo_fx import SppoError
from sppo_fx.passes.seqdim import analyse

aten = torch.ops.aten


def _lm(hand, tail=None):
    """ids -> embedding -> linear -> (tail) -> cross_entropy(mean)."""
    ids = hand.input("ids", (2, hand.T), torch.int64)
    labels = hand.input("labels", (2, hand.T), torch.int64)
    wte = hand.param("wte", (11, 8))
    emb = hand.call(aten.embedding.default, wte, ids)
    h = hand.call(aten.linear.default, emb, hand.param("w", (8, 8)))
    if tail is not None:
        h = tail(hand, h)
    logits = hand.call(aten.linear.default, h, wte)
    flat = hand.call(aten.view.default, logits, [-1, 11])
    tgt = hand.call(aten.view.default, labels, [-1])
    loss = hand.call(aten.cross_entropy_loss.default, flat, tgt)
    return hand.output(loss)


def _roles(hand, gm):
    info = analyse(gm, hand.seq, hand.params)
    return {name: (i.kind, i.role, i.seq_dims) for name, i in info.items()}


def test_token_local_chain(hand):
    gm = _lm(hand)
    roles = _roles(hand, gm)
    assert roles["embedding_default"] == ("data", "token_local", (1,))
    assert roles["wte"] == ("param", "token_local", ())
    assert roles["view_default"][2] == (0,)  # [b*T, V]: the merged dim still carries the sequence
    assert roles["cross_entropy_loss_default"][1] == "reduction"
    assert roles["view_default_1"][:2] == ("input", "token_local")


def test_positions_are_positional_sources(hand):
    def tail(hand, h):
        n = hand.size(h, 1)
        pos = hand.call(aten.arange.default, n, dtype=torch.float32)
        col = hand.call(aten.unsqueeze.default, pos, -1)
        return hand.call(aten.add.Tensor, h, col)

    roles = _roles(hand, _lm(hand, tail))
    assert roles["sym_size_int"][0] == "size"
    assert roles["arange_default"] == ("position", "positional", (0,))
    assert roles["unsqueeze_default"] == ("position", "token_local", (0,))
    assert roles["add_tensor"][:2] == ("data", "token_local")


def test_causal_sdpa_is_an_attention_site(hand):
    def tail(hand, h):
        q = hand.call(aten.view.default, h, [2, hand.size(h, 1), 2, 4])
        q = hand.call(aten.transpose.int, q, 1, 2)
        a = hand.call(aten.scaled_dot_product_attention.default, q, q, q, None, 0.0, True)
        a = hand.call(aten.transpose.int, a, 1, 2)
        return hand.call(aten.reshape.default, a, [2, hand.size(h, 1), 8])

    roles = _roles(hand, _lm(hand, tail))
    assert roles["scaled_dot_product_attention_default"][1] == "attention"


def test_epilogue_after_reduction(hand):
    ids = hand.input("ids", (1, hand.T), torch.int64)
    h = hand.call(aten.embedding.default, hand.param("w", (5, 3)), ids)
    m = hand.call(aten.mean.default, h)
    half = hand.call(aten.mul.Tensor, m, 0.5)
    roles = _roles(hand, hand.output(half))
    assert roles["mean_default"][1] == "reduction"
    assert roles["mul_tensor"][1] == "epilogue"


def test_input_only_shift_goes_to_prologue(hand):
    ids = hand.input("ids", (1, hand.T), torch.int64)
    # (pad + slice as Hugging Face does it specialises the hand-made ShapeEnv; roll is the same shift)
    shifted = hand.call(aten.roll.default, ids, [-1], [1])
    h = hand.call(aten.embedding.default, hand.param("w", (5, 3)), shifted)
    roles = _roles(hand, hand.output(hand.call(aten.sum.default, h)))
    assert roles["roll_default"] == ("input", "prologue", (1,))
    assert roles["embedding_default"] == ("data", "token_local", (1,))


@pytest.mark.parametrize("op,args,match", [
    (aten.cumsum.default, (1,), "aten.cumsum.default"),
    (aten.flip.default, ([1],), "aten.flip.default"),
    (aten.mean.dim, ([1], True), "reduces over the sequence dimension"),  # a sum over it is a reduction (test_moe.py)
    (aten.select.int, (1, 0), "selects or splits along the sequence"),
])
def test_position_mixing_ops_are_refused(hand, op, args, match):
    ids = hand.input("ids", (2, hand.T), torch.int64)
    h = hand.call(aten.embedding.default, hand.param("w", (5, 3)), ids)
    mixed = hand.call(op, h, *args)
    gm = hand.output(hand.call(aten.sum.default, mixed))
    with pytest.raises(SppoError, match=match) as err:
        analyse(gm, hand.seq, hand.params)
    assert "hand_built.py" in str(err.value)


def test_matmul_contracting_the_sequence_is_refused(hand):
    ids = hand.input("ids", (2, hand.T), torch.int64)
    h = hand.call(aten.embedding.default, hand.param("w", (5, 3)), ids)
    ht = hand.call(aten.transpose.int, h, 1, 2)
    gram = hand.call(aten.bmm.default, ht, h)  # [b, 3, 3]: sums over all positions
    gm = hand.output(hand.call(aten.sum.default, gram))
    with pytest.raises(SppoError, match="contracts over the sequence dimension"):
        analyse(gm, hand.seq, hand.params)


def test_non_causal_sdpa_is_refused(hand):
    ids = hand.input("ids", (2, hand.T), torch.int64)
    h = hand.call(aten.embedding.default, hand.param("w", (5, 8)), ids)
    q = hand.call(aten.view.default, h, [2, hand.size(h, 1), 2, 4])
    a = hand.call(aten.scaled_dot_product_attention.default, q, q, q)
    with pytest.raises(SppoError, match="is_causal=True"):
        analyse(hand.output(hand.call(aten.sum.default, a)), hand.seq, hand.params)


def test_loss_combined_with_per_token_values_is_refused(hand):
    ids = hand.input("ids", (2, hand.T), torch.int64)
    h = hand.call(aten.embedding.default, hand.param("w", (5, 3)), ids)
    m = hand.call(aten.mean.default, h)
    centred = hand.call(aten.sub.Tensor, h, m)
    with pytest.raises(SppoError, match="combines a value reduced over the sequence"):
        analyse(hand.output(hand.call(aten.sum.default, centred)), hand.seq, hand.params)


# ---- ops that work along one dim, index and repeat: token-local unless the sequence dim is involved
def _hidden(hand):
    """[2, T, 3] hidden states computed from token ids."""
    ids = hand.input("ids", (2, hand.T), torch.int64)
    return hand.call(aten.embedding.default, hand.param("w", (5, 3)), ids)


def _const_index(hand):
    return hand.param("idx", (2,), torch.int64)


def _first(hand, node):
    """The node, or its first output (topk and sort return values and indices)."""
    return hand.call(operator.getitem, node, 0) if isinstance(node.meta["val"], tuple) else node


@pytest.mark.parametrize("build", [
    lambda hand, h: hand.call(aten.topk.default, h, 2),                   # dim -1 (MoE routing)
    lambda hand, h: hand.call(aten.sort.default, h, 2),
    lambda hand, h: hand.call(aten.cumsum.default, h, -1),
    lambda hand, h: hand.call(aten.repeat_interleave.self_int, h, 2, -1),  # rotary tables (Cohere)
    lambda hand, h: hand.call(aten.repeat.default, h, [3, 1, 2]),
    lambda hand, h: hand.call(aten.index.Tensor, h, [None, None, _const_index(hand)]),  # picks hidden
], ids=["topk", "sort", "cumsum", "repeat_interleave", "repeat", "index-other-dim"])
def test_ops_along_other_dims_are_token_local(hand, build):
    out = _first(hand, build(hand, _hidden(hand)))
    gm = hand.output(hand.call(aten.sum.default, out))
    info = analyse(gm, hand.seq, hand.params)
    assert info[out.name].role == "token_local" and info[out.name].seq_dims == (1,)


def test_a_table_looked_up_by_positions_is_token_local(hand):
    """GPT-J's `embed_positions[position_ids]`: position p reads the table at its own index."""
    h = _hidden(hand)
    pos = hand.call(aten.arange.default, hand.size(h, 1))
    rows = hand.call(aten.index.Tensor, hand.param("table", (64, 3)), [pos])  # [T, 3]
    gm = hand.output(hand.call(aten.sum.default, hand.call(aten.add.Tensor, h, rows)))
    info = analyse(gm, hand.seq, hand.params)
    assert (info["index_tensor"].kind, info["index_tensor"].role, info["index_tensor"].seq_dims) == \
        ("position", "token_local", (0,))


@pytest.mark.parametrize("build,match", [
    (lambda hand, h: hand.call(aten.topk.default, h, 2, 1), "works along the sequence dimension"),
    (lambda hand, h: hand.call(aten.cumsum.default, h, 1), "works along the sequence dimension"),
    (lambda hand, h: hand.call(aten.repeat_interleave.self_int, h, 2), "flattened tensor"),
    (lambda hand, h: hand.call(aten.repeat_interleave.self_int, h, 2, 1), "works along the sequence"),
    (lambda hand, h: hand.call(aten.repeat.default, h, [1, 2, 1]), "repeats along the sequence dimension"),
    (lambda hand, h: hand.call(aten.index.Tensor, h, [None, _const_index(hand)]), "indexes along the sequence"),
    (lambda hand, h: hand.call(aten.index.Tensor, h, [None, None, hand.call(
        aten.arange.default, hand.size(h, 1))]), "indices that have a sequence dimension"),
], ids=["topk-seq", "cumsum-seq", "repeat_interleave-flat", "repeat_interleave-seq", "repeat-seq",
        "index-seq", "index-by-positions"])
def test_ops_along_the_sequence_are_refused(hand, build, match):
    h = _hidden(hand)
    out = _first(hand, build(hand, h))
    gm = hand.output(hand.call(aten.sum.default, out))
    with pytest.raises(SppoError, match=match):
        analyse(gm, hand.seq, hand.params)


# ---- what a chunk would compute differently: the length as a value, interleaving reshapes,
# reductions of T x T values, sizes that depend on the data
def test_the_sequence_length_as_a_value_is_refused(hand):
    """`h * T` (or `T - 1 - arange(T)`, a repeat count of T): each chunk would use its own length."""
    h = _hidden(hand)
    scaled = hand.call(aten.mul.Tensor, h, hand.size(h, 1))
    with pytest.raises(SppoError, match="uses the sequence length as a value"):
        analyse(hand.output(hand.call(aten.sum.default, scaled)), hand.seq, hand.params)


def test_a_repeat_count_of_the_sequence_length_is_refused(hand):
    h = _hidden(hand)
    vec = hand.param("vec", (3,))
    rows = hand.call(aten.repeat_interleave.self_int, vec, hand.size(h, 1))  # [3T]
    as_rows = hand.call(aten.view.default, rows, [hand.size(h, 1), 3])  # row t is not vec
    with pytest.raises(SppoError, match="uses the sequence length as a value"):
        analyse(hand.output(hand.call(aten.sum.default, hand.call(aten.add.Tensor, h, as_rows))),
                hand.seq, hand.params)


def test_a_reshape_that_interleaves_positions_is_refused(hand):
    """[B, 3, T] -> [B, T, 3] by reshape (not transpose) mixes positions."""
    h = _hidden(hand)
    t = hand.call(aten.transpose.int, h, 1, 2)
    mixed = hand.call(aten.reshape.default, t, [2, hand.size(h, 1), 3])
    with pytest.raises(SppoError, match="reshapes so that positions interleave"):
        analyse(hand.output(hand.call(aten.sum.default, mixed)), hand.seq, hand.params)


def test_a_reshape_that_keeps_positions_together_is_token_local(hand):
    h = _hidden(hand)
    flat = hand.call(aten.reshape.default, h, [-1, 3])   # [B*T, 3]
    back = hand.call(aten.view.default, flat, [2, hand.size(h, 1), 3, 1])
    info = analyse(hand.output(hand.call(aten.sum.default, back)), hand.seq, hand.params)
    assert info["reshape_default"].role == info["view_default"].role == "token_local"


def test_a_reduction_of_a_t_by_t_value_is_refused(hand):
    """sum over h_i * h_j: each chunk holds only its own diagonal block of the T x T product."""
    h = _hidden(hand)
    a = hand.call(aten.unsqueeze.default, h, 2)  # [B, T, 1, 3]
    b = hand.call(aten.unsqueeze.default, h, 1)  # [B, 1, T, 3]
    pairs = hand.call(aten.mul.Tensor, a, b)
    with pytest.raises(SppoError, match="more than one sequence dimension"):
        analyse(hand.output(hand.call(aten.sum.default, pairs)), hand.seq, hand.params)


def test_an_embedding_of_a_table_with_a_sequence_dim_is_refused(hand):
    """`F.embedding(ids, buf[:T])` reads rows of other positions; of a plain table it is token-local."""
    h = _hidden(hand)
    ids = hand.graph.find_nodes(op="placeholder", target="ids")[0]
    table = hand.call(aten.slice.Tensor, hand.param("buf", (64, 3)), 0, 0, hand.size(h, 1))  # [T, 3]
    rows = hand.call(aten.embedding.default, table, ids)
    with pytest.raises(SppoError, match="looks up rows of a table that has a sequence dimension"):
        analyse(hand.output(hand.call(aten.sum.default, hand.call(aten.add.Tensor, h, rows))),
                hand.seq, hand.params)


def test_a_reshape_into_blocks_of_positions_is_refused(hand):
    """[B, T, 3] -> [B, 2, T/2, 3]: a sum over the block dim would add positions t and t + T/2."""
    h = _hidden(hand)
    half = hand.call(operator.floordiv, hand.size(h, 1), 2)
    blocks = hand.call(aten.view.default, h, [2, 2, half, 3])
    with pytest.raises(SppoError, match="splits the sequence dimension into blocks"):
        analyse(hand.output(hand.call(aten.sum.default, hand.call(aten.sum.dim_IntList, blocks, [1]))),
                hand.seq, hand.params)
