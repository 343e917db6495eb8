"""End-to-end LitGPT training step: tokens/s and peak memory for eager PyTorch, torch.compile, Thunder's default
executors and Thunder with executors=[tk], in one run.

Model: LitGPT's Llama-3.2-1B config (fewer layers with --n-layer, stated in the output), bf16 weights
(--precision bf16-mixed: fp32 weights, the forward under bf16 autocast, as `thunder-tk pretrain` runs it), fused
AdamW, cross-entropy of the bf16 logits averaged in fp32 (pretrain.LossModule), sequence 2048. Each variant: warm-up
steps, then timed steps. With --rounds R > 1 the variants stay built and are timed R times in turns, each round in a
rotated order, and each gets the median: the GPU's clock drifts over a run, and one pass per variant had them 2-3%
apart from run to run. The "... tk AdamW" variants update with thunder_tk.optim.AdamW (tk's multi-tensor kernel)
instead of torch's fused AdamW, same learning rate; each row names its optimizer ("optimizer"). --max-norm N clips
the gradients by their global norm before each update, as LitGPT's pretrain does (`train.max_norm`, 1.0 there):
`thunder-tk pretrain`'s clip (foreach fp32 norms, an in-place multiply; torch.nn.utils.clip_grad_norm_ for FSDP2's
DTensors) before torch's AdamW, tk AdamW's clip_grad_norm_ (the norm by tk's kernel, the scaling inside the update)
before tk's.

    python benchmarks/litgpt_step.py --n-layer 4 --json out/litgpt_step.json --png out/litgpt_step.png

Several GPUs of one node, sharded (`torchrun --nproc_per_node 2 benchmarks/litgpt_step.py --fsdp`): eager and
torch.compile shard with PyTorch's FSDP2 (`fully_shard` per transformer block and the root), the Thunder variants
with `thunder.distributed.fsdp` (tk's collectives where they claim). `--batch` is per GPU; tokens/s counts every
GPU's tokens, and peak memory is the largest rank's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import ClockSampler, bar_chart, print_table, profiled_kernels, write_results  # noqa: E402

from thunder_tk.litgpt_models import vectorize_window_masks  # noqa: E402
from thunder_tk.pretrain import LossModule, autocast_for, max_over_ranks, tracing_without_cyclic_gc  # noqa: E402
from thunder_tk.pretrain_config import precision_of  # noqa: E402
# Where a step's GPU time goes: kernels by what they compute (shared with `thunder-tk pretrain`'s profile).
from thunder_tk.step_profile import (TK_KERNEL, gpu_activities, idle_gaps, kernel_kind, kernel_label,  # noqa: E402
                                     launch_order_for_profiling)


def build(model_name: str, n_layer: int | None, seq: int, device: torch.device, weights: torch.dtype = torch.bfloat16):
    from litgpt import GPT, Config

    cfg = Config.from_name(model_name, **({"n_layer": n_layer} if n_layer else {}))
    with device:
        model = GPT(cfg)
        model.max_seq_length = seq
    vectorize_window_masks(model)  # sliding-window models: the mask in a few ops, not LitGPT's loop (every variant)
    return model.to(weights), cfg


def _fsdp2(module: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in module.model.transformer.h:
        fully_shard(block)
    fully_shard(module)
    return module


def variants(fsdp: bool, device: torch.device, without: tuple[str, ...] = ()):
    """name -> wrap(LossModule) returning the module to call; the optimizer takes its parameters afterwards.
    `without`: names of "thunder [tk] without ..." variants (WITHOUT) to add after the fixed ones."""
    import thunder

    import thunder_tk

    def thunder_variant(executors, graphs: bool = False, copy_gradients: bool = False, reuse_saved: bool = True,
                        **options):
        def wrap(m):
            if graphs:  # a transform per build: it holds the graphs it captures
                options["transforms"] = [thunder_tk.CUDAGraphs(copy_gradients=copy_gradients,
                                                               reuse_saved=reuse_saved)]
            jitted = thunder.jit(m, executors=executors, **options)
            if fsdp:
                from thunder.distributed import fsdp as thunder_fsdp

                jitted = thunder_fsdp(jitted, device=device)
            if graphs:  # for the row's account of the graphs' memory
                jitted.tk_cuda_graphs = options["transforms"][0]
            return jitted

        return wrap

    return {
        "eager": _fsdp2 if fsdp else (lambda m: m),
        # FSDP2 first, then compile the whole sharded module (its hooks run in eager between graphs)
        "torch.compile": (lambda m: torch.compile(_fsdp2(m))) if fsdp else torch.compile,
        # Thunder's defaults with the torch.compile fuser standing in for nvFuser (which cannot load here)
        "thunder default": thunder_variant(thunder_tk.baseline_executors()),
        "thunder [tk]": thunder_variant([thunder_tk.tk]),
        # the step's forward and backward each captured once and replayed as CUDA graphs (thunder_tk.CUDAGraphs):
        # one host call each instead of one per op; the same for the baseline and for torch.compile
        "thunder [tk] CUDA graphs": thunder_variant([thunder_tk.tk], graphs=True),
        "thunder default CUDA graphs": thunder_variant(thunder_tk.baseline_executors(), graphs=True),
        # tk's graphs with each gradient copied out of the backward graph (autograd's clone), not handed out as is
        "thunder [tk] CUDA graphs, gradients copied": thunder_variant([thunder_tk.tk], graphs=True,
                                                                      copy_gradients=True),
        # tk's graphs with every saved tensor kept by the forward's graph (no reuse of their memory in the backward's)
        "thunder [tk] CUDA graphs, saved kept": thunder_variant([thunder_tk.tk], graphs=True, reuse_saved=False),
        "torch.compile CUDA graphs": (lambda m: torch.compile(_fsdp2(m), mode="reduce-overhead")) if fsdp
        else (lambda m: torch.compile(m, mode="reduce-overhead")),
        # tk with the loss's forward and backward kernels instead of the gradient from the forward's read
        "thunder [tk] loss kernels": thunder_variant([thunder_tk.tk], tk_cross_entropy_forward_grad=False),
        # tk with its GEMM claims off: the GEMMs on cuBLAS, everything else as in "thunder [tk]"
        "thunder [tk] cuBLAS GEMMs": thunder_variant([thunder_tk.tk], tk_disable="gemm"),
        # tk's GEMMs taking tiles from a counter (blocks that start late take fewer) instead of a fixed share
        "thunder [tk] dynamic GEMMs": with_environment(thunder_variant([thunder_tk.tk]),
                                                       THUNDER_TK_GEMM_SCHEDULE="dynamic"),
        # tk with its kernels launched in plain stream order, not programmatically dependent on the kernel before
        "thunder [tk] plain launch order": around_steps(thunder_variant([thunder_tk.tk]),
                                                        lambda: thunder_tk.ops.dependent_launches(False)),
        # tk with LitGPT's repeated K/V heads made, saved and read as traced (no pattern_fusion.attend_grouped_kv)
        "thunder [tk] K/V repeated": thunder_variant([thunder_tk.tk], tk_disable="attention_grouped_kv"),
        # tk with SwiGLU's two products and silu(h1) * h2 apart (no pattern_fusion.fuse_swiglu): two GEMMs, and the
        # fuser's kernel forms the gated product
        "thunder [tk] SwiGLU apart": thunder_variant([thunder_tk.tk], tk_disable="gemm_swiglu"),
        # tk with SwiGLU's backward apart from proj's dX GEMM (no pattern_fusion.fuse_swiglu_grad): the GEMM writes
        # dg, and the fuser's kernel reads dg, h1 and h2 back for dh1 and dh2
        "thunder [tk] SwiGLU backward apart": thunder_variant([thunder_tk.tk], tk_disable="gemm_swiglu_grad"),
        # both apart: tk's step before either SwiGLU fusion
        "thunder [tk] SwiGLU both apart": thunder_variant([thunder_tk.tk], tk_disable=["gemm_swiglu",
                                                                                      "gemm_swiglu_grad"]),
        # the optimizer's update on tk's AdamW kernel (thunder_tk.optim.AdamW) instead of torch's fused AdamW: with
        # tk's step, Thunder's default one and torch.compile's
        "thunder [tk] tk AdamW": with_tk_adamw(thunder_variant([thunder_tk.tk])),
        "thunder default tk AdamW": with_tk_adamw(thunder_variant(thunder_tk.baseline_executors())),
        "torch.compile tk AdamW": with_tk_adamw((lambda m: torch.compile(_fsdp2(m))) if fsdp
                                                else (lambda m: torch.compile(m))),
        # tk with any rules, families or features off (tk_disable), named on the command line: an A/B in one run
        **{name: thunder_variant([thunder_tk.tk], tk_disable=list(switched_off(name))) for name in without},
    }


# "thunder [tk] without <name>, <name>": tk with those tk_disable names off; on the command line
# tk_without=<name>+<name> (no spaces or brackets, for gpu_run.sh's LITGPT_ARGS).
WITHOUT = "thunder [tk] without "
_WITHOUT_ALIAS = "tk_without="


def switched_off(name: str) -> tuple[str, ...]:
    """The tk_disable names of a WITHOUT variant's name."""
    return tuple(n.strip() for n in name[len(WITHOUT):].split(","))


