"""Checks of tk's collectives that need several GPUs; run by test_collectives_multi_gpu.py under torchrun:

    torchrun --nproc_per_node 2 tests/gpu/collectives_worker.py kernels|timeout|thunder|thunder_graphs

Every rank asserts; a failing rank exits nonzero, which fails the torchrun and the test.
"""

import dataclasses
import os
import re
import sys
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # never NVLink multicast

import torch
import torch.distributed as dist

from thunder_tk import collectives

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def poison_allocator(nbytes: int, device) -> None:
    """Leave NaN-filled blocks in the caching allocator, so a result that skips elements shows NaN."""
    junk = torch.full((max(1, nbytes // 4),), float("nan"), dtype=torch.float32, device=device)
    del junk


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def nccl_all_gather(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def nccl_reduce_scatter(x: torch.Tensor, op) -> torch.Tensor:
    out = torch.empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), op=op)
    return out


def fp64_reduce_scatter(x: torch.Tensor, average: bool) -> torch.Tensor:
    """The exact answer: every rank's input gathered by NCCL, summed in fp64, this rank's slice."""
    w, r = dist.get_world_size(), dist.get_rank()
    everything = nccl_all_gather(x.contiguous().reshape(1, -1)).double()  # (w, numel)
    total = everything.sum(0).reshape(x.shape)
    n = x.shape[0] // w
    mine = total[r * n:(r + 1) * n]
    return mine / w if average else mine


def reduce_scatter_error(got: torch.Tensor, y: torch.Tensor, average: bool) -> tuple[float, float]:
    """(error, bound): got's largest error against the fp64 sum, relative to the sum of magnitudes (what rounding
    error scales with under cancellation), and what fp32 accumulation allows. Half-precision types: one rounding
    to the output type; fp32: w - 1 roundings of partial sums, each within 2^-24 of the magnitudes summed so far."""
    exact = fp64_reduce_scatter(y, average)
    scale = fp64_reduce_scatter(y.abs(), average).clamp_min(1e-30)
    err = ((got.double() - exact).abs() / scale).max().item()
    w = dist.get_world_size()
    return err, {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: (w - 1) * 2 ** -24}[y.dtype]


def check_async_all_gather(ch, device, g) -> None:
    """An async all-gather (`ch`: a Channel, or the module's functions) while the caller's stream computes."""
    x = torch.randn(8 << 20, device=device, dtype=torch.bfloat16, generator=g)
    work, out = ch.all_gather(x, async_op=True)
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(4):
        busy = busy @ busy * 1e-3
    work.wait()
    assert torch.equal(out, nccl_all_gather(x)), "async all_gather differs"


def check_one_gib(ch, device, g) -> None:
    """1 GiB gathered: all-gather bit-identical to NCCL, reduce-scatter within one bf16 rounding of the fp32 sum."""
    w, r = dist.get_world_size(), dist.get_rank()
    x = torch.randn((1 << 29) // w, device=device, dtype=torch.bfloat16, generator=g)
    assert torch.equal(ch.all_gather(x), nccl_all_gather(x)), "1 GiB all_gather differs"
    del x
    y = torch.randn(1 << 29, device=device, dtype=torch.bfloat16, generator=g)
    got = ch.reduce_scatter(y)
    exact = y.float()
    dist.all_reduce(exact)  # fp32 sums: exact enough to judge a bf16 result
    exact = exact[r * got.shape[0]:(r + 1) * got.shape[0]]
    err = ((got.float() - exact).abs() / exact.abs().clamp_min(1e-2)).max().item()
    assert err <= 2 ** -8 * 1.01, f"1 GiB reduce_scatter: rel err {err:.3g}"


# Shard shapes: 1 element, sizes that are not multiples of 16 bytes, multi-dim, tile tails, a few MiB.
SHAPES = [(1,), (3,), (7,), (8,), (4097,), (5, 3, 7), (65536 + 5,), (1 << 20, 3), (3 << 20,)]


def case_kernels(device) -> None:
    w, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator(device=device).manual_seed(1234 + r)
    for dtype in DTYPES:
        for shape in SHAPES:
            x = torch.randn(shape, device=device, dtype=dtype, generator=g)
            poison_allocator(x.numel() * x.element_size() * w * 2, device)
            ours = collectives.all_gather(x)
            assert torch.equal(ours, nccl_all_gather(x)), f"all_gather {dtype} {shape} differs from NCCL"
            # reduce-scatter input: dim 0 divisible by the group
            y = torch.randn((shape[0] * w, *shape[1:]), device=device, dtype=dtype, generator=g)
            for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg")):
                poison_allocator(y.numel() * y.element_size() * 2, device)
                got = collectives.reduce_scatter(y, name)
                err, bound = reduce_scatter_error(got, y, name == "avg")
                assert err <= bound * 1.01, f"reduce_scatter {name} {dtype} {shape}: rel err {err:.3g} > {bound:.3g}"
                # NCCL rounds each partial sum to the input type: with more than two ranks it strays further.
                nccl_err, _ = reduce_scatter_error(nccl_reduce_scatter(y, op), y, name == "avg")
                assert err <= max(nccl_err, bound) * 1.01, f"{name} {dtype} {shape}: {err:.3g} vs NCCL's {nccl_err:.3g}"
        log(f"ok: all_gather bit-identical and reduce_scatter exact to one rounding, {dtype}, {len(SHAPES)} shapes")

    # Strided and transposed inputs are gathered as their contiguous values.
    base = torch.randn(64, 48, device=device, dtype=torch.bfloat16, generator=g)
    for view in (base.t(), base[:, ::3], base[5:37]):
        assert torch.equal(collectives.all_gather(view), nccl_all_gather(view.contiguous()))
    log("ok: strided and transposed views")

    check_async_all_gather(collectives, device, g)
    log("ok: async all_gather with compute in between")

    # Many calls of mixed sizes and both ops through one channel (flags and buffer cells reused throughout).
    for i in range(200):
        n = [1, 1000, 12345, 1 << 18, 3 << 20][i % 5]
        x = torch.full((n,), float(r + i), device=device, dtype=torch.float32)
        if i % 2:
            got = collectives.all_gather(x)
            expect = torch.cat([torch.full((n,), float(q + i), device=device) for q in range(w)])
        else:
            got = collectives.reduce_scatter(torch.cat([x] * w))
            expect = torch.full((n,), float(sum(q + i for q in range(w))), device=device)
        assert torch.equal(got, expect), f"call {i} (n={n}) wrong"
    log("ok: 200 mixed calls on one channel")

    # 1 GiB gathered (the largest size the issue names), through the 64 MiB staging buffer many times over.
    check_one_gib(collectives, device, g)
    log("ok: 1 GiB all_gather and reduce_scatter")

    # Every channel setting is a valid input: extreme sender/receiver splits, 3 slots, tiny units, odd grids.
    # Unpaired blocks (each with every peer), among them the defaults before pairs; with three or more ranks blocks
    # paired with one peer each: lanes of w - 1 blocks (a block count that is not a multiple leaves blocks idle),
    # one lane only, 128 blocks with 2 slots. The module-level calls above ran the defaults (paired, 4 slots).
    settings = [dict(blocks=8, slots=3, ag_sender_warps=1, rs_sender_warps=15, pairs=False),
                dict(blocks=5, slots=2, ag_sender_warps=15, rs_sender_warps=1, min_chunk_bytes=16, pairs=False),
                dict(blocks=128, slots=2, pairs=False),
                dict(blocks=8, slots=2, pairs=True),
                dict(blocks=max(2, w - 1), slots=3, pairs=True, min_chunk_bytes=16),
                dict(blocks=128, slots=2, pairs=True)]
    for cfg in settings:
        ch = collectives.Channel(dist.group.WORLD, device,
                                 collectives.ChannelConfig(buffer_bytes=8 << 20, timeout_s=60.0, **cfg))
        for dtype in DTYPES:
            for shape in ((1,), (7,), (4097,), (65536 + 5,), (3 << 20,)):
                x = torch.randn(shape, device=device, dtype=dtype, generator=g)
                poison_allocator(x.numel() * x.element_size() * w * 2, device)
                assert torch.equal(ch.all_gather(x), nccl_all_gather(x)), f"all_gather {cfg} {dtype} {shape}"
                y = torch.randn((shape[0] * w, *shape[1:]), device=device, dtype=dtype, generator=g)
                poison_allocator(y.numel() * y.element_size() * 2, device)
                err, bound = reduce_scatter_error(ch.reduce_scatter(y, "sum"), y, False)
                assert err <= bound * 1.01, f"reduce_scatter {cfg} {dtype} {shape}: rel err {err:.3g}"
    log(f"ok: {len(settings)} channel settings (sender splits 1/15 and 15/1, 3 slots, 16-byte units, unpaired and "
        f"paired blocks{'' if w > 2 else ': the same as unpaired with two ranks'})")

    # Errors name the problem.
    for bad, msg in ((torch.zeros(3, device=device, dtype=torch.int32), "support"),
                     (torch.zeros(3, device=device), "divisible")):
        try:
            if bad.dtype == torch.int32:
                collectives.all_gather(bad)
            else:
                collectives.reduce_scatter(bad)
        except ValueError as e:
            assert msg in str(e), e
        else:
            raise AssertionError(f"no error for {msg}")
    log("ok: bad inputs raise")

    # Settings that differ between ranks: the same error on every rank before any buffer is made, and the group
    # still works afterwards.
    try:
        collectives.Channel(dist.group.WORLD, device, collectives.ChannelConfig(
            blocks=32 if r == w - 1 else 64, buffer_bytes=8 << 20, timeout_s=60.0))
    except ValueError as e:
        others = f"rank{'s' if w > 2 else ''} {', '.join(map(str, range(w - 1)))}"
        assert f"(blocks): 64 on {others}, 32 on rank {w - 1}" in str(e), e
    else:
        raise AssertionError("no error for settings that differ between ranks")
    x = torch.randn(100, device=device, generator=g)
    assert torch.equal(collectives.all_gather(x), nccl_all_gather(x))
    log("ok: settings that differ between ranks raise on every rank")


def case_copy_engine(device) -> None:
    """The copy-engine path: the same answers as NCCL, through a small buffer (many chunks per call, slots reused
    across calls and ops), mixed with the SM kernels on one channel, asynchronous, and at 1 GiB."""
    w, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator(device=device).manual_seed(4321 + r)
    base = dataclasses.replace(collectives.ChannelConfig.from_env(), timeout_s=60.0, engine="copy",
                               copy_buffer_bytes=1 << 20)
    ch = collectives.Channel(dist.group.WORLD, device, base)
    for dtype in DTYPES:
        for shape in SHAPES:
            x = torch.randn(shape, device=device, dtype=dtype, generator=g)
            poison_allocator(x.numel() * x.element_size() * w * 2, device)
            assert torch.equal(ch.all_gather(x), nccl_all_gather(x)), f"copy-engine all_gather {dtype} {shape}"
            y = torch.randn((shape[0] * w, *shape[1:]), device=device, dtype=dtype, generator=g)
            for name in ("sum", "avg"):
                poison_allocator(y.numel() * y.element_size() * 2, device)
                err, bound = reduce_scatter_error(ch.reduce_scatter(y, name), y, name == "avg")
                assert err <= bound * 1.01, f"copy-engine reduce_scatter {name} {dtype} {shape}: {err:.3g} > {bound:.3g}"
    base_view = torch.randn(64, 48, device=device, dtype=torch.bfloat16, generator=g)
    for view in (base_view.t(), base_view[:, ::3], base_view[5:37]):
        assert torch.equal(ch.all_gather(view), nccl_all_gather(view.contiguous()))
    log(f"ok: copy engine: all_gather bit-identical, reduce_scatter exact to one rounding, {len(SHAPES)} shapes, "
        "3 dtypes, strided views, 1 MiB buffer")

    # Both ops back to back with no host wait between them, one rank made to lag now and then: they share the
    # staging slots, so no sender may overwrite a chunk that a slower receiver has yet to use, whichever op staged it.
    queued = []
    for i in range(60):
        n = [5000, 40000, 1 << 16][i % 3]
        if r == 0 and i % 7 == 0:
            torch.cuda._sleep(200_000)
        x = torch.full((n,), float(7 * r + i), device=device, dtype=torch.float32)
        queued.append((ch.all_gather(x), torch.cat([torch.full((n,), float(7 * q + i), device=device)
                                                    for q in range(w)]), f"all_gather {i}"))
        y = torch.full((n * w,), float(r + i), device=device, dtype=torch.float32)
        queued.append((ch.reduce_scatter(y), torch.full((n,), float(sum(q + i for q in range(w))), device=device),
                       f"reduce_scatter {i}"))
    for got, expect, what in queued:
        assert torch.equal(got, expect), f"back-to-back {what} wrong"
    log("ok: copy engine: 120 all_gather and reduce_scatter calls back to back through shared slots")

    # One channel choosing per call ("auto" from 64 KiB gathered): SM kernels and copy engines interleaved, on the
    # caller's stream and asynchronously, each call's data checked.
    mixed = collectives.Channel(dist.group.WORLD, device,
                                dataclasses.replace(base, engine="auto", copy_min_bytes=64 << 10))
    pending = []
    for i in range(200):
        n = [1, 1000, 12345, 1 << 18, 3 << 20][i % 5]
        x = torch.full((n,), float(r + i), device=device, dtype=torch.float32)
        if i % 2:
            expect = torch.cat([torch.full((n,), float(q + i), device=device) for q in range(w)])
            if i % 3 == 0:
                work, got = mixed.all_gather(x, async_op=True)
                pending.append((work, got, expect, i))
                continue
            got = mixed.all_gather(x)
        else:
            got = mixed.reduce_scatter(torch.cat([x] * w))
            expect = torch.full((n,), float(sum(q + i for q in range(w))), device=device)
        assert torch.equal(got, expect), f"mixed call {i} (n={n}) wrong"
    for work, got, expect, i in pending:
        work.wait()
        assert torch.equal(got, expect), f"async mixed call {i} wrong"
    log("ok: 200 calls mixing SM kernels and copy engines on one channel, sync and async")

    # Under CUDA-graph capture a copy-engine channel launches its SM kernels (the copy engines' flags carry host-side
    # sequence numbers, which a replay would not advance): captured once, replayed with fresh inputs.
    x_in = torch.zeros(3000, device=device, dtype=torch.bfloat16)
    y_in = torch.zeros(3000 * w, device=device, dtype=torch.float32)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph, stream=side):
        gathered = ch.all_gather(x_in)
        scattered = ch.reduce_scatter(y_in)
    for i in range(5):
        x_in.fill_(float(r + i))
        y_in.fill_(float(r + 2 * i))
        ch.graph_replay()
        graph.replay()
        ch.graph_replay()
        expect = torch.cat([torch.full((3000,), float(q + i), device=device, dtype=torch.bfloat16) for q in range(w)])
        assert torch.equal(gathered, expect), f"captured all_gather on a copy-engine channel, replay {i}"
        total = float(sum(q + 2 * i for q in range(w)))
        assert torch.equal(scattered, torch.full((3000,), total, device=device)), f"captured reduce_scatter, replay {i}"
    assert torch.equal(ch.all_gather(x_in), expect)  # the copy engines again, after the replays
    log("ok: copy-engine channel captured in a CUDA graph: SM kernels, 5 replays with fresh inputs")

    # Async with compute in between, and 1 GiB through the default copy buffer.
    big = collectives.Channel(dist.group.WORLD, device, dataclasses.replace(base, copy_buffer_bytes=256 << 20))
    check_async_all_gather(big, device, g)
    check_one_gib(big, device, g)
    log("ok: copy engine async with compute, and 1 GiB all_gather and reduce_scatter")


def case_small(device) -> None:
    """A few shapes of each op and dtype (for compute-sanitizer, which is slow)."""
    r = dist.get_rank()
    for dtype in DTYPES:
        for shape in ((1,), (4097,), (5, 3, 7), (70000,)):
            x = torch.randn(shape, device=device, dtype=dtype) + r
            assert torch.equal(collectives.all_gather(x), nccl_all_gather(x))
            y = torch.cat([x] * dist.get_world_size())
            # Against the fp64 sum: with more than two ranks NCCL's own partial sums are rounded to the input type
            # (a bf16 sum near zero can then differ from ours by more than any fixed tolerance).
            err, bound = reduce_scatter_error(collectives.reduce_scatter(y), y, False)
            assert err <= bound * 1.01, f"reduce_scatter {dtype} {shape}: rel err {err:.3g} > {bound:.3g}"
    # The copy-engine path's kernels (the receiver's copy and sum), through a 1 MiB buffer: the largest shape takes
    # several chunks, and the odd ones misaligned words.
    ce = collectives.Channel(dist.group.WORLD, device, dataclasses.replace(
        collectives.ChannelConfig.from_env(), engine="copy", copy_buffer_bytes=1 << 20))
    for dtype in DTYPES:
        for shape in ((1,), (4097,), (5, 3, 7), (300000,)):
            x = torch.randn(shape, device=device, dtype=dtype) + r
            assert torch.equal(ce.all_gather(x), nccl_all_gather(x)), f"copy-engine all_gather {dtype} {shape}"
            y = torch.cat([x] * dist.get_world_size())
            err, bound = reduce_scatter_error(ce.reduce_scatter(y), y, False)
            assert err <= bound * 1.01, f"copy-engine reduce_scatter {dtype} {shape}: {err:.3g} > {bound:.3g}"
    log("ok: small")


def case_timeout(device) -> None:
    """Rank 0 calls a collective that no other rank joins: a clear error after the timeout, naming a peer it waited
    for (which one depends on the order it waits in: with 4 ranks it is rank 3), no hang."""
    group = dist.new_group(list(range(dist.get_world_size())))
    ch = collectives.Channel(group, device, collectives.ChannelConfig(blocks=4, buffer_bytes=8 << 20, timeout_s=2.0))
    if dist.get_rank() == 0:
        x = torch.ones(1 << 20, device=device)
        t0 = time.monotonic()
        work, _ = ch.all_gather(x, async_op=True)
        torch.cuda.synchronize(device)
        waited = time.monotonic() - t0
        assert 1.5 < waited < 60, f"kernel returned after {waited:.1f} s"
        for attempt in (lambda: work.wait(), lambda: ch.all_gather(x)):
            try:
                attempt()
            except collectives.CollectiveTimeoutError as e:
                text = str(e)
                waited_for = re.search(r"waiting for rank (\d+)\b", text)
                assert "timed out" in text and "all_gather" in text and waited_for, text
                assert 0 < int(waited_for.group(1)) < dist.get_world_size(), text
            else:
                raise AssertionError("no CollectiveTimeoutError")
        print(f"ok: timeout after {waited:.1f} s: {text}", flush=True)
    dist.barrier()
    # The default channel (another group) is unaffected.
    x = torch.full((5,), float(dist.get_rank()), device=device)
    assert torch.equal(collectives.all_gather(x), nccl_all_gather(x))
    log("ok: other channels still work")


def case_thunder(device) -> None:
    """Thunder FSDP with executors=[tk]: tk claims the collectives, waits stay late (overlap), grads match."""
    import thunder
    from thunder.distributed import fsdp

    import thunder_tk
    from thunder_tk import tk

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from models import Block

    torch.manual_seed(0)
    x = torch.randn(2, 128, 256, device=device)
    losses = {}
    for mode in ("torch", "tk"):
        if mode == "torch":
            os.environ["THUNDER_TK_DISABLE"] = "collective"
        else:
            os.environ.pop("THUNDER_TK_DISABLE", None)
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(256, 4), Block(256, 4)).to(device)
        jm = fsdp(thunder.jit(model, executors=[tk]))
        opt = torch.optim.SGD(jm.parameters(), lr=0.1)
        losses[mode] = []
        for _ in range(30):
            loss = jm(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[mode].append(loss.item())
        fwd = str(thunder.last_traces(jm)[-1])
        bwd = str(thunder.last_backward_traces(jm)[-1])
        report = thunder_tk.explain(jm)
        colls = [d for d in report.rows if d.symbol in ("all_gather", "reduce_scatter")]
        assert colls, "explain lists no collectives"
        if mode == "tk":
            assert "tk_all_gather" in fwd and "tk_reduce_scatter" in bwd, "tk did not run the collectives"
            assert all(d.claimed_by_tk for d in colls), [(d.symbol, d.reason) for d in colls]
            lines = [ln.strip() for ln in fwd.splitlines()]
            gathers = [i for i, ln in enumerate(lines) if "= tk_all_gather(" in ln]
            waits = [i for i, ln in enumerate(lines) if "= torch_wait_prim_impl(" in ln]
            assert gathers and waits and max(gathers) < max(waits)
            # Overlap: between the last all_gather issued and the last wait there is compute.
            between = [ln for ln in lines[max(gathers) + 1:max(waits)] if ln and not ln.startswith("#")
                       and "torch_wait_prim_impl" not in ln]
            assert between, "no work between the all_gathers and their waits"
            if dist.get_rank() == 0:
                print("forward execution trace (excerpt: tk's all_gathers are issued first, waits sit next to "
                      "their first use):")
                for ln in lines[gathers[0]:max(waits) + 2]:
                    if ln and not ln.startswith("#"):
                        print("   ", ln[:150])
        else:
            assert "tk_all_gather" not in fwd and "torch_all_gather_prim_impl" in fwd
            assert all(not d.claimed_by_tk and "THUNDER_TK_DISABLE" in d.reason for d in colls), colls
    for a, b in zip(losses["torch"], losses["tk"]):
        assert abs(a - b) <= 1e-3 * abs(a) + 1e-6, (losses["torch"], losses["tk"])
    log(f"ok: FSDP 30 steps, losses with NCCL {losses['torch'][0]:.5f}..{losses['torch'][-1]:.5f}, "
        f"with tk {losses['tk'][0]:.5f}..{losses['tk'][-1]:.5f}")


def case_thunder_graphs(device) -> None:
    """Thunder FSDP with executors=[tk] captured as CUDA graphs (thunder_tk.CUDAGraphs), ZeRO-2 and ZeRO-3, two
    micro-batches a step: tk's collectives and their waits run inside the graphs (none outside), and the losses and
    the parameters after every step are those of the op-by-op step. Also with a reduce-scatter budget of 64 KiB
    (THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB: the backward's graph waits for older reduce-scatters early), and with tk's
    collectives turned off (NCCL's outside the graphs, the graphs between them)."""
    import thunder
    from thunder.distributed import FSDPType, fsdp

    import thunder_tk
    from thunder_tk import tk

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from models import Block
    from trace_counts import collectives_in, waits_before_last

    tk_names = ("tk_all_gather", "tk_reduce_scatter")
    nccl_names = ("torch_all_gather_prim_impl", "torch_reduce_scatter_prim_impl")

    budget_env = "THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB"
    for strategy in (FSDPType.ZERO2, FSDPType.ZERO3):
        runs = {}
        for mode in ("op by op", "graphs", "graphs, 64 KiB of reduce-scatters", "graphs, NCCL"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(Block(256, 4), Block(256, 4)).to(device, torch.bfloat16)
            transforms = [thunder_tk.CUDAGraphs()] if mode.startswith("graphs") else []
            options = {"tk_disable": "collective"} if mode.endswith("NCCL") else {}
            if "KiB" in mode:
                os.environ[budget_env] = "0.0625"
            else:
                os.environ.pop(budget_env, None)
            jm = fsdp(thunder.jit(model, executors=[tk], transforms=transforms, **options), sharding_strategy=strategy)
            opt = torch.optim.AdamW(jm.parameters(), lr=1e-3)
            g = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
            losses, params = [], []
            torch.cuda.reset_peak_memory_stats(device)
            for _ in range(8):
                for _micro in range(2):
                    x = torch.randn(2, 128, 256, device=device, dtype=torch.bfloat16, generator=g)
                    loss = jm(x).float().pow(2).mean()
                    loss.backward()
                    losses.append(loss.item())
                opt.step()
                opt.zero_grad()
                params.append(torch.cat([p.detach().float().flatten() for p in jm.parameters()]))
            fw, bw = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
            names = nccl_names if mode.endswith("NCCL") else tk_names
            runs[mode] = losses, params, collectives_in(fw, names), collectives_in(bw, names), \
                torch.cuda.max_memory_allocated(device) / 2**20, waits_before_last(bw, "tk_reduce_scatter")
        os.environ.pop(budget_env, None)
        want, want_p = runs["op by op"][:2]
        for mode in ("graphs", "graphs, 64 KiB of reduce-scatters", "graphs, NCCL"):
            got, got_p, fw_in, bw_in, peak, waits = runs[mode]
            if mode.endswith("NCCL"):  # NCCL's collectives stay outside the graphs
                assert fw_in[0] == 0 and fw_in[1] > 0, f"{mode}, forward: NCCL inside/outside the graphs {fw_in}"
                assert bw_in[0] == 0 and bw_in[1] > 0, f"{mode}, backward: NCCL inside/outside the graphs {bw_in}"
            else:
                assert fw_in[0] > 0 and fw_in[1] == 0, f"{mode}, forward: tk collectives inside/outside {fw_in}"
                assert bw_in[0] > 0 and bw_in[1] == 0, f"{mode}, backward: tk collectives inside/outside {bw_in}"
            if "KiB" in mode:  # each block's gradients pass 64 KiB: the waits move up
                assert waits > 0, f"{mode}: no wait before the last reduce-scatter"
            for a, b in zip(want, got):
                assert abs(a - b) <= 1e-3 * abs(a) + 1e-6, (strategy, mode, want, got)
            for step, (a, b) in enumerate(zip(want_p, got_p)):
                assert (a - b).abs().max().item() <= 1e-2 * a.abs().max().item(), (strategy, mode, step)
            log(f"ok: FSDP {strategy.name} in CUDA graphs ({mode}), 8 steps of 2 micro-batches: losses "
                f"{got[0]:.5f}..{got[-1]:.5f} as op by op; collectives in the graphs: forward {fw_in[0]}, backward "
                f"{bw_in[0]}, waits moved up {waits}; peak {peak:.0f} MiB (op by op {runs['op by op'][4]:.0f})")


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        for case in sys.argv[1:]:
            globals()[f"case_{case}"](device)
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
