"""Representative launches of every kernel, for compute-sanitizer (memcheck, racecheck).

SANITIZE_ONLY=<section>[,<section>...] runs only those sections (names: the functions below), e.g. after a change
that touches one kernel family: `SANITIZE_ONLY=cross_entropy,cross_entropy_forward_grad`.
"""

import faulthandler
import os

import torch

from thunder_tk import ops


def attention_bwd_delta():
    for shape, dtype in [((2, 3, 17, 128), torch.bfloat16), ((1, 2, 9, 257), torch.float16), ((3, 1, 65, 8), torch.float32),
                         ((1, 4, 1000, 64), torch.bfloat16)]:
        o = torch.randn(shape, device="cuda", dtype=dtype)
        g = torch.randn_like(o)
        ops.attention_bwd_delta(o, g, zero=torch.empty(shape, device="cuda") if shape[-1] % 4 == 0 else None)
    # 1 and 2 rows a group, a block per step and resident, on the flat and the strided path (the forward's o beside a
    # contiguous grad_o), over several passes of the resident grid.
    for o, g in [(torch.randn(2, 4, 3001, 128, device="cuda", dtype=torch.bfloat16),) * 2,
                 (torch.randn(1, 2001, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
                  torch.randn(1, 8, 2001, 64, device="cuda", dtype=torch.bfloat16))]:
        for rows in (1, 2):
            for resident in (False, True):
                ops.attention_bwd_delta(o, g, zero=torch.empty(o.shape, device="cuda"), _tuning=(rows, resident))
    flat = torch.randn(1 + 2 * 3 * 11 * 64, device="cuda", dtype=torch.bfloat16)
    o = flat[1:].view(2, 3, 11, 64)
    ops.attention_bwd_delta(o, o, zero=torch.empty(2, 3, 11, 64, device="cuda"))
    torch.cuda.synchronize()
    print("attention_bwd_delta sanitize targets ran")


# GEMM: every operand major, tails in M/N/K, bias.
def gemm():
    for M, N, K in [(129, 257, 72), (64, 300, 128)]:
        for a in (torch.randn(M, K, device="cuda", dtype=torch.bfloat16), torch.randn(K, M, device="cuda", dtype=torch.bfloat16).t()):
            for b in (torch.randn(K, N, device="cuda", dtype=torch.bfloat16), torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()):
                ops.gemm(a, b, torch.randn(N, device="cuda", dtype=torch.bfloat16))
                ops.gemm(a, b, _schedule="dynamic")
                ops.gemm(a, b, _cluster=2)
                ops.gemm(a, b, torch.randn(N, device="cuda", dtype=torch.bfloat16), _pingpong=1)
                ops.gemm(a, b, _pingpong=1, _schedule="dynamic")
                ops.gemm(a, b, torch.randn(N, device="cuda", dtype=torch.bfloat16), _epilogue=1)
                ops.gemm(a, b, _epilogue=1, _schedule="dynamic")
                ops.gemm(a, b, torch.randn(N, device="cuda", dtype=torch.bfloat16), _epilogue=3)
    # The TMA-store epilogue (N % 8 == 0) with more tiles (153) than blocks, so a block stages tile after tile.
    a = torch.randn(1100, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 4104, device="cuda", dtype=torch.bfloat16)
    for schedule in ("static", "dynamic"):
        ops.gemm(a, b, torch.randn(4104, device="cuda", dtype=torch.bfloat16), _schedule=schedule)
        # Store warps: each consumer warpgroup hands its staged rows over once per tile.
        ops.gemm(a, b, torch.randn(4104, device="cuda", dtype=torch.bfloat16), _schedule=schedule, _epilogue=1)
        ops.gemm(a.t().contiguous().t(), b.t().contiguous().t(), _schedule=schedule, _epilogue=1)
        ops.gemm(a, b, torch.randn(4104, device="cuda", dtype=torch.bfloat16), _schedule=schedule, _tile_n=128)
        ops.gemm(a.t().contiguous().t(), b.t().contiguous().t(), _schedule=schedule, _tile_n=128)
        # Ping-pong: 297 tiles of 128 x 128, so each consumer warpgroup of a block takes one or two, and the dynamic
        # schedule's end markers land in either's slot.
        ops.gemm(a, b, torch.randn(4104, device="cuda", dtype=torch.bfloat16), _schedule=schedule, _pingpong=1)
        ops.gemm(a.t().contiguous().t(), b.t().contiguous().t(), _schedule=schedule, _pingpong=1)
    # Stream-K: the tiles cut into k-block ranges, partial sums handed over through the workspace (153 tiles on 132
    # blocks, all in the tail; 4 tiles of 16 k-blocks, 3 pieces each), through every epilogue and both tile widths.
    for M, N, K in [(1100, 4104, 520), (129, 264, 1000)]:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ops.gemm(a, b, torch.randn(N, device="cuda", dtype=torch.bfloat16), _stream_k=1)
        ops.gemm(a, b, _stream_k=1, _epilogue=1)
        ops.gemm(a.t().contiguous().t(), b.t().contiguous().t(), _stream_k=1, _tile_n=128)
        ops.gemm(a[:, : K - 8], b[: K - 8, : N - 1], _stream_k=1)  # register epilogue, K tail
    torch.cuda.synchronize()
    print("gemm sanitize targets ran")


def gemm_skinny():
    # few rows: split K (two of the splits' partial sums meet in the workspace), one split, bias, both weight majors
    for M, N, K in ((1, 4104, 4096), (17, 130, 1000), (64, 300, 72)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ops.gemm(a, w.t(), torch.randn(N, device="cuda", dtype=torch.bfloat16), _skinny=1)
        ops.gemm(a, w.t().contiguous(), _skinny=1)
    torch.cuda.synchronize()
    print("gemm_skinny sanitize targets ran")


# SwiGLU's one launch: tails in M and N, and 160 tiles (more than a block each) with both schedules.
def gemm_swiglu():
    for M, K, N in ((130, 72, 264), (1024, 64, 2560)):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w1, w2 = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ops.swiglu_linear(x, w1, w2)
        ops.swiglu_linear(x, w1, w2, _schedule="dynamic")
        # The backward's launch: dh1, dh2 from dg = x @ w (tiles of 128 columns, several a block at N = 2560), with
        # the consumers taking whole tiles in turns (the default) and sharing each.
        h1, h2 = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ops.matmul_swiglu_grad(x, w, h1, h2)
        ops.matmul_swiglu_grad(x, w, h1, h2, _pingpong=-1)
    # Ping-pong with about four tiles a block, so that each warpgroup takes several turns at the one staging.
    x = torch.randn(2048, 64, device="cuda", dtype=torch.bfloat16)
    h1, h2 = (torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ops.matmul_swiglu_grad(x, torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16), h1, h2)
    torch.cuda.synchronize()
    print("gemm_swiglu sanitize targets ran")


# Tile-library unit kernels: register tiles and shared vectors, wgmma with A in registers, ldmatrix into an A
# fragment, TMA reduce-store, the block-wide sum.
def tile_library():
    from thunder_tk import _extension

    _st = _extension.extension().selftest
    _s = torch.cuda.current_stream().cuda_stream
    x = torch.randn(64, 128, device="cuda")
    outs = [torch.empty(64, 128, device="cuda"), torch.empty(64, device="cuda"), torch.empty(64, device="cuda")]
    _st.row_softmax(x.data_ptr(), outs[0].data_ptr(), outs[1].data_ptr(), outs[2].data_ptr(), 128, _s)
    a = x[:, :64].contiguous()  # every buffer a kernel reads or writes stays named until it has run
    for mn_major in (False, True):
        b = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
        _st.mma_registers_a(a.data_ptr(), b.data_ptr(), outs[0].data_ptr(), 128, mn_major, 0, _s)
    tile16 = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    loaded = torch.empty_like(tile16)
    _st.load_matrices(tile16.data_ptr(), loaded.data_ptr(), 128, 0, _s)
    dst = torch.randn(100, 72, device="cuda")
    src = torch.randn(64, 32, device="cuda")
    _st.reduce_add(dst.data_ptr(), src.data_ptr(), 2, 100, 68, 72, 60, 40, _s)
    sums = torch.randn(3, 1024, device="cuda")
    summed = torch.empty_like(sums)
    _st.block_sum(sums.data_ptr(), summed.data_ptr(), 3, 1024, _s)  # racecheck: the slots' reuse
    torch.cuda.synchronize()
    print("tile-library sanitize targets ran")


# Attention forward: tails in both lengths, causal, grouped-query heads, a transposed (B, S, H, D) view, D 64/128/256.
# (2, 20, 10, 600, ...): 160 tiles of 192 rows, more than the H100's 132 blocks, so blocks of the persistent grid take
# several.
def attention_forward():
    for B, Hq, Hkv, Sq, Sk, D, causal in [(1, 4, 2, 129, 129, 128, True), (2, 2, 1, 70, 300, 64, False), (1, 1, 1, 1, 1, 64, False),
                                          (2, 20, 10, 600, 600, 64, True),
                                          (1, 2, 1, 2200, 2200, 64, True),  # 192-row tiles, the first from row -64
                                          (1, 4, 2, 129, 129, 256, True), (2, 2, 1, 70, 300, 256, False)]:
        q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
        ops.attention_forward(q, k, torch.randn_like(k), is_causal=causal)
    # The last wave split by keys (a capped grid leaves a part-filled last wave): halves with a query tail, quarters.
    for B, Hq, Hkv, Sq, Sk, D, grid in [(1, 3, 3, 130, 9000, 128, 4), (1, 5, 5, 100, 8300, 128, 4)]:
        q, k = (torch.randn(B, h, s, D, device="cuda", dtype=torch.bfloat16) for h, s in ((Hq, Sq), (Hkv, Sk)))
        ops.attention_forward(q, k, torch.randn_like(k), _max_blocks=grid)
    # D = 256: its one Q buffer handed back between tiles, two blocks walking 54 causal tiles.
    q, k = (torch.randn(3, 3, 700, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ops.attention_forward(q, k, torch.randn_like(k), is_causal=True, _max_blocks=2)
    torch.cuda.synchronize()
    print("attention sanitize targets ran")


# Attention backward: causal with tails and GQA, and a non-causal key tail; each GQA group whole and split in parts.
# (1, 4, 1, 400, ...) at D = 256: blocks walk up to 28 steps, so each ring stage carries several steps' staged dQ.
def attention_backward():
    for B, Hq, Hkv, Sq, Sk, D, causal in [(1, 4, 2, 129, 129, 128, True), (1, 2, 1, 70, 150, 64, False),
                                          (2, 8, 2, 200, 200, 64, True),
                                          (1, 4, 2, 129, 129, 256, True), (1, 2, 1, 70, 150, 256, False),
                                          (1, 4, 1, 400, 400, 256, True)]:
        q, k, v = (torch.randn(B, h, s, D, device="cuda", dtype=torch.bfloat16) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
        o, lse = ops.attention_forward(q, k, v, is_causal=causal)
        # Each call after the first takes the dQ accumulator the kernel before it zeroed (dq_zero_mode "ahead").
        for split in sorted({1, 2, Hq // Hkv} & set(range(1, Hq // Hkv + 1))):
            ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), is_causal=causal, _group_split=split)
        # dQ rounded by groups as the kernel counts them in, beside its last blocks
        ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), is_causal=causal, _group_split=1,
                               _dq_finalize="overlap")
        if not causal and D != 256:  # the last wave split: units from 1 on walked in query ranges and merged
            ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), _tail_split=(1, 2))
            ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), _group_split=1, _tail_split=(1, 2),
                                   _dq_finalize="overlap")
    # 68 units all in fifths: 340 parts, several rounds on any Hopper part, as the protocol's S >= 8192 takes them.
    q, k, v = (torch.randn(1, 17, s, 128, device="cuda", dtype=torch.bfloat16) for s in (640, 512, 512))
    o, lse = ops.attention_forward(q, k, v)
    ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), _tail_split=(0, 5))
    ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), _group_split=1, _tail_split=(0, 5),
                           _dq_finalize="overlap")
    torch.cuda.synchronize()
    print("attention backward sanitize targets ran")


