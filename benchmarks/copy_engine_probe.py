"""What the copy engines give over NVLink: cudaMemcpyAsync bandwidth between the GPUs of this host, one process.

Patterns (each GPU's part issued on its own streams, all at once, timed from one start to the last copy's end):
- push 1: GPU 0 writes one buffer into GPU 1;
- push fan-out: GPU 0 writes into every peer at once (one stream per peer);
- pull fan-in: GPU 0 reads from every peer at once (its streams, peer sources);
- all-to-all push / pull: every GPU to (from) every peer at once (an all-gather's traffic);
- the fan-out again with each copy split over K streams;
- a local copy on GPU 0.
GB/s = bytes leaving one GPU (pushes) or arriving (pulls) / time, the busbw of an all-gather of that traffic.

    python3 benchmarks/copy_engine_probe.py --mib 64 256 --splits 1 2 4 --json out/copy_engine_probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
from pathlib import Path

import torch

MEMCPY_DEFAULT = 4


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (the same primary contexts)."""
    import nvidia  # torch's CUDA wheels

    roots = [os.path.dirname(p) for p in nvidia.__path__]
    for pattern in ("nvidia/cu*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*"):
        for root in roots:
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                return ctypes.CDLL(hits[0])
    return ctypes.CDLL("libcudart.so")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, nargs="+", default=[64, 256], help="bytes per copy, MiB")
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4], help="streams per peer for the fan-out")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    a = p.parse_args()

    rt = cudart()
    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    n = torch.cuda.device_count()
    devs = list(range(n))
    for i in devs:
        with torch.cuda.device(i):
            for j in devs:
                if i != j:
                    rt.cudaDeviceEnablePeerAccess(ctypes.c_int(j), ctypes.c_uint(0))  # 704: already enabled
    rows = []
    for mib in a.mib:
        nbytes = mib << 20
        src = {i: torch.empty(nbytes, dtype=torch.uint8, device=i).fill_(i) for i in devs}
        dst = {(i, j): torch.empty(nbytes, dtype=torch.uint8, device=j) for i in devs for j in devs}
        streams = {i: [torch.cuda.Stream(i) for _ in range(max(a.splits) * max(1, n - 1))] for i in devs}

        def run(plan, label, per_gpu_bytes):
            """plan: list of (issuing device, stream index, dst ptr, src ptr, bytes)."""
            times = []
            for _ in range(a.repeats + 1):
                for i in devs:
                    torch.cuda.synchronize(i)
                start = {i: torch.cuda.Event(enable_timing=True) for i in devs}
                for i in devs:
                    start[i].record(torch.cuda.current_stream(i))
                used = set()
                for dev, si, d, s, b in plan:
                    st = streams[dev][si]
                    if (dev, si) not in used:
                        st.wait_event(start[dev])
                        used.add((dev, si))
                    rc = rt.cudaMemcpyAsync(ctypes.c_void_p(d), ctypes.c_void_p(s), b, MEMCPY_DEFAULT,
                                            ctypes.c_void_p(st.cuda_stream))
                    assert rc == 0, f"cudaMemcpyAsync failed: {rc}"
                ends = []
                for dev, si in used:
                    e = torch.cuda.Event(enable_timing=True)
                    e.record(streams[dev][si])
                    ends.append((dev, e))
                for i in devs:
                    torch.cuda.synchronize(i)
                # Devices' clocks differ: time each device from its own start to its own last end.
                t = max(start[dev].elapsed_time(e) for dev, e in ends)
                times.append(t)
            ms = statistics.median(times[1:])
            row = {"pattern": label, "mib": mib, "ms": ms, "GBps": per_gpu_bytes / ms / 1e6}
            rows.append(row)
            print(f"{label:>34} {mib:5d} MiB: {ms:8.3f} ms  {row['GBps']:7.1f} GB/s", flush=True)

        ptr = lambda t: t.data_ptr()  # noqa: E731
        run([(0, 0, ptr(dst[(0, 1)]), ptr(src[0]), nbytes)], "push 1 (0->1)", nbytes)
        run([(1, 0, ptr(dst[(0, 1)]), ptr(src[0]), nbytes)], "pull 1 (1<-0, GPU 1's stream)", nbytes)
        peers = [j for j in devs if j != 0]
        for k in a.splits:
            part = nbytes // k
            run([(0, q * k + h, ptr(dst[(0, j)]) + h * part, ptr(src[0]) + h * part, part)
                 for q, j in enumerate(peers) for h in range(k)], f"push fan-out, {k} stream(s)/peer",
                nbytes * len(peers))
        run([(0, q, ptr(dst[(j, 0)]), ptr(src[j]), nbytes) for q, j in enumerate(peers)], "pull fan-in",
            nbytes * len(peers))
        for k in a.splits:
            part = nbytes // k
            run([(i, q * k + h, ptr(dst[(i, j)]) + h * part, ptr(src[i]) + h * part, part)
                 for i in devs for q, j in enumerate([j for j in devs if j != i]) for h in range(k)],
                f"all-to-all push, {k} stream(s)/peer", nbytes * (n - 1))
            run([(j, q * k + h, ptr(dst[(i, j)]) + h * part, ptr(src[i]) + h * part, part)
                 for j in devs for q, i in enumerate([i for i in devs if i != j]) for h in range(k)],
                f"all-to-all pull, {k} stream(s)/peer", nbytes * (n - 1))
        run([(0, 0, ptr(dst[(0, 0)]), ptr(src[0]), nbytes)], "local copy on GPU 0 (read+write)", 2 * nbytes)
        del src, dst
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "gpus": n, "rows": rows},
                                           indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
