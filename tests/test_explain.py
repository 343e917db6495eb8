import json

import pytest
import torch
import thunder

import thunder_tk
from thunder_tk import tk


def test_table_and_data(standin_nvfuser):
    def f(a, w, o, g):
        return torch.nn.functional.linear(a, w), thunder_tk.attention_bwd_delta(o, g)

    jf = thunder.jit(f, executors=[tk])
    jf(torch.randn(4, 8), torch.randn(16, 8), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    report = thunder_tk.explain(jf)
    assert [r.symbol for r in report.rows] == ["ltorch.linear", "thunder_tk.attention_bwd_delta"]
    linear = report.rows[0]
    assert linear.trace == "forward" and linear.ran_by == "torch: linear" and linear.inputs == "f32[4, 8], f32[16, 8]"
    assert not linear.claimed_by_tk and linear.reason
    text = str(report)
    assert text.splitlines()[0].split() == ["trace", "symbol", "inputs", "tk", "ran", "by", "why", "tk", "declined"]
    assert "0 of 2 claimable symbols run on tk kernels." in text
    data = json.loads(report.to_json())
    assert data["rows"][1]["symbol"] == "thunder_tk.attention_bwd_delta" and data["planned"] is False


def test_training_rows_cover_forward_and_backward_gemms(standin_nvfuser):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    jm = thunder.jit(model, executors=[tk])
    jm(torch.randn(4, 16)).sum().backward()
    rows = thunder_tk.explain(jm).rows
    assert [(r.trace, r.symbol) for r in rows if r.trace == "forward"] == [("forward", "prims.linear")] * 2
    backward = [r for r in rows if r.trace == "backward"]
    assert {r.symbol for r in backward} == {"ltorch.matmul"} and len(backward) == 3  # dX of layer 2, dW of both
    assert all(r.ran_by == "torch: matmul" for r in backward)
    # Every call a step makes on the host, by who makes it: here the two linears and the GELU's fusion region
    report = thunder_tk.explain(jm)
    assert report.calls["forward"] == {"torch": 2, "fusion regions": 1}, report.calls
    backward_calls = report.calls["backward"]
    assert backward_calls["torch"] == 3 and backward_calls.get("fusion regions", 0) >= 1, backward_calls
    text = str(report)
    assert "forward: 3 calls a step on the host (torch 2, fusion regions 1)" in text, text
    assert json.loads(report.to_json())["calls"] == report.calls


def test_recompiles_report_only_the_last_traces(standin_nvfuser):
    def f(a, w):
        return torch.nn.functional.linear(a, w)

    jf = thunder.jit(f, executors=[tk])
    jf(torch.randn(4, 8), torch.randn(16, 8))
    jf(torch.randn(5, 8), torch.randn(16, 8))
    (row,) = thunder_tk.explain(jf).rows
    assert row.inputs == "f32[5, 8], f32[16, 8]"


def test_errors_name_the_problem():
    with pytest.raises(TypeError, match="expects the result of thunder.jit"):
        thunder_tk.explain(lambda x: x)
    jf = thunder.jit(lambda x: x + 1, executors=[tk])
    with pytest.raises(ValueError, match="call the jitted function once first"):
        thunder_tk.explain(jf)