def around_steps(wrap, context):
    """A variant whose steps each run inside `context()` (a context manager: a process-wide tk setting)."""
    wrap.around_step = context
    return wrap


def with_environment(wrap, **env):
    """A variant whose steps run with these environment variables set (read by tk at each call)."""

    @contextlib.contextmanager
    def environment():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return around_steps(wrap, environment)


LR = 1e-4  # every variant's optimizer's
TK_ADAMW = "tk AdamW"


def torch_adamw(params, device: torch.device):
    """The step's optimizer unless a variant picks another: torch's fused AdamW (its default path off a GPU)."""
    return torch.optim.AdamW(params, lr=LR, fused=device.type == "cuda")


def optimizer_name(wrap, device: torch.device) -> str:
    """The name of the optimizer a variant's steps update with (each row's "optimizer")."""
    return getattr(wrap, "optimizer_name", None) or ("torch fused AdamW" if device.type == "cuda" else "torch AdamW")


def clipping(opt, max_norm: float | None):
    """What clips the gradients before `opt.step()` by their global norm, as LitGPT's pretrain does: nothing without
    max_norm; else `thunder-tk pretrain`'s clip_gradients (thunder_tk.optim.AdamW's clip_grad_norm_, the scaling
    folded into its update; torch's foreach norms and multiply for torch's AdamW), or torch.nn.utils.clip_grad_norm_
    for FSDP2's DTensors."""
    if max_norm is None:
        return lambda: None
    params = [p for group in opt.param_groups for p in group["params"]]
    if any(type(p).__name__ == "DTensor" for p in params):  # FSDP2's: torch's clip sums over the mesh itself
        return lambda: torch.nn.utils.clip_grad_norm_(params, max_norm)
    from thunder_tk.pretrain import clip_gradients

    # thunder.distributed.fsdp's shards are plain tensors: their squared norms summed over the ranks
    group = torch.distributed.group.WORLD if _world() > 1 else None
    return lambda: clip_gradients(params, max_norm, opt, group)


def with_optimizer(wrap, name: str, make):
    """A variant whose steps update with `make(params, device)` (named `name` in its row) instead of torch_adamw.
    A new wrap, so that a shared one (torch.compile itself) is left as it is; its around_step goes with it."""

    def wrapped(m):
        return wrap(m)

    if hasattr(wrap, "around_step"):
        wrapped.around_step = wrap.around_step
    wrapped.make_optimizer, wrapped.optimizer_name = make, name
    return wrapped


