"""tk's peer-memory all-gather and reduce-scatter vs NCCL, between the GPUs of one node, in the same run.

Size = the gathered tensor (all-gather output = reduce-scatter input). Each size and op is first checked against
NCCL, then timed with CUDA events: N back-to-back calls on the current stream (N adaptive, the same on every
rank), 5 repeats, median per call, max over ranks; NCCL and tk alternate per size so both see the same conditions.
busbw = size * (w-1)/w / time (nccl-tests convention); speedup = nccl_time / tk_time, which is also the busbw
ratio tk/NCCL. NVLink multicast is off for both. Prints a table and the goal checks on rank 0, writes JSON and a PNG.

    torchrun --nproc_per_node 2 benchmarks/collectives.py --json out/collectives.json --png out/collectives.png
    torchrun --nproc_per_node 8 benchmarks/collectives.py --quick --blocks 32 16 64   # tk = 32 blocks, sweep 16, 64
"""

from __future__ import annotations

import os

# Multicast must never be used (NCCL's NVLS, torch symmetric memory, NVSHMEM): set before torch.distributed loads.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import geomean, print_table, write_results  # noqa: E402

from thunder_tk import collectives  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-4}  # reduce-scatter: error vs the fp32 sum, relative to |sum| + 1
SIZES_MIB = [0.0625, 0.25, 1, 4, 16, 64, 256, 1024]
QUICK_SIZES_MIB = [0.0625, 1, 64, 256]
OPS = ("all_gather", "reduce_scatter")
REPEATS, TARGET_MS, MIN_CALLS, MAX_CALLS = 5, 20.0, 5, 200


def all_max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def burst_ms(fn, calls: int) -> float:
    """Time of `calls` back-to-back calls, all ranks starting together."""
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_us(fn) -> float:
    """Slowest rank's median per-call time in µs."""
    for _ in range(3):  # warm up: allocator, communicators, kernel loading
        fn()
    # Every rank must issue the same number of collectives, so the call count comes from the slowest estimate.
    estimate = all_max(burst_ms(fn, 3) / 3)
    calls = max(MIN_CALLS, min(MAX_CALLS, math.ceil(TARGET_MS / max(estimate, 1e-3))))
    per_call = statistics.median(burst_ms(fn, calls) / calls for _ in range(REPEATS))
    return all_max(per_call) * 1e3


def bench_op(op: str, per_rank: int, world: int, dtype: str, channels: dict) -> dict:
    torch.manual_seed(1000 + dist.get_rank())  # different data on each rank
    numel_in, numel_out = (per_rank, per_rank * world) if op == "all_gather" else (per_rank * world, per_rank)
    x = torch.randn(numel_in, device="cuda", dtype=DTYPES[dtype])
    out = torch.empty(numel_out, device="cuda", dtype=DTYPES[dtype])
    tk_out = torch.empty_like(out)  # both write into preallocated outputs: the collective alone is timed
    if op == "all_gather":
        nccl = lambda: dist.all_gather_into_tensor(out, x)  # noqa: E731
        tk = {name: (lambda ch=ch: ch.all_gather(x, out=tk_out)) for name, ch in channels.items()}
    else:
        nccl = lambda: dist.reduce_scatter_tensor(out, x)  # noqa: E731
        tk = {name: (lambda ch=ch: ch.reduce_scatter(x, "sum", out=tk_out)) for name, ch in channels.items()}

    nccl()
    exact = None
    if op == "reduce_scatter":
        # The sum in fp32 (NCCL's own bf16/fp16 reduce-scatter rounds every partial sum, so with more than two
        # ranks it strays further from the true sum than tk, which accumulates in fp32): tk must be as close.
        full = x.float()
        dist.all_reduce(full)
        exact = full[dist.get_rank() * per_rank:(dist.get_rank() + 1) * per_rank]
        nccl_err = ((out.float() - exact).abs() / (exact.abs() + 1)).max().item()
    matches = {}
    for name, fn in tk.items():  # every channel must agree with NCCL on every rank
        got = fn()
        if op == "all_gather":
            same = torch.equal(got, out)
        else:
            tk_err = ((got.float() - exact).abs() / (exact.abs() + 1)).max().item()
            same = tk_err <= max(nccl_err, TOLERANCE[dtype])
        flag = torch.tensor([int(same)], device="cuda")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        matches[name] = bool(flag.item())

    nbytes = per_rank * world * x.element_size()
    # "match": every channel agrees; "<name>_match" says which one does not.
    row = {"op": op, "size_mib": nbytes / 2**20, "bytes": nbytes, "world": world, "dtype": dtype,
           "match": all(matches.values()), **{f"{name}_match": m for name, m in matches.items()},
           "tk_blocks": channels["tk"].config.blocks, "tk_buffer_mib": channels["tk"].config.buffer_bytes >> 20}
    for name, fn in [("nccl", nccl), *tk.items()]:  # NCCL then tk, back to back
        t = time_us(fn)
        row[f"{name}_us"] = t
        row[f"{name}_GBps"] = nbytes * (world - 1) / world / t / 1e3  # bytes per µs / 1e3 = GB/s
    row["speedup"] = row["nccl_us"] / row["tk_us"]
    row["busbw_ratio"] = row["tk_GBps"] / row["nccl_GBps"]
    return row