# Causal sliding windows (query i keeps keys i - W < j <= i), forward and backward: windows of one key, under, at and
# over a key block, tiles starting past key block 0, rows whose first visited blocks hold none of their keys, a
# transposed view, capped grids (blocks walk several tiles), GQA groups whole and in parts, D 64/128/256.
def attention_window():
    for B, Hq, Hkv, S, D, W, grid in [(1, 4, 2, 300, 64, 7, 0), (2, 2, 1, 700, 128, 129, 2), (1, 2, 2, 300, 256, 64, 0),
                                      (1, 3, 3, 2100, 64, 200, 3), (1, 2, 1, 513, 128, 1, 0),
                                      (1, 4, 1, 400, 256, 128, 2)]:
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        o, lse = ops.attention_forward(q, k, v, is_causal=True, window=W, _max_blocks=grid)
        for split in sorted({1, Hq // Hkv}):
            ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), is_causal=True, window=W, _group_split=split)
    torch.cuda.synchronize()
    print("attention window sanitize targets ran")


# The attention backward into the qkv projection's gradient: causal GQA with tails and the whole head rotated, a
# quarter-width rotation with fp32 angles, no rotation, D = 128 and 256, a group split in parts and a last-wave split
# (dk, dv summed or merged into their strided columns, then rotated in place).
def attention_qkv_grad():
    for B, Hq, Hkv, S, D, causal, n, angle_dtype, kw in [
            (2, 8, 2, 129, 64, True, 64, torch.bfloat16, {}),
            (1, 4, 1, 70, 128, False, 32, torch.float32, {}),
            (1, 4, 2, 200, 64, True, 0, torch.bfloat16, {}),
            (1, 2, 1, 77, 256, True, 256, torch.bfloat16, {}),
            (1, 8, 2, 300, 64, True, 64, torch.bfloat16, {"_group_split": 2}),
            (1, 4, 2, 150, 64, False, 64, torch.bfloat16, {"_tail_split": (1, 2)})]:
        W = (Hq + 2 * Hkv) * D
        qkv = torch.randn(B, S, W, device="cuda", dtype=torch.bfloat16)
        q, k, v = ops.qkv_head_views(qkv, Hq, Hkv, D)
        o, lse = ops.attention_forward(q, k, v, is_causal=causal)
        cos, sin = (torch.rand(S + 3, n, device="cuda").to(angle_dtype) for _ in "cs")
        ops.attention_backward_qkv(q, k, v, o, lse, torch.randn_like(o), cos, sin, is_causal=causal, **kw)
    torch.cuda.synchronize()
    print("attention qkv gradient sanitize targets ran")


