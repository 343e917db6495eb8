"""The end-to-end benchmarks' code paths on a CPU (tiny models, gloo): they run on GPU hosts only once per
session, so a broken path must show here first."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("litgpt")

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/<script> with these arguments in a fresh interpreter (no GPU needed for its arguments)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=120)


def test_litgpt_step_fsdp_paths(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "benchmarks" / "litgpt_step.py"), "--fsdp", "--device", "cpu", "--model", "pythia-14m",
           "--n-layer", "1", "--seq", "32", "--batch", "1", "--warmup", "1", "--steps", "1", "--rounds", "2",
           "--only", "eager", "thunder default", "thunder [tk]", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == ["eager", "thunder default", "thunder [tk]"]
    assert all(row["world_size"] == 2 and row["tokens_per_s"] > 0 for row in rows)
    # Two rounds in turns, the variants kept built: each row is the median of its two.
    assert all(len(row["tokens_per_s_rounds"]) == 2 and row["rounds"] == 2 for row in rows)
    assert all(min(row["tokens_per_s_rounds"]) <= row["tokens_per_s"] <= max(row["tokens_per_s_rounds"]) for row in rows)
    # Same model, same batches: the same first-step loss, up to the rounding of the per-token losses to the model's
    # dtype, which each executor does at its own point (LossModule: 16-bit per-token losses averaged in fp32; over
    # these 32 tokens a spread of a few 1e-3 near 11).
    losses = [row["loss"] for row in rows]
    assert max(losses) - min(losses) < 1e-2, losses


def test_litgpt_step_at_bf16_mixed(tmp_path):
    """--precision bf16-mixed: fp32 weights with the step's forward under bf16 autocast, recorded in each row."""
    out = tmp_path / "step.json"
    r = run_bench("litgpt_step.py", "--device", "cpu", "--model", "pythia-14m", "--n-layer", "1", "--seq", "32",
                  "--batch", "1", "--warmup", "1", "--steps", "1", "--only", "thunder [tk]", "--precision",
                  "bf16-mixed", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 layers, batch 1 x 32 tokens, bf16-mixed, fused AdamW" in r.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["precision"] == "bf16-mixed" and 10 < row["loss"] < 12  # ln(50304 classes) = 10.8 at the start


def test_pretrain_compare_runs_both_variants(tmp_path):
    out = tmp_path / "compare.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "pretrain_compare.py"), "--config",
           str(ROOT / "litgpt_configs" / "tiny.yaml"), "--work", str(tmp_path / "work"), "--json", str(out),
           "--", "--train.max_steps", "2", "--train.global_batch_size", "2", "--train.micro_batch_size", "2",
           "--model_config.n_layer", "1"]  # the comparison's plumbing, not the model: one layer to trace, not two
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"tk", "thunder default"}
    assert rows["tk"]["final_loss"] == pytest.approx(rows["thunder default"]["final_loss"], rel=1e-4)
    assert "goal tk >= 1.15x Thunder default" in r.stdout and "by the median step" in r.stdout
    # The median step's pace beside the mean's (a few stalled steps move the mean, not the median).
    assert all(row["tokens_per_s_per_gpu_median_step"] > 0 and row["step_s_median"] <= row["step_s_max"]
               for row in rows.values())
    assert rows["thunder default"]["vs_thunder_default_median_step"] == 1.0
    assert not list((tmp_path / "work").rglob("*.pt"))  # --no-checkpoint


def test_pretrain_compare_names_the_slow_steps():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_compare", ROOT / "benchmarks" / "pretrain_compare.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    steps = [{"step": 1, "step_seconds": 50.0, "host_seconds": 49.0, "gc_seconds": 0.5},  # the compiling step
             {"step": 2, "step_seconds": 0.2, "host_seconds": 0.05, "gc_seconds": 0.0},
             {"step": 2, "val_loss": 3.0},
             {"step": 3, "step_seconds": 0.9, "host_seconds": 0.85, "gc_seconds": 0.6},
             {"step": 4, "step_seconds": 0.21, "host_seconds": 0.05, "gc_seconds": 0.0}]
    assert bench.slow_steps(steps, 0.2) == [{"step": 3, "step_seconds": 0.9, "host_seconds": 0.85, "gc_seconds": 0.6}]
    assert bench.slow_steps(steps, None) == []
    assert bench.slow_steps([*steps, {"step": 5, "step_seconds": 1.5, "profiled": True}], 0.2) == \
        bench.slow_steps(steps, 0.2)  # a profiled step is slow by the profiler's doing
    # A record with the host's phases and the allocator's counters: the line names the largest phases and both.
    steps[3].update(host_phases={"batch": 0.001, "forward": 0.7, "backward": 0.1, "clip": 0.0, "optimizer": 0.02},
                    alloc_retries=0, device_allocs=3)
    (slow,) = bench.slow_steps(steps, 0.2)
    assert slow["host_phases"]["forward"] == 0.7 and slow["device_allocs"] == 3
    assert bench.describe_slow_step(slow) == ("  step 3: 0.900 s, host 0.850 s (forward 0.700 s, backward 0.100 s), "
                                              "garbage collector 0.600 s, allocator retries 0, cudaMalloc calls 3")
    # With the operating system's counters over the interval: the main thread's CPU time beside the step's.
    steps[3]["system"] = {"main_thread_cpu_s": 0.12, "voluntary_switches": 40, "involuntary_switches": 900,
                          "minor_faults": 5, "major_faults": 0, "compactions": 0, "reclaims": 0,
                          "numa_migrations": 7000, "huge_page_faults": 0}
    (slow,) = bench.slow_steps(steps, 0.2)
    assert bench.describe_slow_step(slow).endswith(
        "cudaMalloc calls 3; interval: main thread CPU 0.120 s, 900 involuntary switches, 5 minor and 0 major "
        "faults, compactions 0, reclaims 0, NUMA migrations 7000")