def with_tk_adamw(wrap):
    """A variant whose steps update with thunder_tk.optim.AdamW (tk's kernel where the parameters allow, torch's path
    for the rest: its `routes`), same learning rate."""

    def make(params, device: torch.device):
        from thunder_tk.optim import AdamW

        return AdamW(params, lr=LR)

    return with_optimizer(wrap, TK_ADAMW, make)


# Every variant of variants(), in order, with its spellings without spaces or brackets, which survive shell word
# splitting (gpu_run.sh's LITGPT_ARGS).
_VARIANT_ALIASES = {
    "eager": (),
    "torch.compile": ("compile", "torch_compile"),
    "thunder default": ("default", "thunder_default"),
    "thunder [tk]": ("tk", "thunder_tk"),
    "thunder [tk] CUDA graphs": ("tk_graphs",),
    "thunder default CUDA graphs": ("default_graphs",),
    "thunder [tk] CUDA graphs, gradients copied": ("tk_graphs_copied",),
    "thunder [tk] CUDA graphs, saved kept": ("tk_graphs_saved_kept",),
    "torch.compile CUDA graphs": ("compile_graphs",),
    "thunder [tk] loss kernels": ("tk_loss_kernels",),
    "thunder [tk] cuBLAS GEMMs": ("tk_cublas_gemms",),
    "thunder [tk] dynamic GEMMs": ("tk_dynamic_gemms",),
    "thunder [tk] plain launch order": ("tk_plain_launch_order", "tk_no_pdl"),
    "thunder [tk] K/V repeated": ("tk_kv_repeated",),
    "thunder [tk] SwiGLU apart": ("tk_swiglu_apart",),
    "thunder [tk] SwiGLU backward apart": ("tk_swiglu_bwd_apart",),
    "thunder [tk] SwiGLU both apart": ("tk_swiglu_both_apart",),
    "thunder [tk] tk AdamW": ("tk_adamw",),
    "thunder default tk AdamW": ("default_tk_adamw",),
    "torch.compile tk AdamW": ("compile_tk_adamw",),
}
VARIANT_NAMES = tuple(_VARIANT_ALIASES)
_ALIASES = {alias: name for name, aliases in _VARIANT_ALIASES.items() for alias in aliases}


def repeats_labelled(names: list[str]) -> list[tuple[str, str]]:
    """(variant, row label) in order: a variant's second run is labelled "<name> #2", its third "#3"."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append((n, n if seen[n] == 1 else f"{n} #{seen[n]}"))
    return out


def variant_names(given: list[str] | None) -> list[str] | None:
    """--only's names as the variants are called (aliases resolved); an unknown name is an error, not a run
    that silently measures nothing."""
    if not given:
        return None
    from thunder_tk.claim_rules import known_disable_names

    def resolved(g: str) -> str:
        if g.lower().startswith(_WITHOUT_ALIAS):
            return WITHOUT + ", ".join(g[len(_WITHOUT_ALIAS):].split("+"))
        return _ALIASES.get(g.lower().replace("-", "_"), g)

    names = [resolved(g) for g in given]
    unknown = [g for g, n in zip(given, names)
               if n not in VARIANT_NAMES and not (n.startswith(WITHOUT) and set(switched_off(n)) <= known_disable_names())]
    if unknown:
        raise SystemExit(f"--only: unknown variant(s) {unknown}; choose from {list(VARIANT_NAMES)}, "
                         f"{sorted(_ALIASES)} or {_WITHOUT_ALIAS}<name>[+<name>...] with tk_disable names "
                         f"{sorted(known_disable_names())}")
    return names


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def profile_step(step, device: torch.device, top: int, launch_order: str = "plain") -> dict:
    """One step under the CUDA profiler: wall time, summed kernel time (the gap is launch overhead and idle GPU),
    time per kernel kind and the `top` kernels. tk's kernels launch in `launch_order` for it (plain by default: a
    dependently launched kernel's profiled time would include its wait for the kernel before it)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with launch_order_for_profiling(launch_order) as launched_in, profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    kernels = profiled_kernels(prof)
    kinds: dict[str, float] = {}
    for name, (ms, _) in kernels.items():
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    try:  # a diagnostic within a diagnostic: the kernel table above stands without it
        gaps = idle_gaps(gpu_activities(prof))
    except Exception as e:  # noqa: BLE001
        gaps = {"error": f"{type(e).__name__}: {e}"}
    return {"wall_ms": wall * 1e3, "kernel_ms": sum(ms for ms, _ in kernels.values()), "gaps": gaps,
            "launch_order": launched_in,
            "tk_ms": sum(ms for name, (ms, _) in kernels.items() if TK_KERNEL.search(name)),
            "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"kernel": kernel_label(k)[:200], "ms": ms, "calls": n, "kind": kernel_kind(k),
                     "tk": bool(TK_KERNEL.search(k))} for k, (ms, n) in ranked]}


def host_step(step, device: torch.device, gpu_step_ms: float) -> dict:
    """The host's own cost of one step: the step is enqueued behind a sleep kernel that keeps the GPU busy for
    three of its step times, so the host never waits for the GPU. A step that outruns its GPU work on the host
    runs at the host's pace. If the host had to wait for the GPU anyway (a synchronisation inside the step, or a
    full launch queue), the sleep was over before the host finished: that is reported, not a host time."""
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    sleep_ms = 3.0 * gpu_step_ms
    done = torch.cuda.Event()
    torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
    done.record()
    t0 = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - t0) * 1e3
    waited = done.query()  # the sleep already over: the host may have waited for the GPU
    torch.cuda.synchronize(device)
    return {"host_ms": host_ms, "gpu_step_ms": gpu_step_ms, "host_waited": bool(waited)}


