"""AdamW's update over a model's parameters: tk's multi-tensor kernel (ops.adamw_step on the lists, and
thunder_tk.optim.AdamW.step() with its Python host work) against torch's fused AdamW (torch._fused_adamw_ on the
lists, and torch.optim.AdamW(fused=True).step()) and torch's foreach AdamW (torch.optim.AdamW(foreach=True).step()).
Timed in turns (common.interleaved_times: rounds in rotating order, the median over rounds), ms per update; the rate
as the bytes an update must move per second: 7 x the element size per element (the parameter read and written, the
gradient read, exp_avg and exp_avg_sq read and written); ratios peer / tk (above 1: tk faster); JSON and an
optional PNG of the rates.

The ways, all on the same tensors (each updates them in place; their values do not matter to the timing):
  tk             ops.adamw_step(params, grads, exp_avgs, exp_avg_sqs, step=..., ...): its argument checks and the
                 launches (256 tensors a launch)
  tk AdamW       thunder_tk.optim.AdamW.step(): its routing of every parameter, the step counts (on the CPU), then
                 the same launches
  fused          torch._fused_adamw_ over the lists (the op torch's fused AdamW calls; step counts on the GPU)
  fused AdamW    torch.optim.AdamW(fused=True).step(): torch's grouping, the step counts' increment, then the op
  foreach AdamW  torch.optim.AdamW(foreach=True).step(): torch's foreach ops, one pass each (and a temporary the
                 size of exp_avg_sq)
  tk graph, fused graph (unless --no-graphs): tk and fused captured once into a CUDA graph and replayed: the GPU's
                 time alone, without the host's launch path (the step count is the captured one)
  clip + tk AdamW, clip + fused AdamW (unless --max-norm 0): the update after clipping by the global gradient norm,
                 as LitGPT's pretrain clips (train.max_norm, 1.0): tk AdamW's clip_grad_norm_ (one read of every
                 gradient by tk's sq_norm kernel; the scaling inside the update) and torch.nn.utils.clip_grad_norm_
                 (foreach: a read of every gradient for the norm, a read and a write to scale it) before the fused
                 AdamW's step. Reported in ms and as a ratio only (they move more than the update's bytes).
The optimizers' states are the benchmark's tensors (no copies), at step count 10 before their first update.

Before timing, once per case, tk's update is checked against torch's fused one on the same inputs (step 10, the
hyperparameters below, state values of a few steps in): the elements of the parameters, exp_avg and exp_avg_sq
that differ after one update are counted and recorded in the row ("check"); a difference is reported, not fatal.
torch's copies take 3 tensors per parameter, in groups of at most --check-budget-gb.

Cases (--shapes): model, the parameters of LitGPT's --model config (built on the meta device; --n-layer to change
its depth), Llama-3.2-1B by default (115 tensors, 1.498 B parameters: 21 GB an update in bf16); small, --small-count
1-D tensors of --small-min..--small-max elements (2000 of 4096..65536 by default, sizes drawn with a fixed seed): the
launches' and the host's share. Each in the dtypes of --dtypes: bf16 (LitGPT's bf16-true: bf16 weights, gradients and
states) and fp32 (bf16-mixed: fp32 weights, gradients and states). A case holds 4 tensors per parameter (12 GB for
Llama-3.2-1B in bf16, 24 GB in fp32) and the check's copies; it is freed before the next.

    python benchmarks/adamw.py --json out/adamw.json --png out/adamw.png
    python benchmarks/adamw.py --shapes model --dtypes bf16 --model Llama-3.2-3B --rounds 7
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (ClockSampler, bar_chart, graphed, interleaved_times, print_table, shape_arguments,  # noqa: E402
                    write_results)

from thunder_tk import ops  # noqa: E402
from thunder_tk.optim import AdamW as TkAdamW  # noqa: E402

# LitGPT pretraining's AdamW (weight decay on, so its term is part of every update)
HYPER = {"lr": 4e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
STEP = 10  # the checked update's step count (after its increment); the optimizers continue from it
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PRECISIONS = {"bf16": "bf16-true", "fp32": "bf16-mixed"}  # the LitGPT precision whose states these are
BYTES_PER_ELEMENT = 7  # element sizes an update moves per element: param r+w, grad r, exp_avg r+w, exp_avg_sq r+w
SHAPES = {"model": "LitGPT --model's parameters", "small": "--small-count small 1-D tensors"}
WAYS = ["tk", "tk AdamW", "fused", "fused AdamW", "foreach AdamW"]
GRAPHED = {"tk graph": "tk", "fused graph": "fused"}
CLIPPED = ["clip + tk AdamW", "clip + fused AdamW"]
# ratio column -> (peer, tk): the peer's time over tk's, each pair at the same level (lists, optimizers, graphs)
RATIOS = {"fused / tk": ("fused", "tk"), "fused AdamW / tk AdamW": ("fused AdamW", "tk AdamW"),
          "foreach AdamW / tk AdamW": ("foreach AdamW", "tk AdamW"),
          "fused graph / tk graph": ("fused graph", "tk graph"),
          "clip + fused AdamW / clip + tk AdamW": ("clip + fused AdamW", "clip + tk AdamW")}
STATE = ("params", "exp_avg", "exp_avg_sq")  # what an update writes, as the check names it


def arguments(argv=None):
    def extend(p):
        p.add_argument("--chart", dest="png", help="the same as --png")
        p.add_argument("--model", default="Llama-3.2-1B", help="LitGPT config name of the model case")
        p.add_argument("--n-layer", type=int, default=None, help="the model case's layers (default: the config's)")
        p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
        p.add_argument("--small-count", type=int, default=2000)
        p.add_argument("--small-min", type=int, default=4096)
        p.add_argument("--small-max", type=int, default=65536)
        p.add_argument("--no-graphs", action="store_true", help="without the CUDA-graph replays of tk and fused")
        p.add_argument("--no-check", action="store_true", help="without the check of tk against torch's fused")
        p.add_argument("--max-norm", type=float, default=1.0,
                       help="the clipped ways' max_norm (LitGPT's train.max_norm); 0: without the clipped ways")
        p.add_argument("--check-budget-gb", type=float, default=24.0,
                       help="the check's copies of torch's side, at most this much at a time")

    a = shape_arguments("adamw", SHAPES, rounds=5, argv=argv, extend=extend)
    if a.small_count < 1 or a.small_min < 1 or a.small_max < a.small_min:
        raise SystemExit("adamw.py: --small-count and --small-min must be >= 1, --small-max >= --small-min")
    if a.n_layer is not None and a.n_layer < 1:
        raise SystemExit("adamw.py: --n-layer must be >= 1")
    return a


def model_shapes(name: str, n_layer: int | None = None) -> list[tuple[int, ...]]:
    """The shapes of the parameters a LitGPT training step's optimizer takes (the model built on the meta device)."""
    from litgpt import GPT, Config

    cfg = Config.from_name(name, **({"n_layer": n_layer} if n_layer else {}))
    with torch.device("meta"):
        model = GPT(cfg)
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def small_shapes(count: int, smallest: int, largest: int, seed: int = 0) -> list[tuple[int, ...]]:
    """`count` 1-D shapes of smallest..largest elements (inclusive), the same for the same seed."""
    rng = random.Random(seed)
    return [(rng.randint(smallest, largest),) for _ in range(count)]