class TorchLowContention:
    """torch's own copy-engine collectives (symmetric-memory workspace, pulls/pushes by cudaMemcpyAsync), shaped
    like a tk channel for bench_op. They allocate their output, so `out` is ignored."""

    def __init__(self, group):
        import torch.distributed._symmetric_memory as symm_mem

        with warnings.catch_warnings():  # needed before torch 2.10, deprecated since
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        self.group_name = group.group_name
        self.config = None

    @classmethod
    def probe(cls, group, device) -> "TorchLowContention | None":
        """One, if both ops run on every rank (all ranks agree, so none is left waiting in a collective)."""
        try:
            lc = cls(group)
            x = torch.ones(4096 * group.size(), device=device)
            ok = bool(lc.all_gather(x[:4096]).sum().item() == x.numel()) and bool(
                lc.reduce_scatter(x).sum().item() == 4096 * group.size())
        except Exception as e:  # noqa: BLE001 - any failure means "not available"
            print(f"rank {dist.get_rank()}: torch low-contention probe failed: {type(e).__name__}: {e}", flush=True)
            lc, ok = None, False
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return lc if flag.item() else None

    # They run on a stream of their own and register their work: wait_tensor puts the caller's stream after it.
    def all_gather(self, x, out=None):
        return torch.ops._c10d_functional.wait_tensor(
            torch.ops.symm_mem._low_contention_all_gather(x, self.group_name))

    def reduce_scatter(self, x, op="sum", out=None):
        return torch.ops._c10d_functional.wait_tensor(
            torch.ops.symm_mem._low_contention_reduce_scatter(x, op, self.group_name))


def summarize(rows: list[dict]) -> None:
    large = [r for r in rows if r["size_mib"] >= 64]
    small = [r for r in rows if r["size_mib"] <= 1]
    for op in OPS:
        bw = [r["busbw_ratio"] for r in large if r["op"] == op]
        lat = [r["speedup"] for r in small if r["op"] == op]
        print(f"{op}: busbw tk/NCCL at >= 64 MiB geomean " + (f"{geomean(bw):.2f}x" if bw else "n/a")
              + "; latency speedup at <= 1 MiB geomean " + (f"{geomean(lat):.2f}x" if lat else "n/a"))
    # The issues' goals: 1.3x on two GPUs (issue 5), 1.2x on four or eight (issue 7).
    bw_goal = 1.3 if rows and rows[0]["world"] == 2 else 1.2
    for label, values, goal in [(f"busbw >= {bw_goal:g}x NCCL at >= 64 MiB", [r["busbw_ratio"] for r in large], bw_goal),
                                ("latency >= 2x lower at <= 1 MiB", [r["speedup"] for r in small], 2.0)]:
        verdict = f"{'PASS' if min(values) >= goal else 'FAIL'} (min {min(values):.2f})" if values else "n/a (no sizes)"
        print(f"goal: {label}: {verdict}")
    if not all(r["match"] for r in rows):
        print("!!! WARNING: some channels' results differ from NCCL (the match column names them); their timings "
              "there are meaningless")