# Where the host's time goes, by the file a function is in (first match wins).
_HOST_AREAS = (("thunder_tk", "/thunder_tk/"), ("thunder", "/thunder/"), ("inductor/dynamo", "/torch/_inductor/"),
               ("inductor/dynamo", "/torch/_dynamo/"), ("autograd", "/torch/autograd/"), ("optimizer", "/torch/optim/"),
               ("torch (other Python)", "/torch/"))


def _host_area(file: str, function: str) -> str:
    if file == "~":  # a builtin: C++ behind a Python call (torch ops, kernel launches, the extension's bindings)
        return "builtins (C++: ops, launches)"
    return next((area for area, part in _HOST_AREAS if part in file), "other")


def host_profile_step(step, device: torch.device, top: int) -> dict:
    """One step under Python's profiler: the host's time by area (thunder_tk, Thunder, inductor's compiled calls,
    autograd, the optimizer, C++ builtins) and the `top` functions by their own time. Run it where the GPU keeps up
    with the host (a short sequence, a small batch): at full size the host also waits on a full launch queue, inside
    whichever launch found it full."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    step()
    prof.disable()
    host_ms = (time.perf_counter() - t0) * 1e3
    sync(device)
    stats = pstats.Stats(prof).stats
    areas: dict[str, float] = {}
    ranked = []
    for (file, line, function), (_, calls, own, cumulative, _) in stats.items():
        area = _host_area(file, function)
        areas[area] = areas.get(area, 0.0) + own * 1e3
        ranked.append({"function": f"{os.path.basename(file)}:{line} {function}" if file != "~" else function,
                       "area": area, "calls": calls, "own_ms": own * 1e3, "cumulative_ms": cumulative * 1e3})
    ranked.sort(key=lambda r: -r["own_ms"])
    return {"host_ms_profiled": host_ms, "areas_ms": dict(sorted(areas.items(), key=lambda kv: -kv[1])),
            "top": ranked[:top]}


def _site(frames: list[dict]) -> str:
    """Where an allocation was made: the innermost frame outside torch itself (a tk wrapper, a Thunder trace
    line, LitGPT), with its caller."""
    mine = [f for f in frames if "/torch/" not in f.get("filename", "") and not f.get("filename", "").startswith("<frozen")]
    if not mine:
        return frames[0].get("name", "?") if frames else "?"
    where = lambda f: f"{f.get('name', '?')} ({Path(f.get('filename', '?')).name}:{f.get('line', 0)})"  # noqa: E731
    return where(mine[0]) + (f" <- {where(mine[1])}" if len(mine) > 1 else "")


def live_at_peak(trace: list[dict], top: int) -> dict:
    """Replays one device's allocator trace (torch.cuda.memory._snapshot()["device_traces"][i]): the moment the
    bytes allocated during the trace peaked, and what was live then, grouped by allocation site. Blocks that
    existed before the trace began are not in it (their frees are ignored)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in trace:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live[addr] = (e["size"], _site(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)[0]
    sites: dict[str, list] = {}
    for size, site in at_peak.values():
        entry = sites.setdefault(site, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_mib": peak / 2**20,
            "top": [{"site": site, "mib": b / 2**20, "blocks": n} for site, (b, n) in ranked]}


def memory_step(step, device: torch.device, top: int, resident: int = 0) -> dict:
    """One step with the allocator recording Python stacks: memory allocated before the step, the peak the step
    added on top of it, and the `top` allocation sites live at that peak; with `resident`, also the `resident`
    largest sites of what each pool still holds after the step (meaningful where recording began before the build)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    # Where recording runs since the build (resident), the trace also holds the build's and earlier steps' events:
    # only this step's count (entries carry their time, in microseconds since the epoch).
    start_us = time.time() * 1e6
    if not resident:
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        if not resident:
            torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][device.index or 0]
    trace = [e for e in trace if e.get("time_us", start_us) >= start_us] or trace  # a clock that disagrees: all
    out = {"before_step_gib": base / 2**30, **live_at_peak(trace, top),
           "segments": segments_by_pool(snap["segments"], device.index or 0)}
    if resident:
        out["resident"] = resident_by_site(snap["segments"], device.index or 0, resident)
    return out


def segments_by_pool(segments: list[dict], device_index: int) -> list[dict]:
    """The allocator's reserved memory by pool (the default one, or a private one: CUDA graphs') and by the stream
    whose allocations each segment serves, with what tensors hold of it. Segments are only returned by
    empty_cache, so after a step this is where its reserved peak lies."""
    groups: dict[tuple, dict] = {}
    for seg in segments:
        if seg.get("device", 0) != device_index:
            continue
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        key = ("default" if pool == (0, 0) else f"private {pool[0]}.{pool[1]}", seg.get("stream", 0))
        g = groups.setdefault(key, {"segments": 0, "reserved": 0, "allocated": 0})
        g["segments"] += 1
        g["reserved"] += seg["total_size"]
        g["allocated"] += seg["allocated_size"]
    return [{"pool": pool, "stream": "default" if stream == 0 else hex(stream), "segments": g["segments"],
             "reserved_gib": g["reserved"] / 2**30, "allocated_gib": g["allocated"] / 2**30}
            for (pool, stream), g in sorted(groups.items(), key=lambda kv: -kv[1]["reserved"])]


def resident_by_site(segments: list[dict], device_index: int, top: int) -> list[dict]:
    """What holds memory after the step: the snapshot's live blocks by pool and allocation site, the `top` largest
    sites of each pool. A block carries its site only where the allocator recorded history when it was made
    (--memory-resident records from before the variant is built); others count as "(before recording)"."""
    sites: dict[tuple[str, str], list] = {}
    for seg in segments:
        if seg.get("device", 0) != device_index:
            continue
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        pool_name = "default" if pool == (0, 0) else f"private {pool[0]}.{pool[1]}"
        for block in seg.get("blocks", ()):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            entry = sites.setdefault((pool_name, _site(frames) if frames else "(before recording)"), [0, 0])
            entry[0] += block["size"]
            entry[1] += 1
    out = []
    for pool_name in sorted({p for p, _ in sites}, key=lambda p: -sum(b for (q, _), (b, _) in sites.items() if q == p)):
        ranked = sorted(((site, b, n) for (q, site), (b, n) in sites.items() if q == pool_name), key=lambda t: -t[1])
        out += [{"pool": pool_name, "site": site, "mib": b / 2**20, "blocks": n} for site, b, n in ranked[:top]]
    return out


def print_memory(rows: list[dict]) -> None:
    for r in rows:
        m = r.get("memory")
        if not m:
            continue
        print(f"\n{r['variant']}: {m['before_step_gib']:.2f} GiB before the step, peak {m['peak_mib']:.0f} MiB "
              f"above it; live at that peak:")
        print_table([{"MiB": f"{t['mib']:.1f}", "blocks": t["blocks"], "allocated at": t["site"][:150]}
                     for t in m["top"]], ["MiB", "blocks", "allocated at"])
        if m.get("segments"):
            print(f"{r['variant']}: reserved memory after the step by pool and stream (GiB)")
            print_table([{**g, "reserved_gib": f"{g['reserved_gib']:.2f}", "allocated_gib": f"{g['allocated_gib']:.2f}"}
                         for g in m["segments"]], ["pool", "stream", "segments", "reserved_gib", "allocated_gib"])
        if m.get("resident"):
            print(f"{r['variant']}: allocated after the step, by pool and allocation site (history from the build)")
            print_table([{**t, "mib": f"{t['mib']:.1f}", "site": t["site"][:140]} for t in m["resident"]],
                        ["pool", "mib", "blocks", "site"])


def print_host(rows: list[dict]) -> None:
    timed = [r for r in rows if r.get("host")]
    if not timed:
        return
    print("\nHost time per step (enqueued behind a GPU sleep) against the timed step, ms")
    for r in timed:
        h = r["host"]
        note = "  (the host waited for the GPU: a synchronisation in the step?)" if h["host_waited"] else ""
        print(f"  {r['variant']:<16} host {h['host_ms']:7.2f}   step {h['gpu_step_ms']:7.2f}{note}")


def print_host_profiles(rows: list[dict]) -> None:
    for r in rows:
        h = r.get("host_profile")
        if not h:
            continue
        print(f"\n{r['variant']}: one step under Python's profiler, {h['host_ms_profiled']:.1f} ms on the host: "
              + ", ".join(f"{area} {ms:.1f}" for area, ms in h["areas_ms"].items()))
        for t in h["top"]:
            print(f"  {t['own_ms']:8.2f} ms own {t['cumulative_ms']:8.2f} cum {t['calls']:6d}x  {t['area']:<22} "
                  f"{t['function'][:110]}")


def print_profiles(rows: list[dict]) -> None:
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return
    kinds = sorted({k for r in profiled for k in r["profile"]["kinds_ms"]})
    orders = sorted({r["profile"].get("launch_order", "?") for r in profiled})
    print(f"\nGPU time per step (ms), one profiled step (tk's kernels in {' / '.join(orders)} launch order)")
    print_table([{"variant": r["variant"], "wall": r["profile"]["wall_ms"], "kernels": r["profile"]["kernel_ms"],
                  "of which tk": r["profile"].get("tk_ms", 0.0),
                  **{k: r["profile"]["kinds_ms"].get(k, 0.0) for k in kinds}} for r in profiled],
                ["variant", "wall", "kernels", "of which tk", *kinds])
    for r in profiled:
        gaps = r["profile"].get("gaps") or {}
        if "buckets" in gaps:
            print(f"\n{r['variant']}: compute stream idle {gaps['idle_ms']:.2f} ms between its kernels: "
                  + ", ".join(f"{label} {b['count']}x {b['ms']:.2f} ms" for label, b in gaps["buckets"].items()))
            for g in gaps["longest"]:
                print(f"  {g['us']:8.1f} us after {g['after'][:60]}  before {g['before'][:60]}")
        print(f"\n{r['variant']}: top kernels")
        for k in r["profile"]["top"]:
            owner = "tk " if k.get("tk") else ""
            print(f"  {k['ms']:8.3f} ms {k['calls']:5d}x  {owner + k['kind']:<18} {k['kernel'][:130]}")


class Built:
    """One variant, built and warmed up: its step, and the memory allocated before it was built."""

    def __init__(self, name, wrap, args, device: torch.device):
        self.name, self.device, self.cuda = name, device, device.type == "cuda"
        self.base_gib = torch.cuda.memory_allocated(device) / 2**30 if self.cuda else 0.0
        self.base_reserved_gib = torch.cuda.memory_reserved(device) / 2**30 if self.cuda else 0.0
        # Free space inside segments that earlier variants' tensors (kept for more rounds) still hold, which the
        # cache cannot return: this variant may allocate there, and the reserved peak below then reads that much low.
        self.shared_free_gib = self.base_reserved_gib - self.base_gib
        torch.manual_seed(0)
        # LitGPT's precisions, as `thunder-tk pretrain` runs them (bf16-mixed: fp32 weights, the step's forward
        # under bf16 autocast, which each variant's compiler traces as casts)
        _, weights, autocast = precision_of(args.precision, device.type)
        model, cfg = build(args.model, args.n_layer, args.seq, device, getattr(torch, weights))
        self.net = net = wrap(LossModule(model))
        # torch's fused AdamW unless the variant picks its optimizer (with_optimizer)
        make_optimizer = getattr(wrap, "make_optimizer", torch_adamw)
        self.optimizer_name = optimizer_name(wrap, device)
        self.opt = opt = make_optimizer([p for p in net.parameters() if p.requires_grad], device)
        rank = torch.distributed.get_rank() if _world() > 1 else 0
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
        x = torch.randint(cfg.padded_vocab_size, (args.batch, args.seq), generator=gen).to(device)
        y = torch.randint(cfg.padded_vocab_size, (args.batch, args.seq), generator=gen).to(device)

        around = getattr(wrap, "around_step", contextlib.nullcontext)
        clip = clipping(opt, getattr(args, "max_norm", None))

        def step():
            with around():
                with autocast_for(autocast, device.type):
                    loss = net(x, y)
                loss.backward()
                clip()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return loss

        self.step = step
        self.windows: list[tuple[float, float]] = []  # wall-clock span of each timing round, for the clock samples
        for i in range(args.warmup):
            with tracing_without_cyclic_gc(i == 0):  # Thunder traces in the first step
                step()

    def time_steps(self, steps: int):
        """Seconds per step over `steps` steps (the slowest rank's), and the last step's loss."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if _world() > 1:
            torch.distributed.barrier()
        t0, wall0 = time.perf_counter(), ClockSampler.now()
        for _ in range(steps):
            loss = self.step()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        self.windows.append((wall0, ClockSampler.now()))
        return max_over_ranks(elapsed, self.device) / steps, loss


def run(name, wrap, args, device: torch.device):
    """Builds a variant, times its first round and measures its peak memory, then runs the diagnostics asked for.
    Returns the row and the built variant (for more rounds)."""
    resident = getattr(args, "memory_resident", 0) if device.type == "cuda" and name != "eager" else 0
    if not resident:
        return _run(name, wrap, args, device, 0)
    # From before the build: every block the variant keeps then carries its allocation site.
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        row, v = _run(name, wrap, args, device, resident)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    row["timed_while_recording"] = True
    return row, v


def _run(name, wrap, args, device: torch.device, resident: int):
    v = Built(name, wrap, args, device)
    cuda = v.cuda
    if cuda:
        # The warmup's cached blocks are not the step's (a graph's capture runs its region op by op first): dropped,
        # and one more step caches what a step needs, so the reserved peak below is the step's.
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        v.step()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds, loss = v.time_steps(args.steps)
    step = v.step
    tokens = args.batch * args.seq * _world()
    # What this variant holds at its peak: earlier variants kept for more rounds are not its memory. A CUDA graph's
    # temporaries live in the free part of its pool, which the allocated peak does not count and the reserved does.
    peak = max_over_ranks(torch.cuda.max_memory_allocated(device) / 2**30 - v.base_gib, device) if cuda else None
    reserved = max_over_ranks(torch.cuda.max_memory_reserved(device) / 2**30 - v.base_reserved_gib, device) \
        if cuda else None
    row = {"variant": name, "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": tokens / seconds / _world(),
           "peak_gib": peak, "reserved_gib": reserved, "loss": float(loss.detach().float().mean()),
           "optimizer": v.optimizer_name, "_windows": v.windows}
    if hasattr(v.opt, "route_counts"):  # thunder_tk.optim.AdamW's last step: tensors on tk's kernel, on torch's path, why
        row["optimizer_routes"] = v.opt.route_counts()
    shared = max_over_ranks(v.shared_free_gib, device) if cuda else 0.0
    if shared > 1 / 64:  # the variant's own reserved peak lies between reserved_gib and this
        row["reserved_gib_upper"] = reserved + shared
    graphs = getattr(v.net, "tk_cuda_graphs", None)
    if graphs is not None and cuda:
        row["graphs_memory_gib"] = {k: max_over_ranks(b / 2**30, device) for k, b in graphs.memory().items()}
    if args.profile and cuda and name != "eager":
        try:  # a profiler failure must not cost the timing above
            row["profile"] = profile_step(step, device, args.profile, args.profile_launch_order)
        except Exception as e:  # noqa: BLE001
            row["profile_error"] = f"{type(e).__name__}: {e}"
    if args.host_time and cuda:
        try:  # a diagnostic, never at the cost of the timing
            row["host"] = host_step(step, device, seconds * 1e3)
        except Exception as e:  # noqa: BLE001
            row["host_error"] = f"{type(e).__name__}: {e}"
    if args.host_profile:
        try:  # a diagnostic, never at the cost of the timing
            row["host_profile"] = host_profile_step(step, device, args.host_profile)
        except Exception as e:  # noqa: BLE001
            row["host_profile_error"] = f"{type(e).__name__}: {e}"
    if (args.memory or resident) and cuda and name != "eager":
        try:  # like the profile: a diagnostic, never at the cost of the timing
            row["memory"] = memory_step(step, device, args.memory or 5, resident or 0)
        except Exception as e:  # noqa: BLE001
            row["memory_error"] = f"{type(e).__name__}: {e}"
    if name == "thunder [tk]":
        import thunder_tk

        report = thunder_tk.explain(v.net)
        # what tk ran, the backward ops of a symbol claimed with its gradient included
        row["tk_claimed"] = sorted({op for r in report.rows if r.claimed_by_tk
                                    for op in (r.ran_by, *r.backward_ran_by.split(", ")) if op})
    return row, v


def more_rounds(rows: list[dict], built: list[Built], args) -> None:
    """Rounds 2..R with every variant built, in turns (round r starts at variant r mod n); each row then gets the
    median of its rounds."""
    tokens = args.batch * args.seq * _world()
    per_round = {r["variant"]: [r["tokens_per_s"]] for r in rows if r["tokens_per_s"] is not None}
    n = len(built)
    for rnd in range(1, args.rounds if n else 1):  # every variant failed: no rounds to run
        for v in built[rnd % n:] + built[:rnd % n]:
            seconds, _ = v.time_steps(args.steps)
            per_round[v.name].append(tokens / seconds)
    for r in rows:
        if r["variant"] not in per_round:  # a variant that failed: no timing
            continue
        r["tokens_per_s_rounds"] = per_round[r["variant"]]
        r["tokens_per_s"] = statistics.median(per_round[r["variant"]])
        r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / _world()


THROTTLED_CLOCK = 0.9  # a round whose mean SM clock is below this share of the run's median is flagged
HOT_CELSIUS = 85


def attach_clocks(rows: list[dict], clocks: ClockSampler) -> list[str]:
    """Each row's SM clock, power and temperature over each of its timing rounds (`clocks_rounds`, in the order of
    `tokens_per_s_rounds`), and a warning per round that ran throttled or hot: one host ran every variant at half
    speed after its first round at 80 C (2026-11-24), and only the clocks tell such a run from a slow kernel."""
    for r in rows:
        r["clocks_rounds"] = [clocks.between(t0, t1) for t0, t1 in r.pop("_windows", [])]
    mhz = [c["sm_mhz"] for r in rows for c in r["clocks_rounds"] if c]
    if not mhz:
        return []
    typical = statistics.median(mhz)
    warnings = []
    for r in rows:
        for i, c in enumerate(r["clocks_rounds"]):
            if c and (c["sm_mhz"] < THROTTLED_CLOCK * typical or c["celsius"] >= HOT_CELSIUS):
                warnings.append(f"WARNING: {r['variant']} round {i + 1} ran at {c['sm_mhz']:.0f} MHz (run median "
                                f"{typical:.0f}), {c['celsius']:.0f} C, {c['watts']:.0f} W: throttled or hot, its "
                                "figure is not comparable")
    return warnings


def add_model_arguments(p: argparse.ArgumentParser, *, n_layer: int = 4, warmup: int = 3) -> None:
    """The arguments `Built` reads: the model, its batch and the warm-up steps."""
    p.add_argument("--model", default="Llama-3.2-1B")
    p.add_argument("--n-layer", type=int, default=n_layer)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--precision", choices=("bf16-true", "bf16-mixed"), default="bf16-true",
                   help="LitGPT's: bf16 weights and compute, or fp32 weights with the forward under bf16 autocast")
    p.add_argument("--max-norm", type=float, default=None,
                   help="clip the gradients by their global norm before each update (LitGPT's train.max_norm, 1.0 "
                        "in its pretrain configs); default: no clipping")
    p.add_argument("--warmup", type=int, default=warmup)