def cases(a) -> list[dict]:
    """The cases asked for, in --shapes order, each in --dtypes order."""
    out = []
    for kind in a.shapes:
        if kind == "model":
            shapes = model_shapes(a.model, a.n_layer)
            name = a.model + (f" ({a.n_layer} layers)" if a.n_layer else "")
        else:
            shapes = small_shapes(a.small_count, a.small_min, a.small_max)
            name = f"{a.small_count} small"
        for d in a.dtypes:
            out.append({"shape": f"{name} {d}", "case": kind, "model": a.model if kind == "model" else None,
                        "n_layer": a.n_layer if kind == "model" else None, "dtype": d, "precision": PRECISIONS[d],
                        "shapes": shapes})
    return out


def numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def bytes_moved(shapes, dtype: str) -> int:
    """What one update must move: 7 x the element size per element."""
    return BYTES_PER_ELEMENT * DTYPES[dtype].itemsize * numel(shapes)


def make_state(shapes, dtype: torch.dtype, device, seed: int = 0):
    """(params, grads, exp_avgs, exp_avg_sqs): random values of a run a few steps in (exp_avg_sq >= 0)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape, scale):
        return torch.randn(shape, device=device, dtype=dtype, generator=gen).mul_(scale)

    lists = ([], [], [], [])
    for s in shapes:
        lists[0].append(randn(s, 0.02))
        lists[1].append(randn(s, 1e-2))
        lists[2].append(randn(s, 1e-3))
        lists[3].append(randn(s, 1e-2).square_())
    return lists


def tk_update(step: int):
    """tk's update over lists, at `step`."""
    return lambda ps, gs, ms, vs: ops.adamw_step(ps, gs, ms, vs, step=step, **HYPER)