def plot(path: str, rows: list[dict], names: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, op in zip(axes, OPS):
        sel = [r for r in rows if r["op"] == op]
        for name in ["nccl", *names]:
            ax.plot([r["size_mib"] for r in sel], [r[f"{name}_GBps"] for r in sel], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size, gathered tensor (MiB)")
        ax.set_title(op)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("busbw (GB/s)")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default="out/collectives.json")
    p.add_argument("--png")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=SIZES_MIB, help="gathered sizes in MiB")
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES_MIB} MiB only")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--blocks", type=int, nargs="+",
                   help="tk block counts: the first is reported as tk, the others as tk_b{B} (default: env channel)")
    p.add_argument("--buffer-mib", type=int, default=64, help="staging buffer of the --blocks channels")
    p.add_argument("--configs", nargs="+", default=[], metavar="B:S:MIB[:W[:KIB[:P[:U]]]]",
                   help="more tk channels timed beside tk: B blocks, S slots, MIB staging buffer, W sending warps of "
                        "16 for both ops (0: the channel's), KIB smallest unit per block (0: the default), P 1 for "
                        "blocks paired with one peer each, U units each block aims at (0: the default), e.g. "
                        "128:4:128 128:2:64:0:4 128:4:64:0:0:1:8")
    p.add_argument("--engines", nargs="+", default=[], choices=["copy", "auto"],
                   help="more tk channels timed beside tk, moving data on the copy engines (tk_copy) or on them "
                        "from THUNDER_TK_COLLECTIVE_CE_MIN_MB up (tk_auto); other settings from the environment")
    p.add_argument("--torch-low-contention", action="store_true",
                   help="also time torch's copy-engine collectives (torch.ops.symm_mem._low_contention_*)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    a = p.parse_args()

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("run under torchrun with at least 2 processes, e.g. torchrun --nproc_per_node 2 ...")

    group = dist.group.WORLD
    if a.blocks:  # collective: every rank makes the same channels in the same order
        channels = {("tk" if i == 0 else f"tk_b{b}"): collectives.Channel(group, device, collectives.ChannelConfig(
            blocks=b, buffer_bytes=a.buffer_mib << 20, timeout_s=60)) for i, b in enumerate(dict.fromkeys(a.blocks))}
    else:
        channels = {"tk": collectives.channel(group, device)}
    for spec in a.configs:
        b, slots, mib, warps, kib, pairs, units = ([int(v) for v in spec.split(":")] + [0, 0, 0, 0])[:7]
        cfg = collectives.ChannelConfig(blocks=b, buffer_bytes=mib << 20, timeout_s=60, slots=slots,
                                        **({"ag_sender_warps": warps, "rs_sender_warps": warps} if warps else {}),
                                        **({"min_chunk_bytes": kib << 10} if kib else {}), pairs=bool(pairs),
                                        **({"units_per_block": units} if units else {}))
        name = (f"tk_b{b}s{slots}m{mib}" + (f"w{warps}" if warps else "") + (f"k{kib}" if kib else "")
                + ("p" if pairs else "") + (f"u{units}" if units else ""))
        channels[name] = collectives.Channel(group, device, cfg)
    for engine in a.engines:
        channels[f"tk_{engine}"] = collectives.Channel(
            group, device, dataclasses.replace(collectives.ChannelConfig.from_env(), engine=engine))
    if a.torch_low_contention:
        lc = TorchLowContention.probe(group, device)
        if lc is not None:
            channels["torch_lc"] = lc
        elif rank == 0:
            print("torch's low-contention collectives are unavailable here; not timed", flush=True)
    names = list(channels)
    if rank == 0:
        cfg = channels["tk"].config
        print(f"{world} ranks, {a.dtype}; tk = {cfg.blocks} blocks, {cfg.buffer_bytes >> 20} MiB buffer"
              + (f"; sweep: {', '.join(names[1:])}" if len(names) > 1 else ""), flush=True)

    esize = torch.empty(0, dtype=DTYPES[a.dtype]).element_size()
    rows = []
    for size_mib in QUICK_SIZES_MIB if a.quick else a.sizes_mib:
        per_rank = max(1, int(size_mib * 2**20) // esize // world)
        for op in a.ops:
            row = bench_op(op, per_rank, world, a.dtype, channels)
            rows.append(row)
            torch.cuda.empty_cache()  # the 1 GiB sizes need their memory back
            if rank == 0:
                print(f"{op:>14} {row['size_mib']:9.4g} MiB: nccl {row['nccl_us']:9.1f} us  tk {row['tk_us']:9.1f} us"
                      f"  speedup {row['speedup']:.2f}", flush=True)
                for name in names:
                    if not row[f"{name}_match"]:
                        print(f"!!! WARNING: {name} {op} at {row['size_mib']:g} MiB does NOT match NCCL", flush=True)

    if rank == 0:
        us_cols = [f"{n}_us" for n in ["nccl", *names]]
        bw_cols = [f"{n}_GBps" for n in ["nccl", *names]]
        table = [{"op": r["op"], "MiB": f"{r['size_mib']:g}", **{c: f"{r[c]:.1f}" for c in us_cols + bw_cols},
                  "speedup": f"{r['speedup']:.2f}",
                  "match": "yes" if r["match"] else "NO: " + " ".join(n for n in names if not r[f"{n}_match"])}
                 for r in rows]
        print_table(table, ["op", "MiB", *us_cols, *bw_cols, "speedup", "match"])
        summarize(rows)
        print(f"wrote {write_results(a.json, 'collectives', rows)}")
        if a.png:
            plot(a.png, rows, names, f"{a.dtype} busbw, {world}x {torch.cuda.get_device_name(device)}")
            print(f"wrote {a.png}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