def test_pretrain_compare_tabulates_the_profiles():
    import importlib.util

    from thunder_tk.step_profile import summarize

    spec = importlib.util.spec_from_file_location("pretrain_compare", ROOT / "benchmarks" / "pretrain_compare.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ms = 1_000_000
    profile = summarize([{"name": "nvjet_tst_x", "stream": 7, "start": 0, "end": 8 * ms},
                         {"name": "ncclDevKernel_AllGather", "stream": 13, "start": 7 * ms, "end": 10 * ms},
                         {"name": "triton_poi_fused_add_0", "stream": 7, "start": 10 * ms, "end": 11 * ms}],
                        steps=1, wall_s=0.012)
    rows = [{"variant": "tk", "profile": profile}, {"variant": "thunder default"},  # not profiled: no row
            {"variant": "cpu", "profile": summarize([], steps=1, wall_s=0.01)}]  # no GPU activities: no row
    (row,) = bench.profile_rows(rows)
    assert row["variant"] == "tk" and row["wall"] == pytest.approx(12.0) and row["window"] == pytest.approx(11.0)
    assert row["main busy"] == pytest.approx(9.0) and row["idle, other busy"] == pytest.approx(2.0)
    assert row["idle, all idle"] == pytest.approx(0.0) and row["other streams busy"] == pytest.approx(3.0)
    assert row["main: gemm"] == pytest.approx(8.0) and row["main: fused (triton)"] == pytest.approx(1.0)


def test_attention_benchmark_imports_and_parses_on_cpu():
    import importlib.util

    r = run_bench("attention.py", "--help")
    assert r.returncode == 0 and "--no-backward" in r.stdout, r.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("attention_bench", ROOT / "benchmarks" / "attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time
    pts = list(bench.points(bench.SEQ_LENS, (128, 64)))
    assert len(pts) == 24 and all(B * S == 16384 and H * D == 2048 for B, H, S, D, _ in pts)
    assert bench.fwd_flops(2, 3, 5, 7, True) == bench.fwd_flops(2, 3, 5, 7, False) / 2 == 2 * 2 * 3 * 5 * 5 * 7
    assert bench.bwd_flops(1, 1, 4, 8, False) == 2.5 * 4 * 4 * 4 * 8
    rows = [{"S": 2048, "D": 128, "fwd_vs_cudnn": 0.5}, {"S": 16384, "D": 128, "fwd_vs_cudnn": 2.0},
            {"S": 1024, "D": 128, "fwd_vs_cudnn": 0.1}, {"S": 4096, "D": 64, "fwd_vs_cudnn": 0.1},
            {"S": 8192, "D": 128, "fwd_vs_cudnn": None}]
    line = bench.summary(rows)
    assert "2 points" in line and "geometric mean 1.000" in line and "minimum 0.500" in line


def test_attention_benchmark_window_mode_on_cpu():
    """--window's pure parts: the kept-pair count the FLOPs use, the points (S > W only), the keep-mask handed to SDPA
    (True: keep, the window's keys i - W < j <= i), the float64 rows the correctness check reads, and a row's ratios."""
    import importlib.util
    import warnings

    import torch

    from thunder_tk import ops

    r = run_bench("attention.py", "--help")
    assert r.returncode == 0 and "--window" in r.stdout, r.stderr[-3000:]
    r = run_bench("attention.py", "--window", "0")
    assert r.returncode == 2 and "must be >= 1" in r.stderr, r.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("attention_bench_window", ROOT / "benchmarks" / "attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time
    for S, W in ((1, 1), (7, 1), (7, 3), (7, 7), (7, 100), (64, 16)):
        keep = bench.window_keep_mask(S, W)
        assert bench.window_pairs(S, W) == sum(min(i + 1, W) for i in range(S)) == keep.sum().item(), (S, W)
        assert torch.equal(keep, ~ops._window_mask(S, S, W, "cpu")), (S, W)  # the kernels' own reference window
        assert torch.equal(bench.window_keep_mask(S, W, rows=[S - 1, 0]), keep[[S - 1, 0]])
    assert bench.window_pairs(16, 16) == bench.window_pairs(16, 99) == 16 * 17 // 2
    assert bench.window_fwd_flops(2, 3, 8, 64, 4) == 4 * 2 * 3 * 64 * (1 + 2 + 3 + 4 * 5)
    assert bench.window_bwd_flops(2, 3, 8, 64, 4) == 2.5 * bench.window_fwd_flops(2, 3, 8, 64, 4)
    pts = list(bench.window_points((2048, 4096, 8192, 16384), (128,), (512, 4096)))
    assert [(S, W) for _, _, S, _, W in pts] == [(2048, 512), (4096, 512), (8192, 512), (8192, 4096), (16384, 512),
                                                 (16384, 4096)]
    assert all(B * S == 16384 and H * D == 2048 for B, H, S, D, _ in pts)
    assert bench.window_check_rows(2048, 512) == [0, 1, 510, 511, 512, 513, 1024, 2046, 2047]
    assert bench.window_check_rows(4, 8) == [0, 1, 2, 3]
    # The check's float64 rows are SDPA's output with the mask and the ops reference's with the window.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 64, dtype=torch.float64, generator=g) for _ in range(3))
    W, rows = 9, bench.window_check_rows(40, 9)
    got = bench.window_reference_rows(q, k, v, W, rows)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bench.window_keep_mask(40, W))
    want, _ = ops.attention_forward_reference(q, k, v, is_causal=True, window=W)
    assert torch.allclose(got, sdpa[0, 0, rows], atol=1e-12) and torch.allclose(got, want[0, 0, rows], atol=1e-12)
    # A row: TFLOP/s by the window's pairs (tk causal by the causal ones), speed ratios, the fastest peer.
    point = bench.window_point(1, 16, 16384, 128, 512)
    assert point["kept_pairs"] == bench.window_pairs(16384, 512) and point["peer_backends"]["efficient"] == [
        "EFFICIENT_ATTENTION"]
    row = bench.window_timings(point, "fwd", {"tk": 1.0, "tk_causal": 8.0, "efficient": 3.0}, 2e12, 16e12)
    assert row["pass"] == "fwd" and row["tk_tflops"] == 2000.0 and row["tk_causal_tflops"] == 2000.0
    assert row["efficient_tflops"] == pytest.approx(2000 / 3) and row["cudnn_ms"] is None
    assert row["tk_vs_efficient"] == 3.0 and row["tk_vs_cudnn"] is None and row["window_speedup"] == 8.0
    assert row["best_peer"] == "efficient" and row["tk_vs_best_peer"] == 3.0
    row = bench.window_timings(point, "bwd", {"tk": 2.0, "cudnn": 1.0, "efficient": 3.0}, 1e9, 1e9)
    assert row["best_peer"] == "cudnn" and row["tk_vs_best_peer"] == 0.5 and row["window_speedup"] is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("Memory efficient kernel not used because:")
        warnings.warn("Both fused kernels do not support non-null attn_mask.\nmore")
    why = bench.refusal(RuntimeError("No available kernel. Aborting execution."), caught)
    assert why == ("RuntimeError: No available kernel. Aborting execution.; Memory efficient kernel not used because:; "
                   "Both fused kernels do not support non-null attn_mask.")

def test_profile_attention_parses_on_cpu():
    r = run_bench("profile_attention.py", "--help")
    assert r.returncode == 0 and "--kernels" in r.stdout and "cudnn" in r.stdout, r.stderr[-3000:]


def test_attention_tail_parts_parses_on_cpu():
    r = run_bench("attention_tail_parts.py", "--help")
    assert r.returncode == 0 and "--parts" in r.stdout and "--png" in r.stdout, r.stderr[-3000:]


def test_swiglu_bench_parses_on_cpu():
    r = run_bench("swiglu.py", "--help")
    assert r.returncode == 0 and "--backward-only" in r.stdout and "--png" in r.stdout, r.stderr[-3000:]


def test_knob_inprocess_parses_knobs_and_sets_them_per_call(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("knob_bench", ROOT / "benchmarks" / "knob_inprocess.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time
    assert bench.parse_knob("THUNDER_TK_X=0,12,2") == ("THUNDER_TK_X", ["0", "12", "2"])
    for bad in ("THUNDER_TK_X=0", "THUNDER_TK_X", "=1,2"):
        with pytest.raises(SystemExit, match="NAME=V0,V1"):
            bench.parse_knob(bad)
    name, labels, settings = bench.parse_knobs(["THUNDER_TK_X=0,0,1", "THUNDER_TK_Y=a,b,b"])
    assert name == "THUNDER_TK_X+THUNDER_TK_Y" and labels == ["0+a", "0+b", "1+b"]
    assert settings["1+b"] == {"THUNDER_TK_X": "1", "THUNDER_TK_Y": "b"}
    with pytest.raises(SystemExit, match="same number of values"):
        bench.parse_knobs(["THUNDER_TK_X=0,1", "THUNDER_TK_Y=a,b,c"])
    with pytest.raises(SystemExit, match="given twice"):
        bench.parse_knobs(["THUNDER_TK_X=0,0", "THUNDER_TK_Y=a,a"])
    monkeypatch.delenv("THUNDER_TK_X", raising=False)
    monkeypatch.delenv("THUNDER_TK_Y", raising=False)
    monkeypatch.setattr(bench, "SETTINGS", settings)
    seen = []
    env = __import__("os").environ
    run = bench.with_knob("0+b", lambda: seen.append((env["THUNDER_TK_X"], env["THUNDER_TK_Y"])))
    run()
    assert seen == [("0", "b")]
    r = run_bench("knob_inprocess.py", "--help")
    assert r.returncode == 0 and "--knob" in r.stdout and "--bench" in r.stdout, r.stderr[-3000:]


def test_attention_clocks_parses_on_cpu():
    r = run_bench("attention_clocks.py", "--help")
    assert r.returncode == 0 and "--points" in r.stdout, r.stderr[-3000:]
    r = run_bench("attention_clocks.py", "--points", "8192:96:full")
    assert r.returncode == 2 and "a point is S:D:full|causal" in r.stderr, r.stderr[-3000:]


def test_litgpt_step_profile_kinds_and_table(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("litgpt_step_bench", ROOT / "benchmarks" / "litgpt_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kinds = {name: bench.kernel_kind(name) for name in [
        "void tk::gemm::(anonymous namespace)::gemm_kernel<__nv_bfloat16, (tk::wgmma::major)0>(CUtensorMap)",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NTN",
        "void tk::attention::(anonymous namespace)::backward_kernel<__nv_bfloat16, 64>(CUtensorMap_st)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3",
        "void tk::loss::(anonymous namespace)::forward_kernel<__nv_bfloat16>(tk::loss::cross_entropy_args)",
        "triton_red_fused__log_softmax__to_copy_prepare_softmax_online_9",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
        "triton_per_fused__to_copy_mul_rsqrt_0",
        "void at::native::elementwise_kernel<128, 2>(direct_copy_kernel_cuda)",
        "some_other_kernel"]}
    assert list(kinds.values()) == ["gemm", "gemm", "attention", "attention", "loss", "loss", "optimizer",
                                    "fused (triton)", "copy/fill", "other"]
    assert bench.TK_KERNEL.search("void tk::gemm::gemm_kernel") and not bench.TK_KERNEL.search("nvjet_tk")
    profile = {"wall_ms": 40.0, "kernel_ms": 38.5, "tk_ms": 20.0, "kinds_ms": {"gemm": 20.0, "other": 18.5},
               "top": [{"kernel": "nvjet_x", "ms": 20.0, "calls": 30, "kind": "gemm", "tk": False}],
               "gaps": bench.idle_gaps([{"name": "nvjet_x", "stream": 7, "start": 0, "end": 10_000},
                                        {"name": "triton_y", "stream": 7, "start": 160_000, "end": 170_000}])}
    bench.print_profiles([{"variant": "thunder default", "profile": profile}, {"variant": "eager"}])
    out = capsys.readouterr().out
    assert "GPU time per step" in out and "thunder default: top kernels" in out and "nvjet_x" in out
    assert "compute stream idle 0.15 ms" in out and "150.0 us after nvjet_x" in out
    assert "of which tk" in out
    assert "eager" not in out  # not profiled, not listed


def test_cross_entropy_benchmark_imports_and_parses_on_cpu():
    r = run_bench("cross_entropy.py", "--help")
    assert r.returncode == 0 and "--quick" in r.stdout, r.stderr[-3000:]
    r = run_bench("cross_entropy.py", "--part-bytes", "0", "32768")  # 0 named the removed one-block kernel
    assert r.returncode == 2 and "sizes must be > 0" in r.stderr, r.stderr[-3000:]


def test_gemm_decode_layer_benchmark_parses_on_cpu():
    r = run_bench("gemm_decode_layer.py", "--help")
    assert r.returncode == 0 and "--tokens" in r.stdout, r.stderr[-3000:]


def test_gemm_benchmark_fp32_output_refuses_the_knobs_that_cannot_write_it():
    """--fp32-out times tk's fp32 epilogue against cuBLAS's; the clusters, ping-pong and store-warp kernels write the
    operands' dtype only, so asking for them too fails at once, naming them (before anything touches a GPU)."""
    r = run_bench("gemm.py", "--help")
    assert r.returncode == 0 and "--fp32-out" in r.stdout and "--register-epilogue" in r.stdout, r.stderr[-3000:]
    r = run_bench("gemm.py", "--fp32-out", "--cluster", "--epilogues")
    assert r.returncode == 2 and "--cluster, --epilogues: those kernels write the operands' dtype only" in r.stderr, \
        r.stderr[-3000:]


def test_gemm_benchmark_llama_1b_problems():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gemm_bench", ROOT / "benchmarks" / "gemm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time
    shapes = list(bench.problems(False, llama_1b=True))
    assert [(M, N, K) for _, M, N, K in shapes] == [(8192, 3072, 2048), (8192, 2048, 2048), (8192, 8192, 2048),
                                                     (8192, 2048, 8192), (8192, 128256, 2048)]
    assert len(list(bench.problems(False))) == 9 and len(list(bench.problems(True))) == 4
    small = list(bench.problems(True, tokens=[1, 64]))
    assert [(name, M, N, K) for name, M, N, K in small] == [
        ("1x4096x4096", 1, 4096, 4096), ("1x4096x11008", 1, 11008, 4096),
        ("64x4096x4096", 64, 4096, 4096), ("64x4096x11008", 64, 11008, 4096)]
    assert [M for _, M, _, _ in bench.problems(False, llama_1b=True, tokens=[16])] == [16] * 5
    products = {layout: (lhs, rhs) for layout, lhs, rhs in bench.layout_operands(5, 3, 4, device="cpu")}
    assert list(products) == ["fwd", "dX", "dW"]  # X W^T (5 x 3), dY W (5 x 4), dY^T X (3 x 4)
    assert [tuple((lhs @ rhs).shape) for lhs, rhs in products.values()] == [(5, 3), (5, 4), (3, 4)]
    x, dy = products["fwd"][0], products["dX"][0]
    assert products["dW"][0].data_ptr() == dy.data_ptr() and products["dW"][1].data_ptr() == x.data_ptr()
    assert [layout for layout, _, _ in bench.layout_operands(2, 2, 2, ["dW"], device="cpu")] == ["dW"]


def test_litgpt_step_memory_replay_finds_what_is_live_at_the_peak(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("litgpt_step_bench_mem", ROOT / "benchmarks" / "litgpt_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch_frame = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}
    mib = 2**20

    def alloc(addr, size, name, caller="backward_fn"):
        return {"action": "alloc", "addr": addr, "size": size * mib,
                "frames": [torch_frame, {"filename": "/x/thunder_tk/ops.py", "line": 7, "name": name},
                           {"filename": "thunder.backward_fn_3", "line": 9, "name": caller}]}

    trace = [
        {"action": "free_requested", "addr": 99, "size": 5 * mib},  # allocated before the trace: ignored
        alloc(1, 100, "gemm"), alloc(2, 64, "attention_backward"),
        {"action": "free_requested", "addr": 1, "size": 100 * mib},
        {"action": "free_completed", "addr": 1, "size": 100 * mib},  # counted once
        alloc(3, 50, "gemm"), alloc(4, 60, "gemm"),  # peak: 64 + 50 + 60 = 174 MiB
        {"action": "free_requested", "addr": 4, "size": 60 * mib},
        alloc(5, 10, "cross_entropy_backward"),
    ]
    got = bench.live_at_peak(trace, top=5)
    assert got["peak_mib"] == 174
    assert [(t["mib"], t["blocks"]) for t in got["top"]] == [(110, 2), (64, 1)]
    assert got["top"][0]["site"] == "gemm (ops.py:7) <- backward_fn (thunder.backward_fn_3:9)"
    gib = 2**30
    segments = [  # a snapshot's segments: the default pool on two streams, a CUDA graphs' private pool, another GPU
        {"device": 0, "segment_pool_id": (0, 0), "stream": 0, "total_size": 2 * gib, "allocated_size": gib},
        {"device": 0, "segment_pool_id": (0, 0), "stream": 0, "total_size": gib, "allocated_size": 0},
        {"device": 0, "segment_pool_id": (0, 0), "stream": 0x7f00, "total_size": gib // 2, "allocated_size": 0},
        {"device": 0, "segment_pool_id": (1, 3), "stream": 0x7f00, "total_size": 4 * gib, "allocated_size": gib},
        {"device": 1, "segment_pool_id": (0, 0), "stream": 0, "total_size": 8 * gib, "allocated_size": 0},
    ]
    census = bench.segments_by_pool(segments, 0)
    assert [(g["pool"], g["stream"], g["segments"], g["reserved_gib"], g["allocated_gib"]) for g in census] == [
        ("private 1.3", "0x7f00", 1, 4.0, 1.0), ("default", "default", 2, 3.0, 1.0), ("default", "0x7f00", 1, 0.5, 0.0)]
    bench.print_memory([{"variant": "thunder [tk]", "memory": {"before_step_gib": 1.5, **got, "segments": census}},
                        {"variant": "eager"}])
    out = capsys.readouterr().out
    assert "thunder [tk]: 1.50 GiB before the step, peak 174 MiB" in out and "attention_backward" in out
    assert "reserved memory after the step by pool and stream" in out and "private 1.3" in out

    # What each pool still holds after the step, by allocation site (--memory-resident): live blocks only, the
    # pool holding most first; blocks made before recording began are named so.
    def block(size_mib, state="active_allocated", name=None):
        frames = [torch_frame, {"filename": "/x/thunder_tk/cuda_graphs.py", "line": 3, "name": name}] if name else []
        return {"size": size_mib * mib, "state": state, "frames": frames}

    segments[0]["blocks"] = [block(300, name="_move_kept_gradients"), block(200, name="_move_kept_gradients"),
                             block(100), block(400, state="inactive")]
    segments[3]["blocks"] = [block(900, name="capture"), block(50, name="replay")]
    segments[4]["blocks"] = [block(5000, name="other_gpu")]
    resident = bench.resident_by_site(segments, 0, top=1)
    assert [(r["pool"], r["mib"], r["blocks"]) for r in resident] == [("private 1.3", 900, 1), ("default", 500, 2)]
    assert resident[1]["site"] == "_move_kept_gradients (cuda_graphs.py:3)"
    assert [r["site"] for r in bench.resident_by_site(segments, 0, top=3) if r["pool"] == "default"][-1] == \
        "(before recording)"
    bench.print_memory([{"variant": "tk graphs", "memory": {"before_step_gib": 1.5, **got, "resident": resident}}])
    assert "allocated after the step, by pool and allocation site" in capsys.readouterr().out


def test_litgpt_step_a_failing_variant_costs_only_its_own_row(monkeypatch, tmp_path, capsys):
    """A variant whose build or first step raises (Thunder's own SDPA backward did at bf16-mixed) gets a row with
    the error and no timing; the other variants are timed over their rounds and compared as usual."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("litgpt_step_bench_fail", ROOT / "benchmarks" / "litgpt_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def broken(m):
        raise RuntimeError("query and dout must have the same dtype\nmore lines")

    real = bench.variants
    monkeypatch.setattr(bench, "variants", lambda *a: {**real(*a), "thunder default": broken})
    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["litgpt_step.py", "--device", "cpu", "--model", "pythia-14m", "--n-layer", "1",
                                      "--seq", "16", "--batch", "1", "--warmup", "1", "--steps", "1", "--rounds", "2",
                                      "--only", "default", "eager", "eager", "--json", str(out)])
    bench.main()
    # run (and listed) in --only's order; a variant named twice is built and timed twice
    assert [r["variant"] for r in json.loads(out.read_text())["rows"]] == ["thunder default", "eager", "eager #2"]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["thunder default"]["error"] == "RuntimeError: query and dout must have the same dtype"
    assert rows["thunder default"]["tokens_per_s"] is None and rows["eager"]["vs_thunder_default"] is None
    assert len(rows["eager"]["tokens_per_s_rounds"]) == 2 and rows["eager"]["tokens_per_s"] > 0
    assert len(rows["eager #2"]["tokens_per_s_rounds"]) == 2 and rows["eager #2"]["tokens_per_s"] > 0
    assert "thunder default: failed, RuntimeError: query and dout" in capsys.readouterr().out
    # Every variant failing (a model no variant can run): the rows say why, no rounds to run.
    monkeypatch.setattr(sys, "argv", [a for a in sys.argv if a != "eager"])
    bench.main()
    assert [r["error"] for r in json.loads(out.read_text())["rows"]] == [rows["thunder default"]["error"]]


def test_litgpt_step_only_takes_aliases_and_rejects_unknown_names():
    import importlib.util

    spec = importlib.util.spec_from_file_location("litgpt_step_bench_only", ROOT / "benchmarks" / "litgpt_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.variant_names(None) is None
    assert bench.variant_names(["tk", "thunder-default", "compile", "eager", "thunder [tk]"]) == [
        "thunder [tk]", "thunder default", "torch.compile", "eager", "thunder [tk]"]
    # a variant named again runs again, under a row label of its own (tk before and after torch.compile)
    assert bench.repeats_labelled(["thunder [tk]", "torch.compile", "thunder [tk]", "thunder [tk]"]) == [
        ("thunder [tk]", "thunder [tk]"), ("torch.compile", "torch.compile"), ("thunder [tk]", "thunder [tk] #2"),
        ("thunder [tk]", "thunder [tk] #3")]
    with pytest.raises(SystemExit, match="unknown variant"):
        bench.variant_names(["thunder_defualt"])
    # tk with tk_disable names off, for an A/B in one run
    assert bench.variant_names(["tk_without=gemm_sum", "TK_WITHOUT=gemm_rope+attention"]) == [
        "thunder [tk] without gemm_sum", "thunder [tk] without gemm_rope, attention"]
    assert bench.switched_off("thunder [tk] without gemm_rope, attention") == ("gemm_rope", "attention")
    with pytest.raises(SystemExit, match="unknown variant"):
        bench.variant_names(["tk_without=gemm_summ"])
    import torch

    built = bench.variants(False, torch.device("cpu"), ("thunder [tk] without gemm_sum",))
    assert tuple(built)[:len(bench.VARIANT_NAMES)] == bench.VARIANT_NAMES
    assert list(built)[-1] == "thunder [tk] without gemm_sum"


def test_litgpt_step_variant_environment_is_set_only_during_its_steps(monkeypatch):
    import argparse
    import importlib.util
    import os

    import torch

    spec = importlib.util.spec_from_file_location("litgpt_step_bench_env", ROOT / "benchmarks" / "litgpt_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.delenv("THUNDER_TK_GEMM_SCHEDULE", raising=False)
    seen = []

    class Spy(torch.nn.Module):  # the loss module with a note of the schedule its forward ran under
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            seen.append(os.environ.get("THUNDER_TK_GEMM_SCHEDULE"))
            return self.inner(x, y)

    wrap = bench.with_environment(lambda m: Spy(m), THUNDER_TK_GEMM_SCHEDULE="dynamic")
    args = argparse.Namespace(model="pythia-14m", n_layer=1, seq=16, batch=1, warmup=1, precision="bf16-true")
    built = bench.Built("spy", wrap, args, torch.device("cpu"))
    built.time_steps(1)
    assert seen == ["dynamic", "dynamic"]  # the warm-up step and the timed one
    assert "THUNDER_TK_GEMM_SCHEDULE" not in os.environ
    assert bench.variant_names(["tk_dynamic_gemms"]) == ["thunder [tk] dynamic GEMMs"]


def spying_setting():
    """A context manager for a variant's steps and a module wrapper that notes, per forward, whether it ran inside
    it: (setting, Spy, inside, seen)."""
    import contextlib

    import torch

    inside, seen = [], []

    @contextlib.contextmanager
    def setting():
        inside.append(True)
        yield
        inside.pop()

    class Spy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            seen.append(bool(inside))
            return self.inner(x, y)

    return setting, Spy, inside, seen


def test_litgpt_step_plain_launch_order_variant_runs_its_steps_inside_the_setting():
    import argparse
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("litgpt_step_bench_around", ROOT / "benchmarks" / "litgpt_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    setting, Spy, inside, seen = spying_setting()

    wrap = bench.around_steps(lambda m: Spy(m), setting)
    args = argparse.Namespace(model="pythia-14m", n_layer=1, seq=16, batch=1, warmup=1, precision="bf16-true")
    bench.Built("spy", wrap, args, torch.device("cpu")).time_steps(1)
    assert seen == [True, True] and not inside  # the warm-up step and the timed one
    assert bench.variant_names(["tk_plain_launch_order", "tk_no_pdl"]) == ["thunder [tk] plain launch order"] * 2
    built = bench.variants(False, torch.device("cpu"), ())
    assert callable(built["thunder [tk] plain launch order"].around_step)


def test_litgpt_step_clocks_per_round_flag_a_throttled_round():
    import importlib.util

    spec = importlib.util.spec_from_file_location("litgpt_step_bench_clocks", ROOT / "benchmarks" / "litgpt_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    class Samples:  # a ClockSampler's reading: round windows are (t, t + 1); t = 30 ran throttled, t = 40 hot
        def between(self, t0, t1):
            return {"sm_mhz": 900.0 if t0 == 30 else 1750.0, "watts": 690.0, "celsius": 88.0 if t0 == 40 else 70.0,
                    "samples": 9}

    rows = [{"variant": "thunder [tk]", "_windows": [(10, 11), (30, 31)]},
            {"variant": "thunder default", "_windows": [(20, 21), (40, 41)]},
            {"variant": "eager"}]  # timed before the sampler saw anything: no rounds
    warnings = bench.attach_clocks(rows, Samples())
    assert [len(r["clocks_rounds"]) for r in rows] == [2, 2, 0]
    assert all("_windows" not in r for r in rows)
    assert len(warnings) == 2
    assert "thunder [tk] round 2 ran at 900 MHz" in warnings[0]
    assert "thunder default round 2" in warnings[1] and "88 C" in warnings[1]

    class Nothing:  # no nvidia-smi
        def between(self, t0, t1):
            return None

    rows = [{"variant": "thunder [tk]", "_windows": [(1, 2)]}]
    assert bench.attach_clocks(rows, Nothing()) == [] and rows[0]["clocks_rounds"] == [None]


def test_gemm_clocks_parses_on_cpu():
    r = run_bench("gemm_clocks.py", "--help")
    assert r.returncode == 0 and "--group-rows" in r.stdout
    r = run_bench("gemm_clocks.py", "--problems", "8192:2048:fwd")
    assert r.returncode != 0 and "M:K:N:fwd|dX|dW" in r.stderr


def test_nvlink_store_probe_interleaved_kernel_moves_every_peer_block_in_triton_interpreter():
    """The probe's Triton kernel, run by Triton's CPU interpreter: block b serves peer b % peers, tails masked."""
    pytest.importorskip("triton")
    code = """
import sys, torch
sys.path.insert(0, %r)
import nvlink_store_probe as p
for peers in (1, 3, 7):
    for n in (1, 4095, 4096 * 2 + 17):
        srcs = [torch.randn(n) for _ in range(peers)]
        dsts = [torch.full((n + 8,), float("nan")) for _ in range(peers)]
        p.launch_interleaved([(d[:n], s) for d, s in zip(dsts, srcs)], n)
        assert all(torch.equal(d[:n], -s) and d[n:].isnan().all() for d, s in zip(dsts, srcs)), (peers, n)
print("ok")
""" % str(ROOT / "benchmarks")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_attention_qkv_grad_benchmark_parses_and_its_peer_is_the_reference():
    """The benchmark's peer (the rope backward and concatenation it compiles) computes ops.qkv_grad_reference, on
    CPU float64, for a partial rope and a table longer than the sequence."""
    import importlib.util

    import torch

    from thunder_tk import ops

    r = run_bench("attention_qkv_grad.py", "--help")
    assert r.returncode == 0 and "--shapes" in r.stdout and "--tables" in r.stdout, r.stderr[-3000:]
    r = run_bench("attention_qkv_grad.py", "--tables", "float16")
    assert r.returncode == 2 and "invalid choice: 'float16'" in r.stderr, r.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("qkv_grad_bench", ROOT / "benchmarks" / "attention_qkv_grad.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time
    g = torch.Generator().manual_seed(0)
    dq, dk, dv = (torch.randn(2, h, 9, 64, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    cos, sin = ops.rope_tables(12, 32, torch.float64, "cpu")
    got = bench.rope_back_and_cat(dq, dk, dv, cos, sin)
    assert torch.allclose(got, ops.qkv_grad_reference(dq, dk, dv, cos, sin), rtol=1e-12, atol=1e-12)


def test_linear_rope_benchmark_parses_and_its_peer_is_the_reference():
    """The benchmark's peer (a linear, then the split, the 16-bit rope and the copy of v it compiles) gives
    ops.linear_rope_reference's q, k and v on CPU in bfloat16, for a partial rope and a table longer than the
    sequence; and ops.rope_tables are LitGPT's (the n/2 angles repeated)."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    from thunder_tk import ops

    r = run_bench("linear_rope.py", "--help")
    assert r.returncode == 0 and "--shapes" in r.stdout and "--png" in r.stdout, r.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("linear_rope_bench", ROOT / "benchmarks" / "linear_rope.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time
    Hq, Hkv, D, n = 4, 2, 64, 32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 48, generator=g).bfloat16()
    w = (torch.randn((Hq + 2 * Hkv) * D, 48, generator=g) / 48 ** 0.5).bfloat16()
    cos, sin = ops.rope_tables(12, n, torch.bfloat16, "cpu")
    assert torch.equal(cos[:, : n // 2], cos[:, n // 2:]) and torch.equal(sin[:, : n // 2], sin[:, n // 2:])
    got = bench.split_and_rope(F.linear(x, w), cos, sin, Hq, Hkv, D)
    want = ops.linear_rope_reference(x, w, cos, sin, Hq, Hkv, D)
    for part, gt, wt in zip("qkv", got, want):
        assert gt.dtype == torch.bfloat16 and gt.shape == wt.shape and gt.is_contiguous(), part
        assert ((gt.double() - wt).norm() / wt.norm()).item() < 1e-2, part
    # Beyond the rope's columns the heads pass through: the same bits as the projection's output.
    assert torch.equal(got[0][..., n:], ops.qkv_head_views(F.linear(x, w), Hq, Hkv, D)[0][..., n:])


def test_embedding_backward_benchmark_parses_and_its_peer_is_the_reference():
    """The benchmark's peer op (aten.embedding_dense_backward, which its compiled peer also calls) is
    ops.embedding_backward_reference on CPU: repeated ids summed, rows no id names zero."""
    import importlib.util

    import torch

    from thunder_tk import ops

    r = run_bench("embedding_backward.py", "--help")
    assert r.returncode == 0 and "--shapes" in r.stdout and "--png" in r.stdout, r.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("embedding_backward_bench",
                                                  ROOT / "benchmarks" / "embedding_backward.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time
    g = torch.Generator().manual_seed(0)
    V = 50
    indices = torch.randint(0, V // 2, (3, 40), generator=g)  # repeats, and rows past V/2 left zero
    grad = torch.randn(3, 40, 24, generator=g)
    want = ops.embedding_backward_reference(grad, indices, V)
    got = bench.dense_backward(grad, indices, V)
    assert got.shape == (V, 24) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    got = bench.dense_backward(grad.bfloat16(), indices, V)
    assert got.dtype == torch.bfloat16 and ((got.double() - want).norm() / want.norm()).item() < 1e-2


def test_per_shape_benchmarks_share_their_command_line_and_report(tmp_path, capsys):
    """common.shape_arguments and common.report, which the per-shape kernel benchmarks (gemm_sum, linear_rope,
    embedding_backward, attention_qkv_grad) use: defaults, a shape subset, an unknown shape refused, the table, the
    JSON and, where matplotlib is installed, the chart."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common

    shapes = {"small": 1, "large": 2}
    a = common.shape_arguments("demo", shapes, rounds=3, argv=[])
    assert (a.json, a.png, a.shapes, a.rounds) == ("out/demo.json", None, ["small", "large"], 3)
    a = common.shape_arguments("demo", shapes, argv=["--shapes", "large", "--json", str(tmp_path / "d.json")])
    assert a.shapes == ["large"] and a.rounds == 5
    with pytest.raises(SystemExit):
        common.shape_arguments("demo", shapes, argv=["--shapes", "medium"])
    own = common.shape_arguments("demo", shapes, argv=["--tables", "a", "b"],
                                 extend=lambda p: p.add_argument("--tables", nargs="+", default=["a"]))
    assert own.tables == ["a", "b"] and own.shapes == ["small", "large"]
    rows = [{"shape": "large", "tk_us": 10.0, "peer_us": 12.5}]
    common.report(a, "demo", rows, ["shape", "tk_us", "peer_us"], "demo (us)", {"tk": "tk_us", "peer": "peer_us"})
    assert json.loads((tmp_path / "d.json").read_text())["rows"] == rows
    assert "peer_us" in capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401  (the charts' optional dependency)
    except ImportError:
        return
    a.png = str(tmp_path / "d.png")
    common.report(a, "demo", rows, ["shape", "tk_us"], "demo (us)", {"tk": "tk_us", "peer": "peer_us"})
    assert (tmp_path / "d.png").stat().st_size > 0


def test_launch_gaps_parses_and_needs_a_gpu():
    r = run_bench("launch_gaps.py", "--help")
    assert r.returncode == 0 and "--chain" in r.stdout, r.stderr[-3000:]
    r = run_bench("launch_gaps.py", "--chain", "0")
    assert r.returncode == 2 and "must be >= 1" in r.stderr, r.stderr[-3000:]
    import torch

    if not torch.cuda.is_available():
        r = run_bench("launch_gaps.py")
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr[-3000:]


def test_rms_norm_benchmark_parses_and_its_peers_are_the_references():
    """The benchmark's peers, eager on CPU: the forward (residual add and LitGPT's norm), the closed-form backward
    from the saved s and rstd, and autograd through the forward give ops.rms_norm_reference's and
    ops.rms_norm_backward_reference's outputs (fp32 to its rounding, bf16 to the dtype's); without a GPU the
    benchmark exits with a message."""
    import importlib.util

    import torch

    from thunder_tk import ops

    r = run_bench("rms_norm.py", "--help")
    assert r.returncode == 0 and "--shapes" in r.stdout and "--png" in r.stdout, r.stderr[-3000:]
    if not torch.cuda.is_available():
        r = run_bench("rms_norm.py", "--shapes", "llama-3.2-1b")
        assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr, r.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("rms_norm_bench", ROOT / "benchmarks" / "rms_norm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time

    def rel(got, want):
        return ((got.double() - want.double()).norm() / want.double().norm()).item()

    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        x, res, dy, dres = (torch.randn(2, 5, 64, generator=g).to(dtype) for _ in range(4))
        w = (1 + 0.5 * torch.randn(64, generator=g)).to(dtype)
        y, rstd, s = bench.add_rms_norm(x, res, w, 1e-5)
        want_y, want_rstd, want_s = ops.rms_norm_reference(x, w, 1e-5, res)
        assert torch.equal(s, want_s) and y.dtype == dtype and rstd.dtype == torch.float32
        assert rstd.shape == (2, 5, 1) and rel(rstd, want_rstd) < 1e-6 and rel(y, want_y) < tol
        want_dx, want_dw = ops.rms_norm_backward_reference(dy, s, rstd, w, dres)
        dx, dw = bench.rms_norm_backward_math(dy, s, rstd, w, dres)
        assert dx.dtype == dtype and dw.dtype == dtype and dw.shape == (64,)
        assert rel(dx, want_dx) < tol and rel(dw, want_dw) < tol
        dx, dw = bench.training_step(bench.add_rms_norm, x.clone().requires_grad_(), res,
                                     w.clone().requires_grad_(), dy, dres, 1e-5)
        assert rel(dx, want_dx) < tol and rel(dw, want_dw) < tol


def test_region_calls_times_both_ways_and_writes_json(monkeypatch, tmp_path, capsys):
    """benchmarks/region_calls.py with one tiny region in place of a LitGPT step's (compiling a step's regions on a
    CPU takes minutes): a row per region with both host times, and the JSON."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import region_calls

    region = (lambda a, b: [torch.relu(a * 2 + b)], (torch.randn(4, 8), torch.randn(4, 8)))
    monkeypatch.setattr(region_calls, "regions_of_a_step", lambda device, n_layer: [region])
    out = tmp_path / "calls.json"
    region_calls.main(["--device", "cpu", "--calls", "5", "--rounds", "2", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["direct_us"] > 0 and rows[0]["torch_compile_us"] > 0
    assert "saved a call" in capsys.readouterr().out


def _adamw_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("adamw_bench", ROOT / "benchmarks" / "adamw.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time
    return bench


def test_adamw_benchmark_parses_builds_its_cases_and_counts_bytes(tmp_path, capsys):
    """benchmarks/adamw.py's CPU parts: the command line, the model's parameter shapes from LitGPT's config on the
    meta device (Llama-3.2-1B: 115 tensors, 1.498 B parameters), the small tensors, the bytes an update moves
    (7 x the element size per element), a row's figures and the JSON; without a GPU it exits with a message."""
    import torch

    r = run_bench("adamw.py", "--help")
    assert r.returncode == 0 and "--dtypes" in r.stdout and "--chart" in r.stdout and "--no-graphs" in r.stdout, \
        r.stderr[-3000:]
    r = run_bench("adamw.py", "--small-min", "100", "--small-max", "10")
    assert r.returncode == 1 and "--small-max >= --small-min" in r.stderr, r.stderr[-3000:]
    if not torch.cuda.is_available():
        r = run_bench("adamw.py", "--shapes", "small")
        assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr, r.stderr[-3000:]
    bench = _adamw_bench()
    a = bench.arguments([])
    assert (a.shapes, a.dtypes, a.model, a.n_layer, a.rounds, a.json, a.png) == (
        ["model", "small"], ["bf16", "fp32"], "Llama-3.2-1B", None, 5, "out/adamw.json", None)
    assert (a.small_count, a.small_min, a.small_max, a.no_graphs, a.no_check) == (2000, 4096, 65536, False, False)
    assert a.max_norm == 1.0 and bench.arguments(["--max-norm", "0"]).max_norm == 0.0
    assert bench.arguments(["--chart", "x.png"]).png == "x.png"  # --chart is --png

    shapes = bench.model_shapes("Llama-3.2-1B")
    assert len(shapes) == 115 and bench.numel(shapes) == 1_498_482_688
    assert (128256, 2048) in shapes and (2048,) in shapes
    assert len(bench.model_shapes("Llama-3.2-1B", n_layer=2)) == 3 + 2 * 7
    small = bench.small_shapes(2000, 4096, 65536)
    assert len(small) == 2000 and all(len(s) == 1 and 4096 <= s[0] <= 65536 for s in small)
    assert small == bench.small_shapes(2000, 4096, 65536) != bench.small_shapes(2000, 4096, 65536, seed=1)
    assert bench.bytes_moved([(2, 3), (5,)], "bf16") == 7 * 2 * 11
    assert bench.bytes_moved([(2, 3), (5,)], "fp32") == 7 * 4 * 11
    assert round(bench.bytes_moved(shapes, "bf16") / 1e9, 1) == 21.0  # the 21 GB torch's fused AdamW moves a step

    a = bench.arguments(["--shapes", "small", "model", "--dtypes", "fp32", "--small-count", "3", "--model",
                         "pythia-14m", "--n-layer", "1", "--json", str(tmp_path / "adamw.json")])
    cases = bench.cases(a)
    assert [c["shape"] for c in cases] == ["3 small fp32", "pythia-14m (1 layers) fp32"]
    assert [(c["case"], c["dtype"], c["precision"], c["model"]) for c in cases] == [
        ("small", "fp32", "bf16-mixed", None), ("model", "fp32", "bf16-mixed", "pythia-14m")]

    # The clipped ways run on CPU tensors (torch's paths inside tk AdamW): each clips and updates every parameter.
    ps = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    gs, ms, vs = ([torch.randn(5, 3).abs() for _ in ps] for _ in range(3))
    opts = bench.optimizers(ps, gs, ms, vs, bench.STEP, torch.device("cpu"))
    before = [p.detach().clone() for p in ps]
    ways = bench.clipped_ways(opts, ps, 1e-3)
    assert list(ways) == bench.CLIPPED
    ways["clip + tk AdamW"]()
    assert opts["tk AdamW"].routes["torch"] == 2 and not torch.equal(ps[0], before[0])
    ways["clip + fused AdamW"]()
    total = torch.cat([p.grad.flatten() for p in ps]).norm()
    assert total.item() == pytest.approx(1e-3, rel=1e-3)  # torch's clip scaled the gradients in place

    times = {"tk": [1.0, 2.0, 1.5], "tk AdamW": [2.0, 2.0, 2.0], "fused": [3.0, 3.0, 3.0], "fused AdamW": [4.0] * 3,
             "foreach AdamW": [8.0] * 3, "tk graph": [1.0] * 3, "fused graph": [2.5] * 3,
             "clip + tk AdamW": [2.5] * 3, "clip + fused AdamW": [5.5] * 3}
    check = {"elements": 10, "differing": {"params": 1, "exp_avg": 0, "exp_avg_sq": 2}, "total_differing": 3,
             "max_abs_diff": {"params": 1e-3, "exp_avg": 0.0, "exp_avg_sq": 2e-6}, "groups": 1}
    row = bench.summarize(cases[1], times, [], check=check, tk_adamw_routes={"tk": 16, "torch": 0, "declined": {}})
    moved = bench.bytes_moved(cases[1]["shapes"], "fp32")
    assert row["tensors"] == len(cases[1]["shapes"]) and row["gb_moved"] == moved / 1e9 and "shapes" not in row
    assert row["tk ms"] == 1.5 and row["tk GB/s"] == pytest.approx(moved / 1.5e-3 / 1e9)
    assert row["fused / tk"] == 2.0 and row["fused AdamW / tk AdamW"] == 2.0
    assert row["foreach AdamW / tk AdamW"] == 4.0 and row["fused graph / tk graph"] == 2.5
    assert row["clip + tk AdamW ms"] == 2.5 and row["clip + fused AdamW / clip + tk AdamW"] == 2.2
    assert "clip + tk AdamW GB/s" not in row  # they move more than the update's bytes
    assert row["ms_rounds"] == times and row["step"] == bench.STEP and row["hyper"] == bench.HYPER
    del times["tk graph"], times["fused graph"], times["clip + tk AdamW"], times["clip + fused AdamW"]
    bare = bench.summarize(cases[0], times, [], check=None)
    assert bare["tk graph ms"] is None and bare["fused graph / tk graph"] is None
    failed = {"shape": "x fp32", "dtype": "fp32", "error": "OutOfMemoryError: CUDA out of memory"}
    bench.finish(a, [row, bare, failed])
    out = capsys.readouterr().out
    assert "ms per update" in out and "peer / tk" in out and "x fp32: FAILED (OutOfMemoryError" in out
    assert "3 of 3 x 10 elements differ (params 1, exp_avg 0, exp_avg_sq 2" in out
    assert "3 small fp32: not checked" in out
    assert out.strip().splitlines()[-1].startswith("fused/tk pythia-14m (1 layers) fp32 2.00x, 3 small fp32 2.00x")
    saved = json.loads((tmp_path / "adamw.json").read_text())
    assert saved["benchmark"] == "adamw" and "torch" in saved["environment"]
    assert [r["shape"] for r in saved["rows"]] == ["pythia-14m (1 layers) fp32", "3 small fp32", "x fp32"]
    assert saved["rows"][0]["check"]["total_differing"] == 3 and saved["rows"][0]["tk_adamw_routes"]["tk"] == 16


def test_adamw_benchmark_check_and_case_plumbing_on_cpu(monkeypatch):
    """The check counts what differs between two updates of the same inputs (each on its own copy, in groups within
    the budget), and a case runs its ways over one set of tensors on a CPU, with torch's fused update standing in
    for tk's and the timing stood in for: the optimizers update the benchmark's tensors, tk's AdamW routes each
    parameter (here all to torch: not on a GPU), and the row carries the check."""
    import torch

    bench = _adamw_bench()
    cpu = torch.device("cpu")
    shapes = [(37,), (5, 8), (3,), (64,)]
    for budget, groups in ((1e9, 1), (1.0, 4)):
        lists = bench.make_state(shapes, torch.float32, cpu)
        assert all((v >= 0).all() for v in lists[3])
        before = [t.clone() for t in lists[0]]
        got = bench.check(bench.fused_update(10, cpu), bench.fused_update(10, cpu), *lists, budget)
        assert got["groups"] == groups and got["elements"] == 37 + 40 + 3 + 64
        assert got["total_differing"] == 0 and got["max_abs_diff"] == {k: 0.0 for k in bench.STATE}
        assert not any(torch.equal(a, b) for a, b in zip(before, lists[0]))  # "mine" updated the tensors in place
    # another step count: other bias corrections, so other parameters; the moments do not depend on it
    lists = bench.make_state(shapes, torch.float32, cpu)
    got = bench.check(bench.fused_update(10, cpu), bench.fused_update(11, cpu), *lists, 1e9)
    assert got["differing"]["params"] > 0 and got["differing"]["exp_avg"] == got["differing"]["exp_avg_sq"] == 0
    assert got["max_abs_diff"]["params"] > 0
    nan = float("nan")
    assert bench.differing(torch.tensor([1.0, nan, 3.0]), torch.tensor([1.0, nan, 4.0])) == (1, 1.0)  # NaN = NaN
    assert bench.differing(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0])) == (1, float("inf"))

    monkeypatch.setattr(bench, "tk_update", lambda step: bench.fused_update(step, cpu))
    timed = []

    def in_turns(fns, rounds, warmup_ms, rep_ms):
        for fn in fns.values():
            fn()
        timed.append(list(fns))
        return {name: [1.0 + i for i in range(rounds)] for name in fns}

    monkeypatch.setattr(bench, "interleaved_times", in_turns)
    a = bench.arguments(["--shapes", "small", "--dtypes", "bf16", "--small-count", "40", "--small-min", "1",
                         "--small-max", "300", "--rounds", "3"])
    (case,) = bench.cases(a)
    with bench.ClockSampler() as clocks:
        row = bench.measure(case, a, clocks, cpu)
    assert timed == [bench.WAYS + bench.CLIPPED]  # no graphs off a GPU
    assert row["clip + fused AdamW / clip + tk AdamW"] == 1.0
    assert row["tk ms"] == 2.0 and row["fused / tk"] == 1.0 and row["peak_gib"] is None
    assert row["check"]["total_differing"] == 0 and row["check"]["elements"] == bench.numel(case["shapes"])
    assert row["tk_adamw_routes"] == {"tk": 0, "torch": 40,
                                      "declined": {"the parameter is on cpu, not a CUDA device": 40}}


def test_litgpt_step_tk_adamw_variants_pick_their_optimizer(monkeypatch, tmp_path, capsys):
    """The "... tk AdamW" variants: their aliases resolve, their wraps make thunder_tk.optim.AdamW (same learning rate)
    while every other variant keeps torch's AdamW, the wrap's other settings (around_step) stay with it, and each
    row names its optimizer, a tk AdamW row with its routes."""
    import importlib.util

    import torch

    import thunder_tk.optim

    spec = importlib.util.spec_from_file_location("litgpt_step_bench_adamw", ROOT / "benchmarks" / "litgpt_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    names = ["thunder [tk] tk AdamW", "thunder default tk AdamW", "torch.compile tk AdamW"]
    assert bench.variant_names(["tk_adamw", "default_tk_adamw", "compile-tk-adamw"]) == names
    assert all(n in bench.VARIANT_NAMES for n in names)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    built = bench.variants(False, cpu, ())
    assert tuple(built)[:len(bench.VARIANT_NAMES)] == bench.VARIANT_NAMES
    assert [n for n, w in built.items() if hasattr(w, "make_optimizer")] == names
    assert all(bench.optimizer_name(built[n], cpu) == "tk AdamW" for n in names)
    weight = torch.nn.Parameter(torch.zeros(2))
    for n in names:
        opt = built[n].make_optimizer([weight], cpu)
        assert type(opt) is thunder_tk.optim.AdamW and opt.param_groups[0]["lr"] == bench.LR == 1e-4
    assert bench.optimizer_name(built["thunder [tk]"], cuda) == "torch fused AdamW"
    assert bench.optimizer_name(built["torch.compile"], cpu) == "torch AdamW"
    assert not hasattr(torch.compile, "make_optimizer")  # the shared torch.compile is not the variant's wrap

    setting, Spy, inside, seen = spying_setting()

    import argparse

    wrap = bench.with_tk_adamw(bench.around_steps(lambda m: Spy(m), setting))
    args = argparse.Namespace(model="pythia-14m", n_layer=1, seq=16, batch=1, warmup=1, precision="bf16-true")
    v = bench.Built("spy", wrap, args, cpu)
    v.time_steps(1)
    assert seen == [True, True] and not inside
    assert type(v.opt) is thunder_tk.optim.AdamW and v.opt.param_groups[0]["lr"] == bench.LR == 1e-4
    assert v.optimizer_name == "tk AdamW" and v.opt.routes["tk"] == 0 and v.opt.routes["torch"] > 0  # off a GPU
    plain = bench.Built("plain", lambda m: m, args, cpu)
    assert type(plain.opt) is torch.optim.AdamW and plain.optimizer_name == "torch AdamW"

    real = bench.variants
    monkeypatch.setattr(bench, "variants",
                        lambda *a: {**real(*a), "thunder [tk] tk AdamW": bench.with_tk_adamw(lambda m: m)})
    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["litgpt_step.py", "--device", "cpu", "--model", "pythia-14m", "--n-layer", "1",
                                      "--seq", "16", "--batch", "1", "--warmup", "1", "--steps", "1",
                                      "--only", "eager", "tk_adamw", "--json", str(out)])
    bench.main()
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["eager"]["optimizer"] == "torch AdamW" and "optimizer_routes" not in rows["eager"]
    tk_row = rows["thunder [tk] tk AdamW"]
    assert tk_row["optimizer"] == "tk AdamW" and tk_row["tokens_per_s"] > 0
    assert tk_row["optimizer_routes"]["tk"] == 0 and tk_row["optimizer_routes"]["torch"] > 0
    assert list(tk_row["optimizer_routes"]["declined"]) == ["the parameter is on cpu, not a CUDA device"]
    assert tk_row["loss"] == pytest.approx(rows["eager"]["loss"])  # the same model and batch
    assert "fused AdamW (tk AdamW where named)" in capsys.readouterr().out


def test_litgpt_step_max_norm_clips_each_optimizer_its_way(monkeypatch, tmp_path, capsys):
    """--max-norm: no clipping without it; tk AdamW clips with its own clip_grad_norm_ (the gradients left as they
    are, the clip pending for its step), torch's AdamW with pretrain's clip_gradients (the gradients scaled in place
    to the norm); a run says so in its header and its rows."""
    import importlib.util

    import torch

    import thunder_tk.optim

    spec = importlib.util.spec_from_file_location("litgpt_step_bench_clip", ROOT / "benchmarks" / "litgpt_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    p = torch.nn.Parameter(torch.zeros(4))
    for make in (thunder_tk.optim.AdamW, torch.optim.AdamW):
        opt = make([p])
        p.grad = torch.full((4,), 3.0)
        bench.clipping(opt, None)()
        assert torch.equal(p.grad, torch.full((4,), 3.0))
        bench.clipping(opt, 0.5)()
        if make is thunder_tk.optim.AdamW:
            assert torch.equal(p.grad, torch.full((4,), 3.0)) and opt._clip is not None
        else:
            assert p.grad.norm().item() == pytest.approx(0.5, rel=1e-5)

    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["litgpt_step.py", "--device", "cpu", "--model", "pythia-14m", "--n-layer", "1",
                                      "--seq", "16", "--batch", "1", "--warmup", "1", "--steps", "1", "--max-norm",
                                      "0.01", "--only", "eager", "--json", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["max_norm"] == 0.01 and rows[0]["tokens_per_s"] > 0
    assert "gradients clipped to norm 0.01" in capsys.readouterr().out


def _bench_module(script: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # no CUDA work at import time
    return bench


def test_the_benchmarks_read_their_issues_goals_off_the_rows():
    """gemm.py (issue 3), attention.py (issue 4) and litgpt_step.py (issue 6) each print whether the run met its
    issue's goal, naming what fell short, and say when a run does not hold the goal's whole set of points."""
    gemm = _bench_module("gemm.py", "gemm_goal")
    rows = [{"problem": p, "layout": lay, "ratio": 1.06} for p in gemm.ISSUE_PROBLEMS for lay in gemm.LAYOUTS]
    assert len(rows) == 27 and gemm.goal_verdict(rows).startswith("goal: geometric mean >= 1.05 and none below "
                                                                  "0.95: met")
    rows[0]["ratio"] = 0.94
    line = gemm.goal_verdict(rows)
    assert ": not met" in line and "sq4096 fwd 0.940" in line and "not the issue's set" not in line
    assert "not the issue's set" in gemm.goal_verdict(rows[3:])

    attention = _bench_module("attention.py", "attention_goal")
    rows = [{"S": S, "D": D, "causal": c, "fwd_vs_cudnn": 1.2, "bwd_vs_cudnn": 1.06}
            for S in (1024, 2048, 4096) for D in (64, 128) for c in (False, True)]
    assert attention.goal_verdict(rows).endswith("(8 values): met")
    rows[2]["bwd_vs_cudnn"] = 0.9  # S = 1024 is outside the goal
    rows[6]["bwd_vs_cudnn"] = 1.03  # S = 2048, D = 128, full
    assert attention.goal_verdict(rows).endswith("not met: bwd S 2048 full 1.030x")
    rows[7]["fwd_vs_cudnn"] = None
    assert "incomplete (S 2048 causal fwd not measured)" in attention.goal_verdict(rows)

    step = _bench_module("litgpt_step.py", "litgpt_step_goal")
    rows = [{"variant": "thunder default", "tokens_per_s": 100.0, "peak_gib": 22.4},
            {"variant": "torch.compile", "tokens_per_s": 110.0, "peak_gib": 21.0},
            {"variant": "thunder [tk]", "tokens_per_s": 116.0, "peak_gib": 20.2},
            {"variant": "thunder [tk] tk AdamW", "tokens_per_s": 114.0, "peak_gib": 20.2},
            {"variant": "thunder [tk] broken", "tokens_per_s": None, "peak_gib": None}]
    first, second = step.goal_verdicts(rows)
    assert first.startswith("goal (thunder [tk]): met") and "1.160x Thunder default (ok 1.15)" in first
    assert second.startswith("goal (thunder [tk] tk AdamW): not met") and "(below 1.15)" in second
    assert step.goal_verdicts(rows[1:]) == []
    assert "torch.compile not run" in step.goal_verdicts([rows[0], rows[2]])[0]