GOAL_VS_DEFAULT, GOAL_VS_COMPILE = 1.15, 1.0  # issue 6, one GPU


def goal_verdicts(rows) -> list[str]:
    """Issue 6's one-GPU goal for each timed tk variant: tokens/s at least GOAL_VS_DEFAULT x Thunder default's and
    GOAL_VS_COMPILE x torch.compile's, with no more peak memory than Thunder default's. Empty without the baseline."""
    by_name = {r["variant"]: r for r in rows if r.get("tokens_per_s") is not None}
    default, compiled = by_name.get("thunder default"), by_name.get("torch.compile")
    if default is None:
        return []
    lines = []
    for name, r in by_name.items():
        if not name.startswith("thunder [tk]"):
            continue
        met = r["tokens_per_s"] >= GOAL_VS_DEFAULT * default["tokens_per_s"]
        checks = [f"{r['tokens_per_s'] / default['tokens_per_s']:.3f}x Thunder default "
                  f"({'ok' if met else 'below'} {GOAL_VS_DEFAULT})"]
        if compiled is not None:
            ok = r["tokens_per_s"] >= GOAL_VS_COMPILE * compiled["tokens_per_s"]
            checks.append(f"{r['tokens_per_s'] / compiled['tokens_per_s']:.3f}x torch.compile "
                          f"({'ok' if ok else 'below'} {GOAL_VS_COMPILE})")
            met = met and ok
        else:
            checks.append("torch.compile not run")
            met = False
        if r.get("peak_gib") is not None and default.get("peak_gib") is not None:
            ok = r["peak_gib"] <= default["peak_gib"]
            checks.append(f"peak {r['peak_gib']:.2f} against {default['peak_gib']:.2f} GiB ({'ok' if ok else 'above'})")
            met = met and ok
        lines.append(f"goal ({name}): {'met' if met else 'not met'}: " + "; ".join(checks))
    return lines


