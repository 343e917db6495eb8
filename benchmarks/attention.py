"""tk attention vs torch SDPA (cuDNN and FlashAttention backends), bf16, forward and backward, in one run.

Shapes follow the FlashAttention-3 protocol: 16k tokens in all (batch = 16384 // S), hidden 2048 (D = 128: 16
heads, D = 64: 32 heads, D = 256: 8 heads), S in 512 ... 16384, causal and not. FLOPs: forward 4 * B*H*S*S*D,
halved when causal; backward 2.5 x the forward. At each point the forward peers (and then the backward peers) are
timed in turns, in rotating order, each getting the median over the rounds. The tk backward is timed once
ops.attention_backward exists, fed o and lse from ops.attention_forward. Ratios are speed ratios: tk/cuDNN > 1
means tk is faster.

    python benchmarks/attention.py --json out/attention.json --png out/attention.png
    python benchmarks/attention.py --quick --no-backward
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bar_chart, environment, interleaved_ms, print_table, write_results  # noqa: E402

TOKENS = 16384
HIDDEN = 2048
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQ_LENS = (1024, 4096)
PEERS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}  # name -> torch.nn.attention.SDPBackend member
LABELS = {"tk": "tk", "cudnn": "cuDNN", "flash": "flash"}
FWD_TOL = 2e-2  # ||o_tk - o_sdpa|| / ||o_sdpa||, both bf16 kernels accumulating in fp32
BWD_TOL = 5e-2  # gradients: bf16 dS and two rounded products more; a warning only
SUMMARY_MIN_S, SUMMARY_D = 2048, 128


def fwd_flops(B: int, H: int, S: int, D: int, causal: bool) -> float:
    flops = 4.0 * B * H * S * S * D
    return flops / 2 if causal else flops


def bwd_flops(B: int, H: int, S: int, D: int, causal: bool) -> float:
    return 2.5 * fwd_flops(B, H, S, D, causal)


def points(seq_lens, head_dims, masks=(False, True)):
    """(B, H, S, D, causal) of the protocol: 16k tokens, hidden 2048."""
    for D in head_dims:
        H = HIDDEN // D
        for S in seq_lens:
            for causal in masks:
                yield max(1, TOKENS // S), H, S, D, causal


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(rows) -> str:
    """The headline: tk/cuDNN forward over the long sequences at D = 128, causal and not."""
    ratios = [r["fwd_vs_cudnn"] for r in rows
              if r["S"] >= SUMMARY_MIN_S and r["D"] == SUMMARY_D and r.get("fwd_vs_cudnn") is not None]
    if not ratios:
        return f"tk/cuDNN forward, S >= {SUMMARY_MIN_S}, D = {SUMMARY_D}: no points (none run, or cuDNN skipped)"
    return (f"tk/cuDNN forward, S >= {SUMMARY_MIN_S}, D = {SUMMARY_D}, causal and not ({len(ratios)} points): "
            f"geometric mean {geomean(ratios):.3f}, minimum {min(ratios):.3f}")


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def sdpa_forward(backend, q, k, v, causal, scale=None):
    """A callable running SDPA forward restricted to one backend; the backend is chosen inside the call, so
    callables of different backends can be timed in turns."""
    from torch.nn.attention import sdpa_kernel

    def fn():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    return fn


def sdpa_peers(backends: dict, q, k, v, causal: bool, notes: list[str], labels: dict | None = None):
    """({name: forward callable} of the SDPA backends that run these inputs, the first one's output and name);
    a backend that refuses them is noted with its error's first line."""
    fns, ref, ref_name = {}, None, None
    for name, backend in backends.items():
        fn = sdpa_forward(backend, q, k, v, causal)
        try:
            out = fn()
            torch.cuda.synchronize()
        except RuntimeError as e:
            notes.append(f"{(labels or {}).get(name, name)} fwd skipped ({first_line(e)})")
            continue
        fns[name] = fn
        if ref is None:
            ref, ref_name = out, name
    return fns, ref, ref_name


def run_point(ops, B, H, S, D, causal, a):
    from torch.nn.attention import SDPBackend

    backends = {name: getattr(SDPBackend, member) for name, member in PEERS.items()}
    shape = f"{B}x{H}x{S}x{D}"
    row = {"shape": shape, "S": S, "D": D, "B": B, "H": H, "causal": causal}
    notes = []
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    # Forward: check tk against the first SDPA backend that runs, then time all in turns.
    o, lse = ops.attention_forward(q, k, v, is_causal=causal)
    fwd = {"tk": lambda: ops.attention_forward(q, k, v, is_causal=causal)}
    if a.static_too:  # the forward's static tile schedule (what CUDA-graph capture gets), timed in the same turns
        fwd["tk_static"] = lambda: ops.attention_forward(q, k, v, is_causal=causal, _schedule="static")
    peers, ref, checked_against = sdpa_peers(backends, q, k, v, causal, notes, LABELS)
    fwd.update(peers)
    if ref is not None:
        row["checked_against"] = checked_against
        row["fwd_err"] = rel_err(o, ref)
        assert row["fwd_err"] < FWD_TOL, f"tk forward wrong at {shape} causal={causal}: rel err {row['fwd_err']}"
    del ref
    ms = interleaved_ms(fwd, rounds=a.rounds)
    flops = fwd_flops(B, H, S, D, causal)
    for name in ("tk", *PEERS):
        row[f"{name}_fwd_ms"] = ms.get(name)
        row[f"{name}_fwd_tflops"] = flops / ms[name] / 1e9 if name in ms else None
    for name in PEERS:
        row[f"fwd_vs_{name}"] = ms[name] / ms["tk"] if name in ms else None
    if "tk_static" in ms:
        row["tk_static_fwd_tflops"] = flops / ms["tk_static"] / 1e9
        print(f"  {shape} causal={causal}: fwd tk dynamic {row['tk_fwd_tflops']:.0f}, static "
              f"{row['tk_static_fwd_tflops']:.0f} TFLOP/s", flush=True)

    # Backward: SDPA's through autograd on a graph kept alive; tk's from o and lse of its forward.
    if not a.no_backward:
        from torch.nn.attention import sdpa_kernel

        grad_out = torch.randn_like(q)
        bwd, ref_grads = {}, None
        for name, backend in backends.items():
            inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
            try:
                with sdpa_kernel(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=causal)
                grads = torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
                torch.cuda.synchronize()
            except RuntimeError as e:
                notes.append(f"{LABELS[name]} bwd skipped ({first_line(e)})")
                continue
            bwd[name] = lambda out=out, inputs=inputs: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
            if ref_grads is None:
                ref_grads = grads
        if hasattr(ops, "attention_backward"):
            grads = ops.attention_backward(q, k, v, o, lse, grad_out, is_causal=causal)
            if ref_grads is not None:
                errs = [rel_err(g, r) for g, r in zip(grads, ref_grads)]
                row["bwd_err"] = max(errs)
                if row["bwd_err"] > BWD_TOL:
                    print(f"WARNING: tk backward at {shape} causal={causal}: rel err dq/dk/dv "
                          + " ".join(f"{e:.2e}" for e in errs), flush=True)
            del grads
            bwd["tk"] = lambda: ops.attention_backward(q, k, v, o, lse, grad_out, is_causal=causal)
        del ref_grads
        bms = interleaved_ms(bwd, rounds=a.rounds) if bwd else {}
        flops = bwd_flops(B, H, S, D, causal)
        for name in ("tk", *PEERS):
            row[f"{name}_bwd_ms"] = bms.get(name)
            row[f"{name}_bwd_tflops"] = flops / bms[name] / 1e9 if name in bms else None
        for name in PEERS:
            row[f"bwd_vs_{name}"] = bms[name] / bms["tk"] if name in bms and "tk" in bms else None
    row["notes"] = "; ".join(notes)
    return row


def fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="out/attention.json")
    p.add_argument("--png", help="bar chart of forward TFLOP/s (and <name>_bwd.png for the backward)")
    p.add_argument("--quick", action="store_true", help="fewer points: S 1024 and 4096, D 128")
    p.add_argument("--head-dims", type=int, nargs="+", choices=(64, 128, 256), help="head dims (default 128 64)")
    p.add_argument("--seq-lens", type=int, nargs="+", help=f"sequence lengths (default {' '.join(map(str, SEQ_LENS))})")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--mask", choices=("both", "causal", "full"), default="both", help="causal points, full ones or both")
    p.add_argument("--static-too", action="store_true", help="also time the forward's static tile schedule")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds per point, peers in rotating order")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")

    from thunder_tk import ops

    if not hasattr(ops, "attention_forward"):
        sys.exit("thunder_tk.ops has no attention_forward")
    head_dims = a.head_dims or ([128] if a.quick else [128, 64])
    seq_lens = a.seq_lens or (QUICK_SEQ_LENS if a.quick else SEQ_LENS)
    env = environment()
    print(f"{env['device']}, torch {env['torch']}, commit {env['commit']}; tk backward: "
          f"{'timed' if hasattr(ops, 'attention_backward') and not a.no_backward else 'not timed'}", flush=True)

    rows = []
    masks = {"both": (False, True), "causal": (True,), "full": (False,)}[a.mask]
    for B, H, S, D, causal in points(seq_lens, head_dims, masks):
        row = run_point(ops, B, H, S, D, causal, a)
        rows.append(row)
        line = (f"{row['shape']:>16} {'causal' if causal else 'full':>6}: fwd tk {fmt(row['tk_fwd_tflops'])} "
                f"cuDNN {fmt(row['cudnn_fwd_tflops'])} flash {fmt(row['flash_fwd_tflops'])} TFLOP/s")
        if not a.no_backward:
            line += (f" | bwd tk {fmt(row['tk_bwd_tflops'])} cuDNN {fmt(row['cudnn_bwd_tflops'])} "
                     f"flash {fmt(row['flash_bwd_tflops'])}")
        print(line + (f"  [{row['notes']}]" if row["notes"] else ""), flush=True)
        torch.cuda.empty_cache()

    columns = ["shape", "causal", "tk_fwd_tflops", "cudnn_fwd_tflops", "flash_fwd_tflops", "fwd_vs_cudnn",
               "fwd_vs_flash"]
    if not a.no_backward:
        columns += ["tk_bwd_tflops", "cudnn_bwd_tflops", "flash_bwd_tflops", "bwd_vs_cudnn", "bwd_vs_flash"]
    print_table([{c: fmt(r.get(c)) for c in columns} for r in rows], columns)
    for key in ("fwd_vs_cudnn", "fwd_vs_flash", "bwd_vs_cudnn", "bwd_vs_flash"):
        ratios = [r[key] for r in rows if r.get(key) is not None]
        if ratios:
            print(f"{key.replace('_vs_', ' tk/')}: geometric mean {geomean(ratios):.3f} over {len(ratios)} points; "
                  f"lowest {min(ratios):.3f}, highest {max(ratios):.3f}")
    print(summary(rows))
    path = write_results(a.json, "attention", rows)
    print(f"wrote {path}")
    if a.png:
        labels = [f"S{r['S']} D{r['D']}{' causal' if r['causal'] else ''}" for r in rows]
        for kind, png in (("fwd", Path(a.png)), ("bwd", Path(a.png).with_name(Path(a.png).stem + "_bwd.png"))):
            series = {LABELS[n]: [r.get(f"{n}_{kind}_tflops") or 0.0 for r in rows] for n in ("tk", *PEERS)}
            series = {n: vals for n, vals in series.items() if any(vals)}
            if series:
                bar_chart(png, f"bf16 attention {kind}, 16k tokens, hidden 2048, {env['device']} (TFLOP/s)", labels,
                          series, "TFLOP/s")
                print(f"wrote {png}")


if __name__ == "__main__":
    main()
