"""Op by op, a parameter's first gradient is the graph's own tensor, taken over without a
copy (`runtime.memory.adopted_grad`), as autograd's AccumulateGrad takes it; where the
graph's tensor could share memory with anything else, it is copied."""
from __future__ import annotations

import torch

import sppo_fx
import sppo_fx.runtime.local as local
from sppo_fx.runtime.memory import adopted_grad
from conftest import tiny_hf_llama


def test_a_fresh_tensor_in_the_parameters_layout_is_taken_over():
    leaf = torch.zeros(3, 4)
    grad = torch.randn(3, 4).t().t()  # a view of a fresh matmul-like output, as AOTAutograd's t(t(mm))
    taken = adopted_grad(grad, leaf, [])
    assert taken is not None and taken._base is None
    assert taken.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    assert torch.equal(taken, grad)


def test_tensors_that_share_or_do_not_fit_their_memory_are_copied():
    leaf = torch.zeros(3, 4)
    buffer = torch.randn(2, 3, 4)
    assert adopted_grad(buffer[0], leaf, []) is None  # beside another tensor in one buffer
    assert adopted_grad(buffer[1], leaf, []) is None  # at an offset
    assert adopted_grad(torch.randn(4, 3).t(), leaf, []) is None  # another layout
    assert adopted_grad(torch.randn(3, 4, dtype=torch.float64), leaf, []) is None
    grad = torch.randn(3, 4)
    held = adopted_grad(grad, leaf, [])
    assert adopted_grad(grad, leaf, [held]) is None  # one tensor handed for two parameters


def test_op_by_op_steps_take_gradients_over_and_match_the_copying_step(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = tiny_hf_llama()
    ids = torch.randint(0, 128, (1, 256))
    # a tier: chunk programs are AOTAutograd's graphs run op by op (the memory passes')
    compiled = sppo_fx.compile(model, chunks=4, compile=False, offload="disk", offload_dir=str(tmp_path))
    taken = []

    def recording(grad, leaf, held):
        out = adopted_grad(grad, leaf, held)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(local, "adopted_grad", recording)
    compiled(input_ids=ids, labels=ids).backward()
    adopted = {n: p.grad.clone() for n, p in model.named_parameters()}
    # the norms' and the embedding's gradients (2 layers x 2 norms, the last norm, the
    # embedding); the matmul weights' come as products (`MatmulGrad`), fresh already
    assert sum(taken) >= 6, taken
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(local, "adopted_grad", lambda grad, leaf, held: None)  # always copy
    compiled(input_ids=ids, labels=ids).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, adopted[name]), name  # taking over changes no value


def test_a_sparse_embedding_gradient_accumulates_as_autograd_does(tmp_path):
    """nn.Embedding(sparse=True) hands its gradient over as a sparse tensor: copied once,
    then summed out of place (autograd's AccumulateGrad), never copied into dense memory."""
    from sppo_fx.models import build
    torch.manual_seed(0)
    model = build("llama", "tiny")
    model.tok_embeddings.sparse = True
    x, y = torch.randint(0, 97, (1, 256)), torch.randint(0, 97, (1, 256))
    model(x, y).backward()
    ref = {n: p.grad.to_dense().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compiled = sppo_fx.compile(model, chunks=4, compile=False, offload="disk", offload_dir=str(tmp_path))
    compiled(x, y).backward()
    assert model.tok_embeddings.weight.grad.layout == torch.sparse_coo
    for name, p in model.named_parameters():
        if name in ref:
            torch.testing.assert_close(p.grad.to_dense(), ref[name], rtol=1e-4, atol=1e-5, msg=name)