# The qkv projection with the rope in its epilogue: each tile path (256 wide with the consumers' or the store warps'
# epilogue, 128 wide), row tails, a partial rope, 128- and 256-wide heads, and a table slice of a wider one, with bf16
# and fp32 tables.
def gemm_rope():
    for B, S, K, Hq, Hkv, D, n, knobs in [(2, 129, 128, 8, 2, 64, 64, {}),
                                         (1, 300, 256, 8, 2, 64, 64, {"_tile_n": 256, "_epilogue": 1}),
                                         (1, 200, 128, 4, 2, 128, 128, {"_tile_n": 128}),
                                         (1, 70, 64, 4, 2, 64, 16, {}),
                                         (1, 50, 64, 2, 1, 256, 256, {})]:
        x = torch.randn(B, S, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn((Hq + 2 * Hkv) * D, K, device="cuda", dtype=torch.bfloat16)
        for tables in (torch.bfloat16, torch.float32):  # fp32: bf16-mixed training's tables
            cos, sin = (torch.rand(S + 3, 2 * n, device="cuda").to(tables)[:, :n] for _ in "cs")
            ops.linear_rope(x, w, cos, sin, Hq, Hkv, D, **knobs)
    torch.cuda.synchronize()
    print("gemm rope sanitize targets ran")


# Two products summed in one launch: ragged k-blocks on both sides, every operand major, each tile path and schedule,
# a cluster, stream-K and a bias.
def gemm_sum():
    bf16 = torch.bfloat16
    for M, N, K, K2 in [(129, 264, 72, 136), (1100, 4104, 64, 520)]:
        for a_rows in (True, False):
            for b_rows in (True, False):
                a, a2 = (torch.randn(M, k, device="cuda", dtype=bf16) if a_rows else
                         torch.randn(k, M, device="cuda", dtype=bf16).t() for k in (K, K2))
                b, b2 = (torch.randn(k, N, device="cuda", dtype=bf16) if b_rows else
                         torch.randn(N, k, device="cuda", dtype=bf16).t() for k in (K, K2))
                bias = torch.randn(N, device="cuda", dtype=bf16)
                for knobs in ({}, {"_schedule": "dynamic"}, {"_tile_n": 128}, {"_pingpong": 1}, {"_epilogue": 1},
                              {"_cluster": 2}, {"_stream_k": 1}):
                    ops.gemm_sum(a, b, a2, b2, bias if not knobs else None, **knobs)
    torch.cuda.synchronize()
    print("gemm sum sanitize targets ran")


# fp32 output (bf16 operands): tails, every operand major, each tile path and schedule that takes it, stream-K,
# a summed second product, a bias, and outputs off 16 bytes (the register path).
def gemm_fp32_out():
    bf16, f32 = torch.bfloat16, torch.float32
    for M, N, K in [(129, 264, 72), (1100, 4104, 520)]:
        for a_rows in (True, False):
            for b_rows in (True, False):
                a = torch.randn(M, K, device="cuda", dtype=bf16) if a_rows else \
                    torch.randn(K, M, device="cuda", dtype=bf16).t()
                b = torch.randn(K, N, device="cuda", dtype=bf16) if b_rows else \
                    torch.randn(N, K, device="cuda", dtype=bf16).t()
                bias = torch.randn(N, device="cuda", dtype=bf16)
                for knobs in ({}, {"_schedule": "dynamic"}, {"_tile_n": 128}, {"_tile_n": 256}, {"_stream_k": 1},
                              {"_epilogue": 3}):
                    ops.gemm(a, b, bias if not knobs else None, out_dtype=f32, **knobs)
                ops.gemm_sum(a, b, a, b, out_dtype=f32)
                ops.gemm(a, b, out=torch.empty(M, N + 1, device="cuda")[:, :N], out_dtype=f32)
    torch.cuda.synchronize()
    print("gemm fp32 output sanitize targets ran")


# The embedding's weight gradient: vectors and scalars, repeated ids, a padding row, ids outside the table, strided
# incoming rows.
def embedding_backward():
    for tokens, rows, D, span, dtype, pad in [(300, 1000, 256, 1000, torch.bfloat16, -1),
                                              (500, 50, 64, 5, torch.float32, 3), (77, 120, 100, 130, torch.float16, 0)]:
        ids = torch.randint(-2, span, (tokens,), device="cuda")
        grad = torch.randn(tokens, 2 * D, device="cuda").to(dtype)[:, :D]
        ops.embedding_backward(grad, ids, rows, pad)
    torch.cuda.synchronize()
    print("embedding backward sanitize targets ran")


# RMSNorm forward and backward, without and with the residual (its add, and its gradient added to dx): each vector
# width (V = 1, four groups a block: n 8, 200, 2048; V = 2: 2056; V = 4: 5120, 8192; V = 8: 8200, 16384), a row and a
# few (groups of a block left idle), and enough rows that groups of the persistent grid take several (8192 x 64 and
# 1000-row cases: the next-row prefetch, the alternating reduction slots, the weight gradient's per-block partial sums
# and the groups' hand-over to group 0); weights bf16, fp16 and fp32; wide and copied strided rows; no rows.
def rms_norm():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    for rows, n, dtype, wdtype in [(3, 8, bf16, bf16), (17, 200, fp16, fp32), (8192, 64, bf16, bf16),
                                   (1000, 2048, bf16, fp32), (1, 2056, bf16, fp16), (1000, 2056, fp16, bf16),
                                   (1000, 5120, bf16, bf16), (5, 8192, fp16, fp16), (3, 8200, bf16, fp32),
                                   (1000, 16384, bf16, bf16)]:
        x, r, dy, dres = (torch.randn(rows, n, device="cuda").to(dtype) for _ in range(4))
        w = (1 + 0.5 * torch.randn(n, device="cuda")).to(wdtype)
        y, rstd = ops.rms_norm(x, w, 1e-5)
        ops.rms_norm_backward(dy, x, rstd, w)
        y, rstd, s = ops.rms_norm(x, w, 1e-5, residual=r)
        ops.rms_norm_backward(dy, s, rstd, w, residual_grad=dres)
    # Rows read in place from wider rows (stride n + 64), and rows off whole vectors (stride n + 4, copied).
    for pad in (64, 4):
        x, r, dy, dres = (torch.randn(300, 1000 + pad, device="cuda").to(torch.bfloat16)[:, :1000] for _ in range(4))
        w = torch.randn(1000, device="cuda").to(torch.bfloat16)
        y, rstd, s = ops.rms_norm(x, w, 1e-5, residual=r)
        ops.rms_norm_backward(dy, s, rstd, w, residual_grad=dres)
    empty = torch.empty(0, 2048, device="cuda", dtype=torch.bfloat16)
    y, rstd = ops.rms_norm(empty, torch.ones(2048, device="cuda"), 1e-5)
    ops.rms_norm_backward(empty, empty, rstd, torch.ones(2048, device="cuda"))
    torch.cuda.synchronize()
    print("rms_norm sanitize targets ran")


# Cross-entropy forward and backward: bf16 rows 16-byte aligned with a vector tail (1009 classes), a row long enough
# for the unrolled loop (20000 classes), fp32 and fp16 with odd rows, a misaligned bf16 view (element-wise path), an
# ignored row and a target outside the classes, grad_loss per row and as an expanded scalar (stride 0).
def cross_entropy():
    for rows, classes, dtype in [(5, 1009, torch.bfloat16), (2, 20000, torch.bfloat16), (3, 4097, torch.float32),
                                 (4, 9, torch.float16), (1, 1, torch.float32)]:
        logits = torch.randn(rows, classes, device="cuda", dtype=dtype)
        target = torch.randint(0, classes, (rows,), device="cuda")
        target[-1] = -100
        if rows > 2:
            target[0] = classes
        loss, lse = ops.cross_entropy_forward(logits, target)
        ops.cross_entropy_backward(logits, target, lse, torch.randn(rows, device="cuda"))
        ops.cross_entropy_backward(logits, target, lse, torch.ones((), device="cuda").expand(rows))
    logits = torch.randn(1 + 4 * 1000, device="cuda", dtype=torch.bfloat16)[1:].view(4, 1000)
    target = torch.tensor([3, -100, 999, 0], device="cuda")
    loss, lse = ops.cross_entropy_forward(logits, target)
    ops.cross_entropy_backward(logits, target, lse, torch.randn(4, device="cuda"))
    wide = torch.randn(6, 1040, device="cuda", dtype=torch.bfloat16)[:, :1000]
    loss, lse = ops.cross_entropy_forward(wide, target.repeat(2)[:6].clamp_min(0), ignore_index=0)
    ops.cross_entropy_backward(wide, target.repeat(2)[:6].clamp_min(0), lse, torch.randn(6, device="cuda"), ignore_index=0)
    torch.cuda.synchronize()
    print("cross-entropy sanitize targets ran")


# Forward and gradient from one read: rows split over clusters of 1, 2, 4 and 8 blocks (the default parts, 4 KB
# parts and the largest, 200 KB: 50000 fp32 classes in one block's 200000 bytes, 128256 bf16 in 2 parts); fp32, an
# ignored row.
def cross_entropy_forward_grad():
    # 600 x 4104 in 4 KB parts: 600 clusters of 4, several blocks an SM
    for rows, classes, dtype in [(3, 4096, torch.bfloat16), (2, 128256, torch.bfloat16), (2, 50000, torch.float32),
                                 (600, 4104, torch.bfloat16)]:
        for part_bytes in (None, 4096, 200 * 1024):
            logits = torch.randn(rows, classes, device="cuda", dtype=dtype)
            target = torch.randint(0, classes, (rows,), device="cuda")
            target[-1] = -100
            ops.cross_entropy_forward_grad(logits, target, _part_bytes=part_bytes)
            # written over the logits it reads
            ops.cross_entropy_forward_grad(logits, target, overwrite=True, _part_bytes=part_bytes)
    torch.cuda.synchronize()
    print("cross-entropy forward+grad sanitize targets ran")


# AdamW over lists of tensors: bf16, fp16 and fp32, sizes around a 16-byte vector and a chunk (4096 16-bit or 2048
# fp32 elements) and an empty one, entries with one or all four tensors off 16 bytes (element by element) and 300
# entries in one call (two launches); then the optimizer, one parameter declined (transposed) to torch's path.
def adamw():
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        numels = [1, 7, 9, 2049, 4097, 0, 20000]
        lists = [[torch.randn(n, device="cuda").to(dtype) for n in numels] for _ in range(4)]
        for offsets in ((1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (1, 3, 2, 5)):
            for lst, off in zip(lists, offsets):
                lst.append(torch.randn(off + 4099, device="cuda").to(dtype)[off:])
        for v in lists[3]:
            v.abs_()  # second moments are >= 0
        ops.adamw_step(*lists, step=3, maximize=dtype == torch.float16, **hyper)
    numels = [(i * 37) % 3000 for i in range(300)]
    lists = [[torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in numels] for _ in range(4)]
    ops.adamw_step(*lists, step=1, **hyper)
    optimizer_steps(clip=False)
    torch.cuda.synchronize()
    print("adamw sanitize targets ran")


def optimizer_steps(clip: bool) -> None:
    """Two steps of thunder_tk.optim.AdamW, bf16 parameters of three sizes on the kernel and a transposed one
    declined to torch's path; clip_grad_norm_ before each where `clip`."""
    from thunder_tk.optim import AdamW

    params = [torch.nn.Parameter(torch.randn(*shape, device="cuda", dtype=torch.bfloat16))
              for shape in ((300, 70), (4097,), (9,))]
    params.append(torch.nn.Parameter(torch.randn(48, 32, device="cuda", dtype=torch.bfloat16).t()))
    opt = AdamW(params, lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        if clip:
            opt.clip_grad_norm_(1.0)
        opt.step()


# Clipping by the global norm: ops.sq_norm over three dtypes in one call, sizes around a 16-byte vector and a
# chunk (8192 16-bit or 4096 fp32 elements), tensors off 16 bytes, 300 tensors (two launches and the partials of
# both), an empty list; the clipped AdamW update reading the norm on the device; then the optimizer's
# clip_grad_norm_ and step with a parameter declined to torch's path.
def grad_clip():
    lists = {dtype: [torch.randn(n, device="cuda").to(dtype) for n in (1, 7, 9, 4097, 8192, 8193, 0, 20000)]
             for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    for dtype, lst in lists.items():
        lst.append(torch.randn(4099, device="cuda").to(dtype)[1:])
    sq = ops.sq_norm([t for lst in lists.values() for t in lst])
    ops.sq_norm([t for lst in lists.values() for t in lst], out=sq, accumulate=True)
    ops.sq_norm([torch.randn((i * 37) % 3000, device="cuda", dtype=torch.bfloat16) for i in range(300)], out=sq)
    ops.sq_norm([], out=sq)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for dtype, grads in lists.items():
        quad = [grads] + [[torch.randn_like(g).abs() for g in grads] for _ in range(3)]
        ops.adamw_step(quad[1], quad[0], quad[2], quad[3], step=2, grad_sq_norm=ops.sq_norm(grads), max_norm=0.5,
                       **hyper)
    optimizer_steps(clip=True)
    torch.cuda.synchronize()
    print("grad_clip sanitize targets ran")


# Different kernels back to back with no synchronisation, each reading the last one's output, launched
# programmatically dependent (as every section's launches are, by default) and then in plain stream order.
def dependent_launch():
    bf16 = torch.bfloat16
    x = torch.randn(512, 256, device="cuda", dtype=bf16)
    w = torch.randn(256, 256, device="cuda", dtype=bf16) / 16
    norm_w = torch.ones(256, device="cuda", dtype=bf16)
    target = torch.randint(0, 256, (512,), device="cuda")
    for dependent in (True, False):
        with ops.dependent_launches(dependent):
            h = x
            for _ in range(4):
                h = ops.gemm(h, w)
                h, rstd = ops.rms_norm(h, norm_w, 1e-5)
                q = h.view(1, 512, 2, 128).transpose(1, 2)
                o, lse = ops.attention_forward(q, q, q, is_causal=True)
                h = o.transpose(1, 2).reshape(512, 256)
                dq, dk, dv = ops.attention_backward(q, q, q, o, lse, o, is_causal=True)
                h = ops.gemm(dq.transpose(1, 2).reshape(512, 256), w)
                ops.cross_entropy_forward_grad(h, target)
    torch.cuda.synchronize()
    print("dependent_launch sanitize targets ran")


SECTIONS = [attention_bwd_delta, gemm, gemm_skinny, gemm_swiglu, tile_library, attention_forward, attention_backward,
            attention_window, attention_qkv_grad, gemm_rope, gemm_sum, gemm_fp32_out, embedding_backward, rms_norm, cross_entropy,
            cross_entropy_forward_grad, adamw, grad_clip, dependent_launch]

if __name__ == "__main__":
    only = {x.strip() for x in os.environ.get("SANITIZE_ONLY", "").split(",") if x.strip()}
    unknown = only - {f.__name__ for f in SECTIONS}
    if unknown:
        raise SystemExit(f"SANITIZE_ONLY: no section {sorted(unknown)}; sections: {[f.__name__ for f in SECTIONS]}")
    # A section past THUNDER_TK_SANITIZE_SECTION_TIMEOUT seconds (default 240; 0: none) ends the run with its
    # traceback, naming the section, instead of holding the GPU host until the step's timeout.
    limit = float(os.environ.get("THUNDER_TK_SANITIZE_SECTION_TIMEOUT", "240"))
    for section in SECTIONS:
        if not only or section.__name__ in only:
            if limit > 0:
                faulthandler.dump_traceback_later(limit, exit=True)
            section()
            faulthandler.cancel_dump_traceback_later()
