"""Shared benchmark plumbing: timing with CUDA events, result files and charts."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch


def median_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of `fn()` in ms, by CUDA events (triton's do_bench when available)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return times[len(times) // 2]


def capture(fn):
    """(graph, output): `fn` run once on a side stream (one-time allocations, lazy initialisation), then captured
    into a CUDA graph whose replays rewrite `output`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graphed(fn):
    """The replay of `fn` captured into a CUDA graph: times a short kernel without the host's launch path (Python
    argument checks, the launch call), which in eager timing can exceed the kernel itself."""
    return capture(fn)[0].replay


def profiled_kernels(prof) -> dict[str, tuple[float, int]]:
    """{kernel name: (ms, launches)} summed over a torch.profiler run's GPU time (newer torch names the field
    self_device_time_total, older self_cuda_time_total)."""
    kernels: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            ms, n = kernels.get(e.key, (0.0, 0))
            kernels[e.key] = (ms + us / 1e3, n + e.count)
    return kernels


def in_turns(names: list, rounds: int):
    """The names, `rounds` times over, each round in an order rotated by one (the benchmarks' timing in turns)."""
    for r in range(rounds):
        yield from names[r % len(names):] + names[:r % len(names)]


def interleaved_times(fns: dict, *, rounds: int = 5, warmup_ms: float = 10, rep_ms: float = 50) -> dict:
    """Each function's time (ms) per round, timed in turns, each round in a rotated order.

    A GPU's clock drifts with its temperature and power over a benchmark; timing peers one after the other
    hands whichever runs first the cooler chip. Rounds in rotating order share that drift out evenly.
    """
    times: dict = {name: [] for name in fns}
    for name in in_turns(list(fns), rounds):
        times[name].append(median_ms(fns[name], warmup_ms=warmup_ms, rep_ms=rep_ms))
    return times


def interleaved_ms(fns: dict, *, rounds: int = 5, warmup_ms: float = 10, rep_ms: float = 50) -> dict:
    """Median times (ms) of several functions timed in turns (interleaved_times): the median over rounds drops a
    round that a clock change hit."""
    return {name: statistics.median(ts)
            for name, ts in interleaved_times(fns, rounds=rounds, warmup_ms=warmup_ms, rep_ms=rep_ms).items()}


class ClockSampler:
    """The GPU's SM clock, power and temperature sampled by `nvidia-smi` in the background (every `period_ms`),
    so that a timing can be read beside the clock it ran at: a power-limited chip lowers its clock under sustained
    load, and two kernels of equal cycles then differ in time by what each draws. Without nvidia-smi it samples
    nothing and `between` returns None.

        with ClockSampler() as clocks:
            t0 = clocks.now(); run(); t1 = clocks.now()
        clocks.between(t0, t1)  # {"sm_mhz": ..., "watts": ..., "celsius": ..., "samples": n}
    """

    FIELDS = ("sm_mhz", "watts", "celsius")

    def __init__(self, period_ms: int = 50, gpu: int | None = None):
        self.period_ms, self.gpu = period_ms, gpu
        self.samples: list[tuple[float, tuple[float, ...]]] = []
        self._proc = self._file = None

    @staticmethod
    def now() -> float:
        return time.time()

    def __enter__(self) -> "ClockSampler":
        import shutil
        import tempfile

        if shutil.which("nvidia-smi") is None:
            return self
        gpu = self.gpu if self.gpu is not None else (torch.cuda.current_device() if torch.cuda.is_available() else 0)
        self._file = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        self._proc = subprocess.Popen(
            ["nvidia-smi", "-i", str(gpu), "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"], stdout=self._file, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        self._proc.wait()
        self._file.seek(0)
        import datetime

        for line in self._file.read().splitlines():
            parts = [x.strip() for x in line.split(",")]
            try:  # "2026/11/23 10:00:00.123" in the host's local time, as time.time() is read below
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((stamp, tuple(float(x) for x in parts[1:4])))
            except (ValueError, IndexError):  # a torn last line, or "[N/A]"
                continue
        self._file.close()
        os.unlink(self._file.name)

    def between(self, t0: float, t1: float) -> dict | None:
        inside = [v for t, v in self.samples if t0 <= t <= t1]
        if not inside:
            return None
        means = [statistics.fmean(v[i] for v in inside) for i in range(len(self.FIELDS))]
        return {**dict(zip(self.FIELDS, means)), "samples": len(inside)}


def environment() -> dict:
    commit = os.environ.get("THUNDER_TK_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "commit": commit or "unknown",
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
    }


def write_results(path: str | Path, name: str, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "environment": environment(), "rows": rows}, indent=2))
    return path


def shape_arguments(name: str, shapes: dict, rounds: int = 5, argv=None, extend=None):
    """The command line of a benchmark over named shapes: --json (default out/<name>.json), --png, --shapes (a
    subset of `shapes`' names, all by default) and --rounds; `extend(parser)` adds the benchmark's own."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--json", default=f"out/{name}.json")
    p.add_argument("--png")
    p.add_argument("--shapes", nargs="+", choices=sorted(shapes), default=list(shapes))
    p.add_argument("--rounds", type=int, default=rounds)
    if extend is not None:
        extend(p)
    return p.parse_args(argv)


def report(args, name: str, rows: list[dict], columns: list[str], title: str, series: dict[str, str],
           unit: str = "us") -> None:
    """A per-shape benchmark's ending: the table, the JSON (args.json) and, with args.png, a bar chart of `series`
    (legend -> the rows' key) over the rows' shapes."""
    print_table(rows, columns)
    print(f"wrote {write_results(args.json, name, rows)}")
    if args.png:
        bar_chart(args.png, title, [r["shape"] for r in rows], {label: [r[key] for r in rows]
                                                                for label, key in series.items()}, unit)


def geomean(values) -> float:
    """The geometric mean of positive ratios: how the benchmarks sum up tk against its peer over their points."""
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def print_table(rows: list[dict], columns: list[str]) -> None:
    cells = [[f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for x in cells:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths)))


def bar_chart(path: str | Path, title: str, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.9), 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