def main():
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every variant this many times in turns (variants stay built), median per variant")
    p.add_argument("--only", nargs="*", help=f"variants to run: {', '.join(VARIANT_NAMES)} (or without spaces: "
                                             f"{', '.join(sorted(_ALIASES))}), and tk with tk_disable names off: "
                                             f"{_WITHOUT_ALIAS}<name>[+<name>...], e.g. {_WITHOUT_ALIAS}gemm_sum")
    p.add_argument("--fsdp", action="store_true", help="shard over the torchrun processes (one GPU each)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the code paths")
    p.add_argument("--json", default="out/litgpt_step.json")
    p.add_argument("--png")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one step per variant: GPU time by kernel kind and the N largest kernels")
    p.add_argument("--profile-launch-order", choices=("plain", "dependent"), default="plain",
                   help="tk's launch order in the profiled step: plain (default; each kernel's time its own) or "
                        "dependent (as the timed steps run, where a kernel's time includes its wait for the one before)")
    p.add_argument("--host-time", action="store_true",
                   help="after timing, the host's own time for one step per variant (enqueued behind a GPU sleep, "
                        "so it never waits for the GPU), beside the timed step")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="after timing, one step per variant under Python's profiler: the host's time by area and the "
                        "N functions with the most time of their own (meaningful where the GPU keeps up: small shapes)")
    p.add_argument("--memory", type=int, default=0, metavar="N",
                   help="after timing, record one step's allocations per variant and list the N largest allocation "
                        "sites live at the step's memory peak, and the reserved memory by pool and stream")
    p.add_argument("--memory-resident", type=int, default=0, metavar="N",
                   help="with the allocator recording from before each variant is built: the N largest allocation "
                        "sites of what each pool (default, CUDA graphs') still holds after a step. Recording slows "
                        "the build and the timed steps: the row is marked timed_while_recording")
    a = p.parse_args()
    a.only = variant_names(a.only)
    device = torch.device(a.device)
    if a.fsdp:
        import os

        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    main_rank = _world() == 1 or torch.distributed.get_rank() == 0
    rows, built = [], []
    chosen = variants(a.fsdp, device, tuple(n for n in a.only or () if n.startswith(WITHOUT)))
    assert tuple(chosen)[:len(VARIANT_NAMES)] == VARIANT_NAMES, "VARIANT_NAMES must list variants()"
    # nvidia-smi's SM clock, power and temperature beside every timing round (nothing without nvidia-smi)
    with ClockSampler(period_ms=100) as clocks:
        # in --only's order where given (a call cut short keeps the variants named first); a variant named again is
        # built and timed again, as "<name> #2": e.g. tk before and after torch.compile in one process
        for name, label in repeats_labelled(a.only or list(chosen)):
            wrap = chosen[name]
            try:
                row, v = run(name, wrap, a, device)
                row["variant"] = v.name = label
            except Exception as e:  # noqa: BLE001
                if _world() > 1:  # the other ranks would wait for this one in a collective
                    raise
                # One variant that cannot run (e.g. Thunder's own SDPA backward at bf16-mixed) must not cost the
                # others' figures: its row says why, with no timing.
                row, v = {"variant": label, "tokens_per_s": None, "tokens_per_s_per_gpu": None, "peak_gib": None,
                          "reserved_gib": None, "loss": None, "optimizer": optimizer_name(wrap, device),
                          "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}, None
                print(f"{name}: FAILED ({row['error']})", flush=True)
            rows.append(row)
            if a.rounds > 1 and v is not None:
                built.append(v)
            del v
            if main_rank:
                print({k: x for k, x in rows[-1].items() if not k.startswith("_")}, flush=True)
            gc.collect()  # without more rounds, the variant's model and optimizer go with it
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if a.rounds > 1:
            more_rounds(rows, built, a)
            del built
    clock_warnings = attach_clocks(rows, clocks)
    if main_rank and a.rounds > 1:
        for r in rows:
            if r["tokens_per_s"] is None:
                continue
            print(f"{r['variant']:>16}: " + ", ".join(
                f"{t / 1e3:.1f}k" + (f" ({c['sm_mhz']:.0f} MHz, {c['celsius']:.0f} C)" if c else "")
                for t, c in zip(r["tokens_per_s_rounds"], r["clocks_rounds"])) + " tokens/s by round", flush=True)
    if not main_rank:
        torch.distributed.destroy_process_group()
        return
    base = {r["variant"]: r["tokens_per_s"] for r in rows if r["tokens_per_s"] is not None}
    for r in rows:
        timed = r["tokens_per_s"] is not None
        r["vs_thunder_default"] = r["tokens_per_s"] / base["thunder default"] if timed and "thunder default" in base \
            else None
        r["vs_torch_compile"] = r["tokens_per_s"] / base["torch.compile"] if timed and "torch.compile" in base else None
    where = f"FSDP over {_world()} GPUs, batch {a.batch} per GPU" if a.fsdp else f"batch {a.batch}"
    timing = f"median of {a.rounds} rounds in turns" if a.rounds > 1 else "one pass per variant"
    optimizers = "fused AdamW" + (" (tk AdamW where named)" if any(r.get("optimizer") == TK_ADAMW for r in rows)
                                  else "")
    clipped = f", gradients clipped to norm {a.max_norm:g}" if a.max_norm is not None else ""
    print(f"{a.model}, {a.n_layer} layers, {where} x {a.seq} tokens, {a.precision}, {optimizers}{clipped}; "
          f"{a.steps} steps, {timing}")
    print_table(rows, ["variant", "tokens_per_s", "tokens_per_s_per_gpu", "peak_gib", "reserved_gib",
                       "vs_thunder_default", "vs_torch_compile"])
    if not a.fsdp:
        for line in goal_verdicts(rows):
            print(line)
    for r in rows:
        if r.get("graphs_memory_gib"):
            print(f"{r['variant']}: graphs' memory (GiB) " + ", ".join(f"{k} {x:.2f}"
                                                                       for k, x in r["graphs_memory_gib"].items()))
    for r in rows:
        if r.get("reserved_gib_upper") is not None:
            print(f"{r['variant']}: reserved {r['reserved_gib']:.2f}-{r['reserved_gib_upper']:.2f} GiB: it may have "
                  "taken free space in segments that the variants built before it hold (kept for more rounds); "
                  "named first, or with --rounds 1, it reads its own")
    for r in rows:
        if r.get("error"):
            print(f"{r['variant']}: failed, {r['error']}")
    print_profiles(rows)
    print_host(rows)
    print_host_profiles(rows)
    print_memory(rows)
    write_results(a.json, "litgpt_step_fsdp" if a.fsdp else "litgpt_step",
                  [{**r, "world_size": _world(), "n_layer": a.n_layer, "seq": a.seq, "batch_per_gpu": a.batch,
                    "precision": a.precision, "max_norm": a.max_norm,
                    "steps": a.steps, "rounds": a.rounds} for r in rows])
    if a.fsdp:
        torch.distributed.destroy_process_group()
    if a.png:
        timed = [r for r in rows if r["tokens_per_s"] is not None]
        bar_chart(a.png, f"{a.model} ({a.n_layer} layers, {a.precision}) training tokens/s",
                  [r["variant"] for r in timed], {"tokens/s": [r["tokens_per_s"] for r in timed]}, "tokens/s")
    for w in clock_warnings:
        print(w, flush=True)


if __name__ == "__main__":
    main()
