"""What one call of a fusion region costs the host: each region of a jitted LitGPT step (forward and backward), called
with the inputs it got in that step, as tk's fuser calls it (`direct_regions`: inductor's code with no dynamo in
between) and as Thunder's torch.compile executor does (torch.compile of the same function, under the same grad and
autocast wrappers), timed in turns.

The model is small (batch 1, a few tokens, narrow layers) so that a region's kernels take less than its host call:
what is timed is the host's part. On CPU the region's own C++ work is included in both figures (CPU runs use a fuser
that takes CPU tensors; tk's own fuses CUDA tensors only).

    python benchmarks/region_calls.py [--device cuda] [--n-layer 1] [--calls 300] [--rounds 5] [--json out/region_calls.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_results  # noqa: E402


def regions_of_a_step(device: torch.device, n_layer: int) -> list[tuple]:
    """(function, inputs) of each distinct region a tk-jitted LitGPT step calls, with the inputs of its first call."""
    import thunder
    from litgpt import GPT, Config

    import thunder_tk
    from thunder_tk import direct_regions

    seen = []
    call = direct_regions.DirectRegion._call

    def recording(self, args):
        if not getattr(self, "_recorded", False):
            self._recorded = True
            seen.append((self._fn, args))
        return call(self, args)

    executors = [thunder_tk.tk]
    if device.type == "cpu":  # tk's own fuser takes CUDA tensors only
        from thunder.executors.torchex import ex as torch_ex
        from thunder.extend import ImplInfo

        from thunder_tk.fusion import SharingTorchCompileExecutor

        fuser = SharingTorchCompileExecutor(name="region_calls_cpu")
        fuser._implmap = {op: ImplInfo() for op in torch_ex.implmap
                          if not any(w in str(op).lower() for w in ("linear", "matmul"))}
        executors.append(fuser)
    cfg = Config.from_name("Llama-3.2-1B", n_layer=n_layer, n_embd=128, n_head=4, n_query_groups=2,
                           intermediate_size=256, padded_vocab_size=512, block_size=64)
    with device:
        model = GPT(cfg).to(torch.bfloat16)
        model.max_seq_length = 16
        idx = torch.randint(0, 512, (1, 16))
    direct_regions.DirectRegion._call = recording
    try:
        jitted = thunder.jit(model, executors=executors)
        jitted(idx).float().square().mean().backward()
    finally:
        direct_regions.DirectRegion._call = call
    return seen


def host_us(fn, args, calls: int, device: torch.device) -> float:
    for _ in range(10):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n-layer", type=int, default=1)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="out/region_calls.json")
    a = p.parse_args(argv)
    from thunder_tk.direct_regions import DirectRegion
    from thunder_tk.thunder_fixes import no_autocast

    device = torch.device(a.device)
    rows = []
    for i, (fn, args) in enumerate(regions_of_a_step(device, a.n_layer)):
        direct = DirectRegion(fn)
        compiled = torch.no_grad()(no_autocast(torch.compile(fn, fullgraph=True)))  # as make_compiled wraps it
        times = {"direct": [], "torch.compile": []}
        for _ in range(a.rounds):  # in turns: the host's pace drifts
            times["direct"].append(host_us(direct, args, a.calls, device))
            times["torch.compile"].append(host_us(compiled, args, a.calls, device))
        d, c = (statistics.median(times[k]) for k in ("direct", "torch.compile"))
        rows.append({"region": i, "inputs": len(args), "direct_us": d, "torch_compile_us": c, "saved_us": c - d,
                     "ratio": c / d})
        print(rows[-1], flush=True)
    print(f"{a.device}: {len(rows)} regions of a {a.n_layer}-layer LitGPT step, host us a call (median of "
          f"{a.rounds} rounds of {a.calls} calls)")
    print_table(rows, ["region", "inputs", "direct_us", "torch_compile_us", "saved_us", "ratio"])
    if rows:
        saved = [r["saved_us"] for r in rows]
        print(f"saved a call: median {statistics.median(saved):.1f} us, range {min(saved):.1f}-{max(saved):.1f}")
    write_results(a.json, "region_calls", [{**r, "device": a.device, "n_layer": a.n_layer} for r in rows])


if __name__ == "__main__":
    main()