def fused_update(step: int, device):
    """torch's fused update over lists (torch._fused_adamw_, as torch.optim.AdamW(fused=True) calls it after the
    step counts' increment), at `step`."""
    count = torch.tensor(float(step), dtype=torch.float32, device=device)
    return lambda ps, gs, ms, vs: torch._fused_adamw_(
        ps, gs, ms, vs, [], [count] * len(ps), lr=HYPER["lr"], beta1=HYPER["beta1"], beta2=HYPER["beta2"],
        weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], amsgrad=False, maximize=False)


def differing(got: torch.Tensor, want: torch.Tensor) -> tuple[int, float]:
    """(elements that differ, the largest absolute difference); NaN against NaN is no difference."""
    ne = (got != want) & ~(got.isnan() & want.isnan())
    count = int(ne.sum())
    if not count:
        return 0, 0.0
    # a number against NaN: infinitely far
    worst = torch.where(ne, (got.float() - want.float()).abs().nan_to_num(nan=float("inf")), 0.0).max()
    return count, float(worst)


@torch.no_grad()
def check(mine, reference, ps, gs, ms, vs, budget_bytes: float) -> dict:
    """`mine` on (ps, gs, ms, vs) in place and `reference` on copies of ps, ms and vs (sharing the gradients), both
    over the same lists, in groups of tensors whose copies fit in `budget_bytes`; the elements of each state that
    differ afterwards."""
    counts = {k: 0 for k in STATE}
    worst = {k: 0.0 for k in STATE}
    groups, i, n = 0, 0, len(ps)
    while i < n:
        j, size = i, 0
        while j < n and (j == i or size + 3 * ps[j].numel() * ps[j].element_size() <= budget_bytes):
            size += 3 * ps[j].numel() * ps[j].element_size()
            j += 1
        copies = [[t.clone() for t in lst[i:j]] for lst in (ps, ms, vs)]
        reference(copies[0], gs[i:j], copies[1], copies[2])
        mine(ps[i:j], gs[i:j], ms[i:j], vs[i:j])
        for name, got, want in zip(STATE, (ps[i:j], ms[i:j], vs[i:j]), copies):
            for a, b in zip(got, want):
                c, w = differing(a, b)
                counts[name] += c
                worst[name] = max(worst[name], w)
        del copies
        groups += 1
        i = j
    return {"elements": sum(p.numel() for p in ps), "differing": counts, "total_differing": sum(counts.values()),
            "max_abs_diff": worst, "groups": groups}


