"""The embedding's weight gradient on tk (ltorch.embedding_backward -> tk_embedding_backward) in real Thunder traces
on CPU, tk's kernels standing in (`standins.StandinBuild`): a LitGPT model's token embedding gets its gradient from
tk, as accurate as float64 eager's rounded; frequency scaling, sparse gradients, float64 and the switches keep
PyTorch's, with the reason in `explain`; the reference is PyTorch's own."""

import copy

import pytest
import torch

import thunder
import thunder_tk
from thunder_tk import ops, tk

bf16 = torch.bfloat16


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def backward_names(jm):
    return [b.sym.name for b in thunder.last_backward_traces(jm)[-1].bound_symbols]


def embedding_row(jm):
    rows = [r for r in thunder_tk.explain(jm).rows if r.symbol == "ltorch.embedding_backward"]
    assert len(rows) == 1, [r.symbol for r in thunder_tk.explain(jm).rows]
    return rows[0]


def test_litgpt_token_embedding_gradient_from_tk(standin_tk_build, standin_nvfuser):
    litgpt = pytest.importorskip("litgpt")
    cfg = litgpt.Config.from_name("Llama-3.2-1B", n_layer=1, n_embd=256, n_head=4, n_query_groups=2, head_size=64,
                                  intermediate_size=512, padded_vocab_size=512, block_size=64)
    torch.manual_seed(0)
    model = litgpt.GPT(cfg).to(bf16)
    exact = copy.deepcopy(model).double()
    idx = torch.randint(0, 512, (2, 32))
    jm = thunder.jit(model, executors=[tk])
    out = jm(idx)
    seed = torch.randn(out.shape)
    (out.float() * seed).sum().backward()
    (exact(idx) * seed.double()).sum().backward()
    assert "tk_embedding_backward" in backward_names(jm)
    assert rel_err(model.transformer.wte.weight.grad, exact.transformer.wte.weight.grad) < 3e-2
    row = embedding_row(jm)
    assert row.claimed_by_tk and row.ran_by == "tk: tk_embedding_backward", row


class Lookup(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 64, **kw)

    def forward(self, ids):
        return self.emb(ids).float().square().sum()


@pytest.mark.parametrize("kw,dtype,why", [({"scale_grad_by_freq": True}, bf16, "scale_grad_by_freq"),
                                          ({}, torch.float64, "dtype torch.float64")],
                         ids=["frequency-scaled", "float64"])
def test_declines_with_the_reason(standin_tk_build, standin_nvfuser, kw, dtype, why):
    torch.manual_seed(0)
    model = Lookup(**kw).to(dtype)
    exact = copy.deepcopy(model).double()
    ids = torch.randint(0, 100, (3, 40))
    jm = thunder.jit(model, executors=[tk])
    jm(ids).backward()
    exact(ids).backward()
    assert "tk_embedding_backward" not in backward_names(jm)
    assert rel_err(model.emb.weight.grad, exact.emb.weight.grad) < 3e-2
    row = embedding_row(jm)
    assert not row.claimed_by_tk and why in row.reason, row


@pytest.mark.parametrize("name", ["ltorch.embedding_backward", "embedding"])
def test_turned_off(standin_tk_build, standin_nvfuser, name):
    model = Lookup(padding_idx=3).to(bf16)
    jm = thunder.jit(model, executors=[tk], tk_disable=name)
    jm(torch.randint(0, 100, (3, 40))).backward()
    assert "tk_embedding_backward" not in backward_names(jm)


def test_padding_row_gets_no_gradient(standin_tk_build, standin_nvfuser):
    torch.manual_seed(0)
    model = Lookup(padding_idx=3).to(bf16)
    ids = torch.randint(0, 10, (3, 40))
    jm = thunder.jit(model, executors=[tk])
    jm(ids).backward()
    assert "tk_embedding_backward" in backward_names(jm)
    assert not model.emb.weight.grad[3].any() and model.emb.weight.grad[:10].any()


def test_the_reference_is_pytorchs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (4, 33), generator=g)
    grad = torch.randn(4, 33, 24, generator=g, dtype=torch.float64)
    for pad in (-1, 7):
        want = torch.ops.aten.embedding_dense_backward(grad, ids, 50, pad, False)
        assert torch.allclose(ops.embedding_backward_reference(grad, ids, 50, pad), want)
