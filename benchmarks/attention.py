"""tk attention vs torch SDPA (cuDNN and FlashAttention backends), bf16, forward and backward, in one run.

Shapes follow the FlashAttention-3 protocol: 16k tokens in all (batch = 16384 // S), hidden 2048 (D = 128: 16
heads, D = 64: 32 heads, D = 256: 8 heads), S in 512 ... 16384, causal and not. FLOPs: forward 4 * B*H*S*S*D,
halved when causal; backward 2.5 x the forward. At each point the forward peers (and then the backward peers) are
timed in turns, in rotating order, each getting the median over the rounds. The tk backward is timed once
ops.attention_backward exists, fed o and lse from ops.attention_forward. Ratios are speed ratios: tk/cuDNN > 1
means tk is faster.

With --window W [W ...] it times causal sliding-window attention instead (query i keeps keys i - W < j <= i), at each
S > W: tk with window=W; its peer, torch SDPA given the window as an (S, S) boolean keep-mask broadcast over batch
and heads, under the cuDNN and the memory-efficient backend in turn (the ones that take a mask; one that refuses is
noted with torch's reason); and tk plain causal at the same S, for what the window saves. FLOPs of a windowed point
count the kept scores only: 4 * B*H*D * sum_i min(i + 1, W), backward 2.5 x; rows go under "window_points".

    python benchmarks/attention.py --json out/attention.json --png out/attention.png
    python benchmarks/attention.py --quick --no-backward
    python benchmarks/attention.py --window 512 4096 --head-dims 128 --json out/attention_window.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bar_chart, environment, geomean, interleaved_ms, print_table, write_results  # noqa: E402

TOKENS = 16384
HIDDEN = 2048
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQ_LENS = (1024, 4096)
PEERS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}  # name -> torch.nn.attention.SDPBackend member
LABELS = {"tk": "tk", "cudnn": "cuDNN", "flash": "flash"}
FWD_TOL = 2e-2  # ||o_tk - o_sdpa|| / ||o_sdpa||, both bf16 kernels accumulating in fp32
BWD_TOL = 5e-2  # gradients: bf16 dS and two rounded products more; a warning only
SUMMARY_MIN_S, SUMMARY_D = 2048, 128
# Windowed points: the SDPA backends that take a boolean mask, each tried alone (name -> SDPBackend member).
WINDOW_PEERS = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
WINDOW_LABELS = {"tk": "tk", "tk_causal": "tk causal", "cudnn": "cuDNN mask", "efficient": "mem-eff mask"}


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


def summary(rows) -> str:
    """The headline: tk/cuDNN forward over the long sequences at D = 128, causal and not."""
    ratios = [r["fwd_vs_cudnn"] for r in rows
              if r["S"] >= SUMMARY_MIN_S and r["D"] == SUMMARY_D and r.get("fwd_vs_cudnn") is not None]
    if not ratios:
        return f"tk/cuDNN forward, S >= {SUMMARY_MIN_S}, D = {SUMMARY_D}: no points (none run, or cuDNN skipped)"
    return (f"tk/cuDNN forward, S >= {SUMMARY_MIN_S}, D = {SUMMARY_D}, causal and not ({len(ratios)} points): "
            f"geometric mean {geomean(ratios):.3f}, minimum {min(ratios):.3f}")


GOAL_RATIO = 1.05  # issue 4: tk >= 1.05 x cuDNN, forward and backward, at every S >= 2048, D = 128, causal and not


def goal_verdict(rows) -> str:
    """Issue 4's goal read off the rows: met, not met (naming every point below it), or incomplete where a point of
    the goal's set (S >= SUMMARY_MIN_S at D = SUMMARY_D, both masks, forward and backward) has no ratio."""
    points = [r for r in rows if r["S"] >= SUMMARY_MIN_S and r["D"] == SUMMARY_D]
    name = f"goal: tk >= {GOAL_RATIO} x cuDNN forward and backward, every S >= {SUMMARY_MIN_S}, D = {SUMMARY_D}"
    missing = [f"S {r['S']} {'causal' if r['causal'] else 'full'} {p}" for r in points for p in ("fwd", "bwd")
               if r.get(f"{p}_vs_cudnn") is None]
    if not points or missing:
        return f"{name}: incomplete ({', '.join(missing) or 'no points'} not measured)"
    below = [f"{p} S {r['S']} {'causal' if r['causal'] else 'full'} {r[f'{p}_vs_cudnn']:.3f}x" for r in points
             for p in ("fwd", "bwd") if r[f"{p}_vs_cudnn"] < GOAL_RATIO]
    return f"{name} ({2 * len(points)} values): " + ("met" if not below else f"not met: {', '.join(below)}")


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:200]