def optimizers(ps, gs, ms, vs, step: int, device) -> dict:
    """The optimizers timed, over the tensors themselves (grads as .grad, the moments as their state), each at
    step count `step` (their first step makes it step + 1)."""
    for p, g in zip(ps, gs):
        p.grad = g

    def made(cls, counts_on_gpu: bool, **options):
        opt = cls(ps, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                  weight_decay=HYPER["weight_decay"], **options)
        where = device if counts_on_gpu else "cpu"  # as each makes its state: fused on the GPU, the others on the CPU
        for p, m, v in zip(ps, ms, vs):
            opt.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32, device=where), "exp_avg": m,
                            "exp_avg_sq": v}
        return opt

    return {"tk AdamW": made(TkAdamW, False), "fused AdamW": made(torch.optim.AdamW, True, fused=True),
            "foreach AdamW": made(torch.optim.AdamW, False, foreach=True)}


def clipped_ways(opts: dict, ps: list, max_norm: float) -> dict:
    """The clipped updates: each optimizer's step after clipping by the global norm, tk AdamW's own way and
    torch's (which scales the gradients in place: their norm settles at max_norm, the timing unaffected)."""
    tk_adamw, fused_adamw = opts["tk AdamW"], opts["fused AdamW"]

    def tk_clipped():
        tk_adamw.clip_grad_norm_(max_norm)
        tk_adamw.step()

    def torch_clipped():
        torch.nn.utils.clip_grad_norm_(ps, max_norm)
        fused_adamw.step()

    return {"clip + tk AdamW": tk_clipped, "clip + fused AdamW": torch_clipped}


def summarize(case: dict, times: dict[str, list[float]], direct: list[str], **extra) -> dict:
    """A case's row: ms per update (median over rounds) and GB/s per way, the ratios, and `extra` as is."""
    moved = bytes_moved(case["shapes"], case["dtype"])
    ms = {w: statistics.median(t) for w, t in times.items()}
    row = {k: v for k, v in case.items() if k != "shapes"}
    row.update(tensors=len(case["shapes"]), params=numel(case["shapes"]), gb_moved=moved / 1e9)
    for w in [*WAYS, *GRAPHED]:
        row[f"{w} ms"] = ms.get(w)
        row[f"{w} GB/s"] = moved / (ms[w] * 1e-3) / 1e9 if w in ms else None
    for w in CLIPPED:
        row[f"{w} ms"] = ms.get(w)
    for name, (peer, mine) in RATIOS.items():
        row[name] = ms[peer] / ms[mine] if peer in ms and mine in ms else None
    row["timed by direct calls"] = ", ".join(direct) or "-"
    row["ms_rounds"] = times
    row["hyper"], row["step"] = dict(HYPER), STEP
    row.update(extra)
    return row


@torch.no_grad()
def measure(case: dict, a, clocks: ClockSampler, device: torch.device = torch.device("cuda")) -> dict:
    """One case's row: the check (unless --no-check), then every way timed in turns. (`device` other than CUDA:
    for the plumbing's test on a CPU, with tk's update and the timing stood in for.)"""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    ps, gs, ms, vs = make_state(case["shapes"], DTYPES[case["dtype"]], device)
    result = None
    if not a.no_check:
        result = check(tk_update(STEP), fused_update(STEP, device), ps, gs, ms, vs, a.check_budget_gb * 1e9)
        if cuda:
            torch.cuda.empty_cache()  # the copies' blocks
    opts = optimizers(ps, gs, ms, vs, STEP, device)
    tk, fused = tk_update(STEP), fused_update(STEP, device)
    fns = {"tk": lambda: tk(ps, gs, ms, vs), "tk AdamW": opts["tk AdamW"].step,
           "fused": lambda: fused(ps, gs, ms, vs), "fused AdamW": opts["fused AdamW"].step,
           "foreach AdamW": opts["foreach AdamW"].step}
    for fn in fns.values():  # once each before timing: lazy set-up, and tk AdamW's routes
        fn()
    routes = opts["tk AdamW"].route_counts()
    if a.max_norm > 0:  # after the warm-up calls, so that the graphs below capture the plain updates
        fns.update(clipped_ways(opts, ps, a.max_norm))
        for name in CLIPPED:
            fns[name]()
    direct = []
    if not a.no_graphs and cuda:
        for name, way in GRAPHED.items():
            try:
                fns[name] = graphed(fns[way])
            except Exception as e:  # noqa: BLE001  (not capturable: timed by direct calls, and said so)
                torch.cuda.synchronize(device)
                fns[name] = fns[way]
                direct.append(f"{name} ({type(e).__name__})")
    if cuda:
        torch.cuda.synchronize(device)
    t0 = clocks.now()
    times = interleaved_times(fns, rounds=a.rounds, warmup_ms=25, rep_ms=100)
    window = (t0, clocks.now())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    return summarize(case, times, direct, check=result, tk_adamw_routes=routes, peak_gib=peak, _window=window)


