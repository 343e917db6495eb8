"""Where a training step's GPU time goes, stream by stream: `THUNDER_TK_PROFILE_STEPS=<first>[:<count>]` makes
`thunder-tk pretrain` run those logged steps (1-based, as metrics.jsonl numbers them) under torch's profiler and
write out_dir/profile[.rank<r>].json on every rank:

- per step: the host's wall time (the GPU idle before and after), the GPU's window (first kernel start to last
  kernel end) and, per stream, kernels, busy time (their union) and time by kernel kind;
- the main stream (the one with the most kernel time: the compute stream) idle inside the window, split into the
  time another stream was busy (the compute waiting on a collective, say) and the time every stream was idle (the
  GPU waiting on the host), and its gaps by length with the longest ones' neighbours (`idle_gaps`);
- the largest kernels.

Rank 0 also writes the profiler's Chrome trace (profile_trace.json.gz, for chrome://tracing or Perfetto).
The profiled steps run tk's kernels in plain stream order (`launch_order_for_profiling`; the profile records it):
with programmatic dependent launch a kernel starts while the one before it finishes and waits inside itself, so
the profiler would count that wait as the kernel's own time and the stream's idle gaps as busy.
`THUNDER_TK_PROFILE_LAUNCH_ORDER=dependent` profiles the steps as they run otherwise.
With FSDP the collectives run on streams of their own, so the summed kernel time says little: what the step waits
for is the main stream's idle time, and what another stream was doing meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

import torch

from thunder_tk.litgpt_models import ConfigError

ENV = "THUNDER_TK_PROFILE_STEPS"
LAUNCH_ORDER_ENV = "THUNDER_TK_PROFILE_LAUNCH_ORDER"
LAUNCH_ORDERS = ("plain", "dependent")

# Kernels by what they compute, whoever's they are (names as CUDA reports them; tk's kernels live in namespaces
# tk::gemm, tk::attention, tk::loss, tk::p2p...). The first pattern that matches wins.
KERNEL_KINDS = (
    ("loss", re.compile(r"tk::loss|nll_loss|log_softmax|cross_entropy|xentropy", re.I)),
    ("attention", re.compile(r"tk::attention|flash|fmha|attention|cudnn|sdpa|efficient", re.I)),  # cuDNN's say sm90
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|sm90_|splitK", re.I)),
    ("collective", re.compile(r"tk::p2p|tk::coll|nccl", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("fused (triton)", re.compile(r"triton", re.I)),
    ("copy/fill", re.compile(r"copy|fill|memset|memcpy|cat|index", re.I)),
)
TK_KERNEL = re.compile(r"\btk::")


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


_CAST_ENUM = re.compile(r"\((?:\w+::)*(\w+)\)(-?\d+)")  # (tk::wgmma::major)1 -> major=1
_QUALIFIER = re.compile(r"\b(?:\w+::)+")
_SHORT_TYPES = (("__nv_bfloat16", "bf16"), ("__half", "fp16"))


def kernel_label(name: str) -> str:
    """A kernel's demangled name short enough to read whole in a table: its qualified name (tk::gemm::gemm_kernel)
    without the return type, anonymous namespaces or argument list, and its template arguments without namespaces,
    enums as name=value, bf16 and fp16 for CUDA's type names. Every template argument is kept: tk's GEMM kernels that
    differ only in their last ones (the store warps, the output's dtype) must not look alike. Names that are not
    C++ templates (Triton's, cuBLAS's) come back as they are."""
    label = name.replace("(anonymous namespace)::", "")
    if "<" not in label:
        return label
    if label.endswith(")"):  # the argument list, after the template's closing ">"
        depth = 0
        for i in range(len(label) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(label[i], 0)
            if depth == 0:
                label = label[:i] if label[:i].endswith(">") else label
                break
    head, _, arguments = label.partition("<")
    if head.startswith("void "):
        head = head[len("void "):]
    arguments = _QUALIFIER.sub("", _CAST_ENUM.sub(r"\1=\2", arguments))
    for long, short in _SHORT_TYPES:
        arguments = arguments.replace(long, short)
    return f"{head}<{arguments}"


def parse_steps(raw: str | None) -> tuple[int, int] | None:
    """"45" -> (45, 1), "45:3" -> (45, 3); unset or empty -> None. The first step traces and compiles (minutes of
    host work, no steady GPU work), so profiling starts at step 2 at the earliest."""
    if not raw or not raw.strip():
        return None
    first, _, count = raw.strip().partition(":")
    try:
        first_i, count_i = int(first), int(count) if count else 1
    except ValueError:
        first_i = count_i = 0
    if first_i < 2 or count_i < 1:
        raise ConfigError(f"{ENV}={raw!r}: expected <first step>[:<count>] with first >= 2 (step 1 traces and "
                          f"compiles) and count >= 1, e.g. 30:3")
    return first_i, count_i


def profiling_launch_order(environ=os.environ) -> str:
    """The launch order asked for profiled steps: LAUNCH_ORDER_ENV's value, "plain" where it is unset."""
    order = environ.get(LAUNCH_ORDER_ENV, "").strip() or "plain"
    if order not in LAUNCH_ORDERS:
        raise ConfigError(f"{LAUNCH_ORDER_ENV}={order!r}: expected one of {', '.join(LAUNCH_ORDERS)}")
    return order


@contextlib.contextmanager
def launch_order_for_profiling(order: str = "plain"):
    """Runs the block in `order` and yields the order tk's kernels launched in: "plain" turns tk's programmatic
    dependent launch off for the block (a dependently launched kernel starts under the one before it and waits
    inside itself, so a profile would count that wait as its time, and the stream's gaps as busy); "dependent"
    leaves the process's setting as it is (and yields that setting); "none" where tk's kernels are not loaded."""
    if order not in LAUNCH_ORDERS:
        raise ValueError(f"launch order must be one of {', '.join(LAUNCH_ORDERS)}; got {order!r}")
    from thunder_tk import _extension, ops

    ext = _extension.extension()
    if ext is None:
        yield "none"
    elif order == "plain":
        with ops.dependent_launches(False):
            yield "plain"
    else:
        yield "dependent" if ext.dependent_launch() else "plain"


def union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching [start, end) intervals merged, sorted."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in intervals)


def overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Total length covered by both of two merged, sorted interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(kernels: list[dict], steps: int, wall_s: float, top: int = 25) -> dict:
    """The summary above from GPU activities: dicts with name, stream, start and end (ns). Times are ms per step."""
    per = 1e-6 / steps  # ns over the window -> ms per step
    out: dict = {"steps": steps, "wall_ms": wall_s * 1e3 / steps, "gpu_activities": len(kernels)}
    if not kernels:
        return out
    window = (min(k["start"] for k in kernels), max(k["end"] for k in kernels))
    streams: dict[int, dict] = {}
    for k in kernels:
        s = streams.setdefault(k["stream"], {"intervals": [], "kinds": {}, "kernel_ns": 0, "tk_ns": 0, "count": 0})
        ns = k["end"] - k["start"]
        s["intervals"].append((k["start"], k["end"]))
        kind = kernel_kind(k["name"])
        s["kinds"][kind] = s["kinds"].get(kind, 0) + ns
        s["kernel_ns"] += ns
        s["tk_ns"] += ns if TK_KERNEL.search(k["name"]) else 0
        s["count"] += 1
    for s in streams.values():
        s["intervals"] = union(s["intervals"])
    main = max(streams, key=lambda sid: streams[sid]["kernel_ns"])
    others = union([iv for sid, s in streams.items() if sid != main for iv in s["intervals"]])
    main_busy = length(streams[main]["intervals"])
    main_idle = (window[1] - window[0]) - main_busy
    # Of the main stream's idle time, what another stream covered (overlap of "others" with the complement of main).
    others_while_main_idle = length(others) - overlap(others, streams[main]["intervals"])
    out.update({
        "window_ms": (window[1] - window[0]) * per,
        "main_stream": main,
        "main_busy_ms": main_busy * per,
        "main_idle_ms": main_idle * per,
        "main_idle_other_stream_busy_ms": others_while_main_idle * per,
        "main_idle_all_idle_ms": (main_idle - others_while_main_idle) * per,
        "streams": [{"stream": sid, "main": sid == main, "kernels": s["count"] / steps,
                     "kernel_ms": s["kernel_ns"] * per, "busy_ms": length(s["intervals"]) * per,
                     "tk_ms": s["tk_ns"] * per,
                     "kinds_ms": {kind: ns * per for kind, ns in sorted(s["kinds"].items(), key=lambda kv: -kv[1])}}
                    for sid, s in sorted(streams.items(), key=lambda kv: -kv[1]["kernel_ns"])],
    })
    out["main_gaps"] = idle_gaps(kernels, main)
    by_name: dict[tuple[str, int], list[int]] = {}
    for k in kernels:
        entry = by_name.setdefault((k["name"], k["stream"]), [0, 0])
        entry[0] += k["end"] - k["start"]
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    out["top"] = [{"kernel": kernel_label(name)[:200], "stream": sid, "kind": kernel_kind(name), "ms": ns * per,
                   "calls": n / steps} for (name, sid), (ns, n) in ranked]
    return out


# Idle stretches of a stream by length (µs): launch gaps between queued kernels are a few µs; longer ones are the
# GPU waiting on the host (or another stream).
GAP_BUCKETS_US = (2, 5, 20, 100)


def idle_gaps(kernels: list[dict], stream: int | None = None, top: int = 8) -> dict:
    """Where one stream (the one with the most kernel time where None) sat idle between its first and last
    activity: the gaps' count and total by length (GAP_BUCKETS_US) and the `top` longest, each with the activities
    on either side. `kernels` as for `summarize` (name, stream, start and end in ns)."""
    if stream is None and kernels:
        busy: dict[int, int] = {}
        for k in kernels:
            busy[k["stream"]] = busy.get(k["stream"], 0) + k["end"] - k["start"]
        stream = max(busy, key=busy.get)
    mine = sorted((k for k in kernels if k["stream"] == stream), key=lambda k: k["start"])
    labels = [f"< {GAP_BUCKETS_US[0]} us", *(f"{a}-{b} us" for a, b in zip(GAP_BUCKETS_US, GAP_BUCKETS_US[1:])),
              f">= {GAP_BUCKETS_US[-1]} us"]
    buckets = {label: {"count": 0, "ms": 0.0} for label in labels}
    gaps, end, before = [], None, None
    for k in mine:
        if end is not None and k["start"] > end:
            ns = k["start"] - end
            label = labels[sum(ns >= b * 1000 for b in GAP_BUCKETS_US)]
            buckets[label]["count"] += 1
            buckets[label]["ms"] += ns / 1e6
            gaps.append((ns, before, k["name"]))
        if end is None or k["end"] > end:
            end, before = k["end"], k["name"]
    gaps.sort(key=lambda g: -g[0])
    return {"stream": stream, "idle_ms": sum(b["ms"] for b in buckets.values()), "buckets": buckets,
            "longest": [{"us": ns / 1e3, "after": a[:100], "before": b[:100]} for ns, a, b in gaps[:top]]}


def gpu_activities(prof) -> list[dict]:
    """The GPU's kernels, copies and fills from a finished torch.profiler run (kineto's raw events: for a GPU
    activity, device_resource_id is its stream)."""
    from torch.autograd import DeviceType

    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    return [{"name": e.name(), "stream": int(e.device_resource_id()), "start": int(e.start_ns()),
             "end": int(e.start_ns()) + int(e.duration_ns())}
            for e in events if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0]


class StepProfiler:
    """The profiler around the steps ENV names; does nothing where it is unset."""

    def __init__(self, out_dir: Path, rank: int, device: torch.device, environ=os.environ):
        self.window = parse_steps(environ.get(ENV))
        self.launch_order = profiling_launch_order(environ) if self.window is not None else "plain"
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self.prof, self.done = None, 0
        self.scope, self.launched_in = None, None  # the window's launch order and profiler, while it is open
        self.started = self.t0 = 0.0  # the window's start: before its first synchronisation, after it
        # Wall time from the window's first synchronisation to the profile written: the run's pace leaves it out.
        self.spent_s = 0.0

    @property
    def active(self) -> bool:
        return self.prof is not None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, step: int) -> None:
        """Call before running logged step `step` (1-based)."""
        if self.window is None or self.prof is not None or step != self.window[0]:
            return
        from torch.profiler import ProfilerActivity, profile

        # The GPU's activities only: recording every host op would slow the host, and the idle time would show it.
        activities = [ProfilerActivity.CUDA] if self.device.type == "cuda" else [ProfilerActivity.CPU]
        self.started = time.perf_counter()
        self._sync()  # the window holds these steps' GPU work only
        self.scope = contextlib.ExitStack()
        self.launched_in = self.scope.enter_context(launch_order_for_profiling(self.launch_order))
        self.prof = self.scope.enter_context(profile(activities=activities))
        self.t0 = time.perf_counter()

    def after(self, step: int) -> None:
        """Call once logged step `step`'s work is issued; the window's last step stops and writes the profile."""
        if self.prof is None:
            return
        self.done += 1
        if step >= self.window[0] + self.window[1] - 1:
            self.finish()

    def finish(self) -> None:
        """Stops the profiler (the run may end inside the window) and writes what it saw."""
        if self.prof is None:
            return
        self._sync()
        wall = time.perf_counter() - self.t0
        prof, self.prof = self.prof, None
        self.scope.close()  # the profiler stopped, then the launch order restored
        summary = summarize(gpu_activities(prof), max(self.done, 1), wall)
        summary["launch_order"] = self.launched_in
        summary["first_step"] = self.window[0]
        summary["rank"] = self.rank
        name = "profile.json" if self.rank == 0 else f"profile.rank{self.rank}.json"
        (self.out_dir / name).write_text(json.dumps(summary, indent=1) + "\n")
        if self.rank == 0:
            try:  # a diagnostic: never at the cost of the run
                prof.export_chrome_trace(str(self.out_dir / "profile_trace.json.gz"))
            except Exception as e:  # noqa: BLE001
                (self.out_dir / "profile_trace.error.txt").write_text(f"{type(e).__name__}: {e}\n")
        self.spent_s = time.perf_counter() - self.started