def sdpa_forward(backend, q, k, v, causal, scale=None, attn_mask=None):
    """A callable running SDPA forward restricted to one backend; the backend is chosen inside the call, so
    callables of different backends can be timed in turns."""
    from torch.nn.attention import sdpa_kernel

    def fn():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                                                    scale=scale)

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


# Causal sliding window (--window): tk's window beside SDPA given the same window as a boolean mask.

class WindowCheckFailed(Exception):
    """tk's windowed output disagrees with its peer's or with the float64 math: the point is not timed."""


def window_pairs(S: int, W: int) -> int:
    """Kept (query, key) pairs of a causal window of W keys over S queries: sum over i of min(i + 1, W)."""
    if W >= S:
        return S * (S + 1) // 2
    return W * (W + 1) // 2 + (S - W) * W


def window_fwd_flops(B: int, H: int, S: int, D: int, W: int) -> float:
    return 4.0 * B * H * D * window_pairs(S, W)


def window_bwd_flops(B: int, H: int, S: int, D: int, W: int) -> float:
    return 2.5 * window_fwd_flops(B, H, S, D, W)


def window_points(seq_lens, head_dims, windows):
    """(B, H, S, D, W) of the protocol for each window shorter than S; at S <= W the window keeps every causal key,
    which the plain causal points already time."""
    for D in head_dims:
        H = HIDDEN // D
        for S in seq_lens:
            for W in windows:
                if W < S:
                    yield max(1, TOKENS // S), H, S, D, W


def window_keep_mask(S: int, W: int, device=None, rows=None) -> torch.Tensor:
    """(len(rows), S) bool, True where query i keeps key j (i - W < j <= i): SDPA's boolean attn_mask convention.
    rows: the query rows (default all S)."""
    keys = torch.arange(S, device=device)
    queries = keys if rows is None else torch.as_tensor(rows, device=device)
    offset = queries[:, None] - keys[None, :]
    return (offset >= 0) & (offset < W)


def window_check_rows(S: int, W: int) -> list[int]:
    """Query rows checked against the float64 math: the window's edges (where it starts sliding) and the end."""
    return sorted({r for r in (0, 1, W - 2, W - 1, W, W + 1, S // 2, S - 2, S - 1) if 0 <= r < S})


def window_reference_rows(q, k, v, W: int, rows) -> torch.Tensor:
    """float64 attention output of query rows `rows` of the first batch and head under the causal window, at SDPA's
    default scale: cheap enough to check every point, and independent of any backend."""
    q0, k0, v0 = (t[0, 0].double() for t in (q, k, v))
    rows = torch.as_tensor(rows, device=q.device)
    scores = (q0[rows] @ k0.T) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~window_keep_mask(k.shape[2], W, q.device, rows), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v0


def refusal(e: BaseException, caught) -> str:
    """Why a backend refused: the error's first line and the warnings torch gave with it (under sdpa_kernel the
    error says only 'No available kernel'; the reasons come as warnings)."""
    reasons = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    return "; ".join([first_line(e), *dict.fromkeys(reasons)])[:600]


def window_point(B, H, S, D, W) -> dict:
    """The keys every window_points row of this point carries."""
    return {"shape": f"{B}x{H}x{S}x{D}", "S": S, "D": D, "B": B, "H": H, "W": W, "kept_pairs": window_pairs(S, W),
            "peer_backends": {name: [member] for name, member in WINDOW_PEERS.items()}}


def window_timings(point: dict, pass_name: str, ms: dict, flops: float, causal_flops: float) -> dict:
    """One window_points row: each timed kernel's ms and TFLOP/s (the windowed ones by the window's kept pairs, tk
    causal by the causal ones), tk's speed ratio to each peer and to the fastest, and what the window saves tk."""
    row = {**point, "pass": pass_name}
    for name in WINDOW_LABELS:
        row[f"{name}_ms"] = ms.get(name)
        count = causal_flops if name == "tk_causal" else flops
        row[f"{name}_tflops"] = count / ms[name] / 1e9 if name in ms else None
    for name in WINDOW_PEERS:
        row[f"tk_vs_{name}"] = ms[name] / ms["tk"] if name in ms and "tk" in ms else None
    ran = [name for name in WINDOW_PEERS if name in ms]
    row["best_peer"] = min(ran, key=ms.get) if ran else None
    row["tk_vs_best_peer"] = ms[row["best_peer"]] / ms["tk"] if ran and "tk" in ms else None
    row["window_speedup"] = ms["tk_causal"] / ms["tk"] if "tk_causal" in ms and "tk" in ms else None
    return row


def run_window_point(ops, B, H, S, D, W, a) -> list[dict]:
    """The forward row (and the backward's unless --no-backward) of one windowed point; raises WindowCheckFailed
    before timing anything if tk's output is off."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    point = window_point(B, H, S, D, W)
    where = f"{point['shape']} window {W}"
    notes, errs, skipped = [], {}, {}
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    keep = window_keep_mask(S, W, "cuda")  # (S, S), broadcast over batch and heads

    # Forward: tk against the float64 math on a few rows (holds even where no peer runs), then against each peer.
    o, lse = ops.attention_forward(q, k, v, is_causal=True, window=W)
    rows = window_check_rows(S, W)
    errs["float64_rows"] = rel_err(o[0, 0, rows], window_reference_rows(q, k, v, W, rows))
    if errs["float64_rows"] > FWD_TOL:
        raise WindowCheckFailed(f"tk forward at {where}: rel err {errs['float64_rows']:.2e} against the float64 "
                                f"math on rows {rows} (tolerance {FWD_TOL})")
    fwd = {"tk": lambda: ops.attention_forward(q, k, v, is_causal=True, window=W),
           "tk_causal": lambda: ops.attention_forward(q, k, v, is_causal=True)}
    for name, member in WINDOW_PEERS.items():
        fn = sdpa_forward(getattr(SDPBackend, member), q, k, v, False, attn_mask=keep)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = fn()
                torch.cuda.synchronize()
            except RuntimeError as e:
                skipped[f"{name}_fwd"] = refusal(e, caught)
                notes.append(f"{WINDOW_LABELS[name]} fwd skipped ({skipped[f'{name}_fwd']})")
                continue
        errs[name] = rel_err(o, out)
        del out
        if errs[name] > FWD_TOL:
            raise WindowCheckFailed(f"tk forward at {where}: rel err {errs[name]:.2e} against SDPA {member} with "
                                    f"the window's mask (tolerance {FWD_TOL}); tk agrees with the float64 math on "
                                    f"rows {rows} to {errs['float64_rows']:.2e}, so suspect the peer too")
        fwd[name] = fn
    point = {**point, "fwd_err": errs, "skipped": skipped}
    ms = interleaved_ms(fwd, rounds=a.rounds)
    out_rows = [window_timings(point, "fwd", ms, window_fwd_flops(B, H, S, D, W), window_fwd_flops(B, H, S, D, S))]

    # Backward: SDPA's through autograd on a graph kept alive; tk's from o and lse of its forward, windowed and not.
    if not a.no_backward:
        grad_out = torch.randn_like(q)
        bwd, ref_grads = {}, None
        for name, member in WINDOW_PEERS.items():
            if name not in fwd:
                continue  # refused the forward: no graph to run backward through
            inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel(getattr(SDPBackend, member)):
                        out = torch.nn.functional.scaled_dot_product_attention(*inputs, attn_mask=keep)
                    grads = torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    skipped[f"{name}_bwd"] = refusal(e, caught)
                    notes.append(f"{WINDOW_LABELS[name]} bwd skipped ({skipped[f'{name}_bwd']})")
                    continue
            bwd[name] = lambda out=out, inputs=inputs: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
            if ref_grads is None:
                ref_grads, ref_name = grads, name
        if hasattr(ops, "attention_backward"):
            grads = ops.attention_backward(q, k, v, o, lse, grad_out, is_causal=True, window=W)
            if ref_grads is not None:
                grad_errs = [rel_err(g, r) for g, r in zip(grads, ref_grads)]
                point["bwd_err"] = {ref_name: max(grad_errs)}
                if max(grad_errs) > BWD_TOL:  # a warning only, as for the plain points
                    print(f"WARNING: tk backward at {where}: rel err dq/dk/dv against {WINDOW_LABELS[ref_name]} "
                          + " ".join(f"{e:.2e}" for e in grad_errs), flush=True)
            del grads
            o_causal, lse_causal = ops.attention_forward(q, k, v, is_causal=True)
            bwd["tk"] = lambda: ops.attention_backward(q, k, v, o, lse, grad_out, is_causal=True, window=W)
            bwd["tk_causal"] = lambda: ops.attention_backward(q, k, v, o_causal, lse_causal, grad_out, is_causal=True)
        else:
            notes.append("tk bwd not timed (no ops.attention_backward)")
        del ref_grads
        bms = interleaved_ms(bwd, rounds=a.rounds) if bwd else {}
        out_rows.append(window_timings(point, "bwd", bms, window_bwd_flops(B, H, S, D, W),
                                       window_bwd_flops(B, H, S, D, S)))
    for row in out_rows:
        row["notes"] = "; ".join(notes)
    return out_rows


def run_windows(ops, seq_lens, head_dims, windows, a, env) -> None:
    """--window: the windowed points, their table, the JSON ("rows" empty, "window_points") and the chart."""
    print("causal sliding window, bf16: TFLOP/s count the kept scores only, 4*B*H*D*sum_i min(i+1, W) (backward "
          "2.5x; tk causal by its own kept pairs); ratios tk/peer are speed ratios (> 1: tk faster); SDPA peers get "
          "an (S, S) boolean keep-mask", flush=True)
    covered = [(S, W) for S in seq_lens for W in windows if W >= S]
    if covered:
        print("not run (S <= W keeps every causal key: plain causal): "
              + ", ".join(f"S {S} W {W}" for S, W in covered), flush=True)
    rows = []
    for B, H, S, D, W in window_points(seq_lens, head_dims, windows):
        try:
            point_rows = run_window_point(ops, B, H, S, D, W, a)
        except WindowCheckFailed as e:
            print(f"ABORTED {e}", flush=True)
            rows.append({**window_point(B, H, S, D, W), "pass": "fwd", "aborted": str(e)})
            torch.cuda.empty_cache()
            continue
        rows += point_rows
        for row in point_rows:
            line = f"{row['shape']:>16} W {W:>5} {row['pass']}: " + ", ".join(
                f"{WINDOW_LABELS[name]} {fmt(row[f'{name}_ms'])} ms {fmt(row[f'{name}_tflops'])} TFLOP/s"
                for name in WINDOW_LABELS if row[f"{name}_ms"] is not None)
            if row["window_speedup"] is not None:
                line += f" | window saves {row['window_speedup']:.2f}x"
            print(line + (f"  [{row['notes']}]" if row["notes"] else ""), flush=True)
        torch.cuda.empty_cache()

    timed = [r for r in rows if "aborted" not in r]
    columns = ["shape", "W", "pass", "tk_ms", "tk_tflops", "cudnn_tflops", "efficient_tflops", "tk_vs_cudnn",
               "tk_vs_efficient", "tk_causal_ms", "window_speedup"]
    if timed:
        print_table([{c: fmt(r.get(c)) for c in columns} for r in timed], columns)
    for pass_name in ("fwd", "bwd"):
        for key in (*(f"tk_vs_{name}" for name in WINDOW_PEERS), "window_speedup"):
            ratios = [r[key] for r in timed if r["pass"] == pass_name and r.get(key) is not None]
            if ratios:
                print(f"window {pass_name} {key.replace('_vs_', '/')}: geometric mean {geomean(ratios):.3f} over "
                      f"{len(ratios)} points; lowest {min(ratios):.3f}, highest {max(ratios):.3f}")
    aborted = [r for r in rows if "aborted" in r]
    if aborted:
        print(f"{len(aborted)} windowed point(s) aborted by the correctness check; see 'aborted' in the JSON")
    # The shared writer has only "rows"; the windowed rows go beside them under their own key.
    path = write_results(a.json, "attention", [])
    results = json.loads(path.read_text())
    results["window_points"] = rows
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    if a.png and timed:
        png = Path(a.png).with_name(Path(a.png).stem + "_window.png")
        labels = [f"S{r['S']} D{r['D']} W{r['W']} {r['pass']}" for r in timed]
        series = {WINDOW_LABELS[n]: [r.get(f"{n}_ms") or 0.0 for r in timed] for n in WINDOW_LABELS}
        series = {n: vals for n, vals in series.items() if any(vals)}
        # Milliseconds, not TFLOP/s: the tk causal bar then shows what the window saves.
        bar_chart(png, f"bf16 causal sliding-window attention, 16k tokens, hidden 2048, {env['device']} "
                       "(ms, lower is better)", labels, series, "ms")
        print(f"wrote {png}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


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
    p.add_argument("--window", dest="windows", type=positive_int, nargs="+", metavar="W",
                   help="time causal sliding windows of W keys instead (at each S > W; tk, SDPA with the window's "
                        "mask, tk plain causal); --mask and --static-too do not apply; the chart is <png>_window.png")
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
    if a.windows:
        run_windows(ops, seq_lens, head_dims, a.windows, a, env)
        return

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
    if not a.no_backward:
        print(goal_verdict(rows))
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
