"""A decoding step's GEMMs, back to back: one transformer layer's linears (Llama-2-7B or Llama-3-8B weights) at a
few tokens, on tk and on cuBLAS (`torch.nn.functional.linear`), each library's sequence captured in one CUDA graph
and replayed many times in a row, as a decoding loop runs them.

A layer's weights (400-500 MB) are far larger than the L2, so every replay streams them from memory, and no cache
flush sits between the products (do_bench's flush, in `gemm.py`, leaves the L2 full of dirty lines that the next
product must evict). Prints µs per layer, the weights' effective bandwidth and tk/cuBLAS; writes JSON.

    python benchmarks/gemm_decode_layer.py --json out/gemm_decode_layer.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import capture, print_table, write_results  # noqa: E402

# (name, out_features, in_features) of one layer's linears: fused qkv, attention output, fused gate/up, down
LAYERS = {
    "llama-2-7b": [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)],
    "llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}


def layer_graph(linear, weights, inputs):
    """(graph, outputs): one CUDA graph running `linear` over every (input, weight) pair in order."""
    return capture(lambda: [linear(x, w) for x, w in zip(inputs, weights)])


def replay_us(graph, replays: int) -> float:
    """Mean µs per replay over `replays` replays in a row."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="out/gemm_decode_layer.json")
    p.add_argument("--models", nargs="+", choices=sorted(LAYERS), default=sorted(LAYERS))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5, help="rounds of both libraries, in alternating order; median")
    a = p.parse_args()
    from thunder_tk import ops

    rows = []
    for model in a.models:
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _, n, k in LAYERS[model]]
        weight_bytes = sum(w.numel() * 2 for w in weights)
        for t in a.tokens:
            inputs = [torch.randn(t, k, device="cuda", dtype=torch.bfloat16) for _, _, k in LAYERS[model]]
            graphs = {"tk": layer_graph(ops.linear, weights, inputs),
                      "cuBLAS": layer_graph(torch.nn.functional.linear, weights, inputs)}
            for graph, _ in graphs.values():
                graph.replay()
            torch.cuda.synchronize()
            for o, r in zip(graphs["tk"][1], graphs["cuBLAS"][1]):
                err = ((o.float() - r.float()).norm() / r.float().norm()).item()
                assert err < 1e-2, f"{model} {t} tokens: rel err {err}"
            times = {name: [] for name in graphs}
            for r in range(a.rounds):
                for name in (list(graphs) if r % 2 == 0 else list(graphs)[::-1]):
                    times[name].append(replay_us(graphs[name][0], a.replays))
            us = {name: statistics.median(v) for name, v in times.items()}
            row = {"model": model, "tokens": t, "tk_us": us["tk"], "cublas_us": us["cuBLAS"],
                   "tk_tbs": weight_bytes / us["tk"] / 1e6, "cublas_tbs": weight_bytes / us["cuBLAS"] / 1e6,
                   "ratio": us["cuBLAS"] / us["tk"]}
            rows.append(row)
            print(f"{model} {t:>3} tokens: tk {us['tk']:7.1f} us  cuBLAS {us['cuBLAS']:7.1f} us  "
                  f"tk/cuBLAS {row['ratio']:.3f}", flush=True)
            del graphs, inputs
        del weights
        torch.cuda.empty_cache()
    print_table(rows, ["model", "tokens", "tk_us", "cublas_us", "tk_tbs", "cublas_tbs", "ratio"])
    print(f"wrote {write_results(a.json, 'gemm_decode_layer', rows)}")


if __name__ == "__main__":
    main()
