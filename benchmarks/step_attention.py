"""The attention calls of one LitGPT training step under Thunder [tk], each timed alone on tk and on cuDNN.

`litgpt_step.py --profile` gives the step's attention time per library; this says whether a call runs in the step
as fast as the attention benchmark says it should. It builds the tk variant, records every `ops.attention_forward`
and `ops.attention_backward` call of one step (shapes and strides of every tensor, causal, scale), profiles one
step's attention kernels, then times each distinct call on fresh tensors with the step's strides and with
contiguous ones, tk against SDPA's cuDNN backend, in turns. Where K and V are grouped (LitGPT's repeated heads read
as they are: `pattern_fusion.attend_grouped_kv`), tk and cuDNN also run on K/V repeated over the query heads, what
cuDNN gets in the step (tk/cuDNN is then against that). Each tk variant's kernels are listed with their times
(torch.profiler), so a copy made before a kernel, or a kernel slower at the step's strides, shows by name.

    python benchmarks/step_attention.py --n-layer 2 --json out/step_attention.json
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention import bwd_flops, fwd_flops, sdpa_forward  # noqa: E402
from common import interleaved_ms, print_table, profiled_kernels, write_results  # noqa: E402
from litgpt_step import Built, add_model_arguments, variants  # noqa: E402

from thunder_tk import ops  # noqa: E402

ATTENTION_KERNEL = "tk::attention"


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride()


def record_attention_calls(step) -> list[tuple]:
    """The attention calls of one run of `step`, in order: ('fwd' | 'bwd', layouts of the tensor arguments, dtype,
    is_causal, scale)."""
    calls: list[tuple] = []
    fwd, bwd = ops.attention_forward, ops.attention_backward

    def recording_fwd(q, k, v, *, is_causal=False, scale=None, **knobs):
        calls.append(("fwd", tuple(_layout(t) for t in (q, k, v)), q.dtype, bool(is_causal), scale))
        return fwd(q, k, v, is_causal=is_causal, scale=scale, **knobs)

    def recording_bwd(q, k, v, o, lse, grad_o, *, is_causal=False, scale=None, **knobs):
        if not knobs:
            calls.append(("bwd", tuple(_layout(t) for t in (q, k, v, o, lse, grad_o)), q.dtype, bool(is_causal),
                          scale))
        return bwd(q, k, v, o, lse, grad_o, is_causal=is_causal, scale=scale, **knobs)

    ops.attention_forward, ops.attention_backward = recording_fwd, recording_bwd
    try:
        step()
        torch.cuda.synchronize()
    finally:
        ops.attention_forward, ops.attention_backward = fwd, bwd
    return calls


def kernel_times(fn, reps: int = 5) -> list[tuple[str, float, int]]:
    """(kernel name, mean ms per call of fn, launches per call) for the kernels fn launches, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = [(name[:90], ms / reps, n // reps) for name, (ms, n) in profiled_kernels(prof).items()]
    return sorted(out, key=lambda kv: -kv[1])


def step_kernels(step) -> list[tuple[str, float, int]]:
    """One step's kernels that belong to attention (tk's), by torch.profiler: (name, ms in the step, launches)."""
    return [k for k in kernel_times(step, reps=1) if ATTENTION_KERNEL in k[0]]


def strided(layout, dtype, *, contiguous: bool = False) -> torch.Tensor:
    shape, stride = layout
    if contiguous:
        return torch.randn(shape, dtype=dtype, device="cuda")
    return torch.empty_strided(shape, stride, dtype=dtype, device="cuda").normal_()


def cudnn(q, k, v, causal, scale):
    """SDPA's cuDNN backend on these tensors, as a callable (attention.sdpa_forward)."""
    from torch.nn.attention import SDPBackend

    return sdpa_forward(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, scale)


def expanded(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V repeated over its query heads, as LitGPT hands them to SDPA (and to tk before attend_grouped_kv)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def setups(layouts, dtype):
    """label -> (q, k, v, grad_o) for each variant: the step's strides, contiguous, and, where K/V are grouped,
    K/V repeated over the query heads (cuDNN's input in the step, since torch's SDPA backends take Hkv = Hq)."""
    out = {}
    for label, contiguous in (("step strides", False), ("contiguous", True)):
        q, k, v = (strided(lay, dtype, contiguous=contiguous) for lay in layouts[:3])
        grad_o = strided(layouts[-1], dtype, contiguous=contiguous) if len(layouts) > 3 else None
        out[label] = (q, k, v, grad_o)
    q, k, v, grad_o = out["step strides"]
    if k.shape[1] != q.shape[1]:
        out["K/V repeated"] = (q, expanded(k, q.shape[1]), expanded(v, q.shape[1]), grad_o)
    return out


def time_forward(layouts, dtype, causal, scale, rounds):
    timed, kernels = {}, {}
    for label, (q, k, v, _) in setups(layouts, dtype).items():
        timed[f"tk, {label}"] = lambda q=q, k=k, v=v: ops.attention_forward(q, k, v, is_causal=causal, scale=scale)
        kernels[f"tk, {label}"] = kernel_times(timed[f"tk, {label}"])
        if k.shape[1] == q.shape[1]:
            timed[f"cuDNN, {label}"] = cudnn(q, k, v, causal, scale)
    return interleaved_ms(timed, rounds=rounds), kernels


def time_backward(layouts, dtype, causal, scale, rounds):
    timed, kernels = {}, {}
    for label, (q, k, v, grad_o) in setups(layouts, dtype).items():
        o, lse = ops.attention_forward(q, k, v, is_causal=causal, scale=scale)
        if label == "step strides" and o.stride() != layouts[3][1]:
            o = strided(layouts[3], dtype).copy_(o)  # the step's o layout, if tk's own differs from it
        timed[f"tk, {label}"] = (lambda q=q, k=k, v=v, o=o, lse=lse, g=grad_o:
                                 ops.attention_backward(q, k, v, o, lse, g, is_causal=causal, scale=scale))
        kernels[f"tk, {label}"] = kernel_times(timed[f"tk, {label}"])
        if label == "step strides" and k.shape[1] != q.shape[1]:  # the grouped backward unsplit and split in two
            for split in (1, 2):
                name = f"tk, group split {split}"
                timed[name] = (lambda q=q, k=k, v=v, o=o, lse=lse, g=grad_o, split=split:
                               ops.attention_backward(q, k, v, o, lse, g, is_causal=causal, scale=scale,
                                                      _group_split=split))
                kernels[name] = kernel_times(timed[name])
        if k.shape[1] == q.shape[1]:
            inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
            out = cudnn(*inputs, causal, scale)()
            timed[f"cuDNN, {label}"] = (lambda out=out, inputs=inputs, g=grad_o:
                                        torch.autograd.grad(out, inputs, g, retain_graph=True))
    return interleaved_ms(timed, rounds=rounds), kernels


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_arguments(p, n_layer=2, warmup=2)
    p.add_argument("--rounds", type=int, default=3, help="timing rounds per call, variants in rotating order")
    p.add_argument("--json", default="out/step_attention.json")
    a = p.parse_args()
    device = torch.device("cuda")
    built = Built("thunder [tk]", variants(False, device)["thunder [tk]"], a, device)
    sequence = record_attention_calls(built.step)
    in_step = step_kernels(built.step)
    del built
    torch.cuda.empty_cache()

    print(f"attention kernels in one step ({a.n_layer} layers):")
    for name, ms, n in in_step:
        print(f"  {ms:8.3f} ms {n:4d}x  {name}")
    rows = []
    for (kind, layouts, dtype, causal, scale), n in Counter(sequence).items():
        B, H, S, D = layouts[0][0]
        Hkv = layouts[1][0][1]
        timer = time_forward if kind == "fwd" else time_backward
        ms, kernels = timer(layouts, dtype, causal, scale, a.rounds)
        flops = (fwd_flops if kind == "fwd" else bwd_flops)(B, H, S, D, causal)
        row = {"pass": kind, "shape": f"{B}x{H}/{Hkv}x{S}x{D}", "causal": causal, "per_step": n,
               "strides": " ".join(str(lay[1]) for lay in layouts)}
        for name, t in ms.items():
            row[f"{name} ms"] = t
            row[f"{name} TFLOP/s"] = flops / t / 1e9
        peer = ms.get("cuDNN, step strides", ms.get("cuDNN, K/V repeated"))
        row["tk/cuDNN"] = peer / ms["tk, step strides"] if peer else None
        row["kernels"] = {name: [{"kernel": kn, "ms": km, "launches": kc} for kn, km, kc in ks]
                          for name, ks in kernels.items()}
        rows.append(row)
        print(f"{kind} {row['shape']} causal={causal} x{n} per step; strides {row['strides']}")
        for name, t in ms.items():
            print(f"  {name:<22} {t:8.3f} ms  {flops / t / 1e9:6.0f} TFLOP/s")
        for name, ks in kernels.items():
            print(f"  kernels of {name}: " + "; ".join(f"{kn[:60]} {km:.3f} ms x{kc}" for kn, km, kc in ks))
    columns = ["pass", "shape", "causal", "per_step", *dict.fromkeys(k for r in rows for k in r if k.endswith("TFLOP/s")),
               "tk/cuDNN"]
    print_table([{c: r.get(c, "-") for c in columns} for r in rows], columns)
    write_results(a.json, "step_attention", [dict(r, in_step=[{"kernel": kn, "ms": km, "launches": kc}
                                                              for kn, km, kc in in_step]) for r in rows])


if __name__ == "__main__":
    main()
