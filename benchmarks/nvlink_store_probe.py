"""What SM loads and stores give over NVLink: the ceiling tk's SM collectives run against (the copy engines' is
benchmarks/copy_engine_probe.py).

Run under torchrun, one process per GPU of the host. Every rank holds a buffer of torch's symmetric memory with one
region per sending rank. A kernel on the rank's own GPU negates float32 data on the way (so a stale region shows):
- "interleaved": one Triton kernel whose consecutive blocks take the peers in turn, so every link carries data all
  the time (as tk's SM collectives do);
- "per-peer kernels": torch's elementwise kernel once per peer, each on a stream of its own (a large grid fills the
  GPU, so the peers are served mostly one after another).
Patterns: solo push (rank 0 alone stores its source into its region at every peer; the others wait), all-to-all
push (every rank at once: an all-gather's traffic), all-to-all pull (every rank loads every peer's source).
GB/s = bytes leaving (push) or arriving at (pull) one GPU / time: the busbw of an all-gather of that traffic. A
rank times its own kernels from its start event to its last end; the slowest rank sets the row. The regions are
checked afterwards (each must hold its sender's source, negated).

    torchrun --nproc_per_node 4 benchmarks/nvlink_store_probe.py --mib 16 64 256 --json out/nvlink_store_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

try:  # torch's CUDA wheels bring Triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def neg_copy(src, dst, offs, mask):
        tl.store(dst + offs, -tl.load(src + offs, mask=mask), mask=mask)

    @triton.jit
    def move(srcs, dsts, n, PEERS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        peer = pid % PEERS
        offs = (pid // PEERS).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        for q in tl.static_range(PEERS):  # a block takes its peer's (source, destination) pair
            if peer == q:
                neg_copy(srcs[q], dsts[q], offs, mask)


def launch_interleaved(pairs, n: int) -> None:
    """Block b moves block b // peers of the data from pairs[b % peers][1] to pairs[b % peers][0]."""
    if triton is None:
        raise SystemExit("nvlink_store_probe: needs Triton")
    block = 4096
    move[(len(pairs) * triton.cdiv(n, block),)](tuple(inp for _, inp in pairs), tuple(out for out, _ in pairs), n,
                                                 PEERS=len(pairs), BLOCK=block, num_warps=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, nargs="+", default=[64, 256], help="bytes each rank moves per peer, MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    a = p.parse_args()

    import torch.distributed._symmetric_memory as symm_mem

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    peers = [r for r in range(world) if r != rank]
    streams = [torch.cuda.Stream(device) for _ in peers]
    rows = []
    for mib in a.mib:
        n = (mib << 20) // 4  # float32 elements per peer
        buffer = symm_mem.empty(world * n, dtype=torch.float32, device=device)
        handle = symm_mem.rendezvous(buffer, dist.group.WORLD)
        src = torch.randn(n, device=device)
        # region(r, s): rank r's region for sender s, as this process maps it (one view of each rank's buffer).
        mapped = [handle.get_buffer(r, (world * n,), torch.float32) for r in range(world)]
        region = {(r, s): mapped[r][s * n:(s + 1) * n] for r in range(world) for s in range(world)}

        def timed(label: str, active: bool, moves, per_gpu_bytes: int, kernel: str) -> None:
            times = []
            for _ in range(a.repeats + 1):
                torch.cuda.synchronize(device)
                dist.barrier()
                start, ends = torch.cuda.Event(enable_timing=True), []
                start.record()
                if active and kernel == "interleaved":
                    launch_interleaved(moves, n)
                    e = torch.cuda.Event(enable_timing=True)
                    e.record()
                    ends.append(e)
                elif active:
                    for st, (out, inp) in zip(streams, moves):
                        st.wait_event(start)
                        with torch.cuda.stream(st):
                            torch.neg(inp, out=out)
                        e = torch.cuda.Event(enable_timing=True)
                        e.record(st)
                        ends.append(e)
                torch.cuda.synchronize(device)
                times.append(max((start.elapsed_time(e) for e in ends), default=0.0))
            ms = torch.tensor([statistics.median(times[1:])], device=device)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            label = f"{label}, {kernel}"
            row = {"pattern": label, "kernel": kernel, "mib_per_peer": mib, "ms": float(ms),
                   "GBps": per_gpu_bytes / float(ms) / 1e6}
            rows.append(row)
            if rank == 0:
                print(f"{label:>40} {mib:5d} MiB a peer: {row['ms']:8.3f} ms  {row['GBps']:7.1f} GB/s", flush=True)

        def check(label: str, senders) -> None:
            """Each sender's source, negated, must be in this rank's region for it."""
            torch.cuda.synchronize(device)
            dist.barrier()
            ok = all(torch.equal(region[(rank, s)], -src_of[s]) for s in senders if s != rank)
            bad = torch.tensor([0 if ok else 1], device=device)
            dist.all_reduce(bad)
            if int(bad):
                raise SystemExit(f"nvlink_store_probe: {label}: a region does not hold its sender's data")

        # Every rank's source is also published in symmetric memory (its own region for itself) so that pulls and
        # the check can read it from any rank.
        region[(rank, rank)].copy_(src)
        torch.cuda.synchronize(device)
        dist.barrier()
        src_of = {s: region[(s, s)] for s in range(world)}
        nbytes = n * 4
        pulled = [torch.empty(n, device=device) for _ in peers]
        for kernel in ("interleaved", "per-peer kernels"):
            pushes = [(region[(q, rank)], src) for q in peers]
            timed("solo push (rank 0)", rank == 0, pushes, nbytes * len(peers), kernel)
            check(f"solo push, {kernel}", [0])
            timed("all-to-all push", True, pushes, nbytes * len(peers), kernel)
            check(f"all-to-all push, {kernel}", range(world))
            for out in pulled:
                out.fill_(float("nan"))
            timed("all-to-all pull", True, [(out, src_of[q]) for out, q in zip(pulled, peers)], nbytes * len(peers),
                  kernel)
            if not all(torch.equal(out, -src_of[q]) for out, q in zip(pulled, peers)):
                raise SystemExit(f"nvlink_store_probe: all-to-all pull, {kernel}: a pulled copy does not match")
            for s_ in peers:  # the next kind's pushes must write the regions again to pass the checks
                region[(rank, s_)].fill_(float("nan"))
        torch.cuda.synchronize(device)
        dist.barrier()  # no rank frees its buffer while a peer may still read it
    if rank == 0 and a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(device), "gpus": world,
                                            "torch": torch.__version__, "rows": rows}, indent=1))
        print(f"wrote {a.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
