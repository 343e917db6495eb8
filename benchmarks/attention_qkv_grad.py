"""The attention backward into the fused qkv projection's gradient, LitGPT's rope backward included
(ops.attention_backward_qkv, what `tk_attention_backward_qkv` runs in a training step), against the same gradient
made the way the step made it before: tk's attention backward, then the rope backward and the concatenation of dq,
dk and dv as one torch.compile'd function (the fuser's Triton kernels); and PyTorch's flash/cuDNN SDPA backward on
LitGPT's repeated K/V heads (autograd sums them back) followed by the same compiled function (Thunder's default
executors). Timed in turns (common.interleaved_ms), µs; ratios against the fold; JSON and an optional PNG.

Shapes: the training steps' attention (batch x sequence 8192 tokens): Llama-3.2-1B (32 heads over 8 of 64, rope 64),
TinyLlama (32 over 4), Llama-3-8B (32 over 8 of 128), Pythia-1.4B-like partial rope (16 heads of 128, rope 32).
`--tables float32` uses fp32 cos and sin (bf16-mixed training's), bf16 by default (both: a row each). Each row also
times the fold's last pass alone (the rope backward of dq and dk into the projection's gradient) against the
compiled function alone, with the pass's rate over the bytes it must move (dq's fp32 accumulator in, dq out, dk in
and out).

    python benchmarks/attention_qkv_grad.py --json out/attention_qkv_grad.json --png out/attention_qkv_grad.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_ms, report, shape_arguments  # noqa: E402

from thunder_tk import ops  # noqa: E402

# name: (B, S, Hq, Hkv, D, rope columns)
SHAPES = {
    "llama-3.2-1b": (4, 2048, 32, 8, 64, 64),
    "tinyllama-1.1b": (4, 2048, 32, 4, 64, 64),
    "llama-3-8b": (1, 8192, 32, 8, 128, 128),
    "pythia-1.4b-like": (4, 2048, 16, 16, 128, 32),
}


def rope_back_and_cat(dq, dk, dv, cos, sin):
    """The peer's elementwise part: the rope backward of dq and dk and the concatenation of dq, dk and dv, in their
    16-bit dtype as the traced model's ops compute it (ops.qkv_grad_reference's formula)."""
    return ops.qkv_grad_reference(dq, dk, dv, cos, sin, dtype=None)


def measure(name: str, compiled, rounds: int, table_dtype: torch.dtype) -> dict:
    """One shape's row: the three ways timed in turns, after checking that they agree; then the fold's rope pass
    alone against the compiled function alone."""
    B, S, Hq, Hkv, D, n = SHAPES[name]
    dtype, dev = torch.bfloat16, "cuda"
    qkv = torch.randn(B, S, (Hq + 2 * Hkv) * D, device=dev, dtype=dtype)
    q, k, v = ops.qkv_head_views(qkv, Hq, Hkv, D)
    cos, sin = ops.rope_tables(S, n, table_dtype, dev)
    o, lse = ops.attention_forward(q, k, v, is_causal=True)
    do = torch.randn_like(o)

    def fold():
        return ops.attention_backward_qkv(q, k, v, o, lse, do, cos, sin, is_causal=True)

    def tk_then_compiled():
        return compiled(*ops.attention_backward(q, k, v, o, lse, do, is_causal=True), cos, sin)

    # The default executors' path: SDPA on the repeated K/V heads, autograd summing them back.
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr.repeat_interleave(Hq // Hkv, 1), vr.repeat_interleave(Hq // Hkv, 1),
                                         is_causal=True)

    def sdpa_then_compiled():
        dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)
        return compiled(dq, dk, dv, cos, sin)

    want = tk_then_compiled().double()
    for label, got in (("fold", fold()), ("sdpa", sdpa_then_compiled())):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 2e-2, f"{name}: {label} differs from tk + compiled rope by {err:.3g}"
    t = interleaved_ms({"fold": fold, "tk+compile": tk_then_compiled, "sdpa+compile": sdpa_then_compiled},
                       rounds=rounds)
    row = {"shape": name if table_dtype != torch.float32 else f"{name} fp32 tables", "B": B, "S": S, "Hq": Hq,
           "Hkv": Hkv, "D": D, "rope": n, "tables": str(table_dtype).removeprefix("torch."),
           "fold_us": t["fold"] * 1e3, "tk_compile_us": t["tk+compile"] * 1e3,
           "sdpa_compile_us": t["sdpa+compile"] * 1e3,
           "vs_tk_compile": t["tk+compile"] / t["fold"], "vs_sdpa_compile": t["sdpa+compile"] / t["fold"]}
    return row | rope_pass_alone(compiled, B, S, Hq, Hkv, D, cos, sin, rounds)


def rope_pass_alone(compiled, B, S, Hq, Hkv, D, cos, sin, rounds: int) -> dict:
    """The fold's last pass (ops._rope_grad_pass) on a random dQ accumulator and dk, checked against float64, and
    timed in turns with the compiled rope backward and concatenation on the same gradients."""
    dev = cos.device
    dq_accum = torch.randn(B, Hq, S, D, device=dev, dtype=torch.float32)
    grad = torch.empty(B, S, (Hq + 2 * Hkv) * D, device=dev, dtype=torch.bfloat16)
    dq, dk, dv = ops.qkv_head_views(grad, Hq, Hkv, D)
    dk_in, dv_in = torch.randn_like(dk), torch.randn_like(dv)
    dk.copy_(dk_in)
    dv.copy_(dv_in)
    ext = ops._require_kernels(dev)
    ops._rope_grad_pass(ext, dq_accum, 1.0, dq, dk, cos, sin)
    want = ops.qkv_grad_reference(dq_accum, dk_in, dv_in, cos, sin)
    err = ((grad.double() - want).norm() / want.norm()).item()
    assert err < 1e-2, f"the rope pass differs from float64 by {err:.3g}"
    dq16 = dq_accum.to(torch.bfloat16)
    t = interleaved_ms({"pass": lambda: ops._rope_grad_pass(ext, dq_accum, 1.0, dq, dk, cos, sin),
                        "compiled": lambda: compiled(dq16, dk_in, dv_in, cos, sin)}, rounds=rounds)
    moved = dq_accum.numel() * (4 + 2) + dk.numel() * 2 * 2  # dq's accumulator in, dq out, dk in and out
    return {"pass_us": t["pass"] * 1e3, "compiled_rope_cat_us": t["compiled"] * 1e3,
            "tk_pass_gbps": moved / t["pass"] / 1e6, "pass_vs_compiled": t["compiled"] / t["pass"]}


def main() -> None:
    a = shape_arguments("attention_qkv_grad", SHAPES, extend=lambda p: p.add_argument(
        "--tables", nargs="+", choices=("bfloat16", "float32"), default=["bfloat16"],
        help="the rope tables' dtypes, a row per shape for each"))
    # one compiled function over every shape and table dtype: past dynamo's default of 8 recompilations it would
    # fall back to eager for the later rows
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(rope_back_and_cat)
    rows = [measure(name, compiled, a.rounds, getattr(torch, tables)) for name in a.shapes for tables in a.tables]
    report(a, "attention_qkv_grad", rows, ["shape", "tables", "fold_us", "tk_compile_us", "sdpa_compile_us",
                                           "vs_tk_compile", "vs_sdpa_compile", "pass_us", "compiled_rope_cat_us",
                                           "tk_pass_gbps", "pass_vs_compiled"],
           f"attention backward into dqkv with rope, causal, bf16, {'/'.join(a.tables)} tables (us)",
           {"tk fold": "fold_us", "tk + torch.compile": "tk_compile_us", "SDPA + torch.compile": "sdpa_compile_us"})


if __name__ == "__main__":
    main()