def check_line(row: dict) -> str:
    c = row.get("check")
    if not c:
        return f"{row['shape']}: not checked"
    parts = ", ".join(f"{k} {c['differing'][k]}" for k in STATE)
    worst = max(c["max_abs_diff"].values())
    return (f"{row['shape']}: tk vs torch fused after one update: {c['total_differing']} of 3 x {c['elements']} "
            f"elements differ ({parts}; largest |difference| {worst:.3g})")


def finish(a, rows: list[dict]) -> None:
    """The tables, the check's lines, the JSON, the chart (--png) and a one-line summary last."""
    timed = [r for r in rows if not r.get("error")]
    ways = [w for w in [*WAYS, *GRAPHED] if any(r.get(f"{w} ms") is not None for r in timed)]
    clipped = [w for w in CLIPPED if any(r.get(f"{w} ms") is not None for r in timed)]
    ratios = [k for k in RATIOS if any(r.get(k) is not None for r in timed)]
    if timed:
        print("ms per update")
        print_table(timed, ["shape", "tensors", "gb_moved", *[f"{w} ms" for w in ways + clipped]])
        print("\nGB/s (7 x element size per element)")
        print_table(timed, ["shape", *[f"{w} GB/s" for w in ways]])
        print("\npeer / tk (above 1: tk faster)")
        print_table(timed, ["shape", *ratios, "timed by direct calls"])
        print()
    for r in rows:
        print(f"{r['shape']}: FAILED ({r['error']})" if r.get("error") else check_line(r))
    print(f"wrote {write_results(a.json, 'adamw', rows)}")
    if a.png and timed:
        bar_chart(a.png, "AdamW update, GB/s (7 x element size per element)", [r["shape"] for r in timed],
                  {w: [r[f"{w} GB/s"] or 0.0 for r in timed] for w in ways}, "GB/s")
    if timed:  # last: the line gpu_run.sh's summary shows
        checked = [r["check"] for r in timed if r.get("check")]
        print("fused/tk " + ", ".join(f"{r['shape']} {r['fused / tk']:.2f}x" for r in timed)
              + (f"; tk vs fused: {sum(c['total_differing'] for c in checked)} elements differ" if checked else ""))


def main(argv=None) -> None:
    a = arguments(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/adamw.py needs a CUDA GPU")
    rows = []
    with ClockSampler(period_ms=100) as clocks:
        for case in cases(a):
            try:
                rows.append(measure(case, a, clocks))
            except Exception as e:  # noqa: BLE001  (one case that cannot run, e.g. out of memory, costs its row only)
                rows.append({**{k: v for k, v in case.items() if k != "shapes"}, "tensors": len(case["shapes"]),
                             "params": numel(case["shapes"]),
                             "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"})
            print({k: v for k, v in rows[-1].items() if k not in ("ms_rounds", "_window", "hyper")}, flush=True)
            gc.collect()  # the case's tensors, optimizers and graphs
            torch.cuda.empty_cache()
    for r in rows:
        if "_window" in r:
            r["clocks"] = clocks.between(*r.pop("_window"))
    finish(a, rows)


if __name__ == "__main__":
    main()
