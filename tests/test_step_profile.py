"""THUNDER_TK_PROFILE_STEPS: the steps' GPU time by stream and kernel kind (thunder_tk/step_profile.py), and the
tiny config run with it on the CPU."""

import json
from pathlib import Path

import pytest
import torch

from thunder_tk.litgpt_models import ConfigError
from thunder_tk.step_profile import (StepProfiler, idle_gaps, kernel_kind, kernel_label, length, overlap, parse_steps,
                                     summarize, union)

MS = 1_000_000  # ns
# The tiny config's runs here check the profiler's window, the records' flags and the pace, none of which depends on
# the model's depth: one of its two layers (the second layer's tracing is about 3 s of each run on two CPUs).
ONE_LAYER = ["--model_config.n_layer", "1"]


def test_parse_steps():
    assert parse_steps(None) is None and parse_steps("") is None and parse_steps("  ") is None
    assert parse_steps("45") == (45, 1) and parse_steps("30:3") == (30, 3) and parse_steps(" 2:1 ") == (2, 1)
    for bad in ("1", "0:3", "x", "5:0", "5:-1", "5:two", "3.5"):
        with pytest.raises(ConfigError, match=rf"THUNDER_TK_PROFILE_STEPS='{bad}'.*first >= 2"):
            parse_steps(bad)


def test_interval_algebra():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (10, 11)]) == [(0, 4), (5, 7), (10, 11)]
    assert union([(0, 10), (2, 3)]) == [(0, 10)]
    assert length([(0, 4), (5, 7)]) == 6
    a, b = [(0, 4), (6, 10)], [(2, 7), (9, 12)]
    assert overlap(a, b) == 2 + 1 + 1 and overlap(b, a) == 4 and overlap(a, []) == 0 and overlap(a, a) == length(a)


def test_summary_splits_the_main_streams_idle_time():
    """Two steps; stream 7 computes, stream 9 gathers. The compute stream is idle 0-2 ms (the gather runs: the
    compute waits on it), 10-12 ms (nothing runs: the host) and 14-15 (the gather again) of a 0-20 ms window."""
    kernels = [
        {"name": "void tk::p2p::all_gather_kernel<...>", "stream": 9, "start": 0, "end": 3 * MS},
        {"name": "void tk::gemm::gemm_kernel<...>", "stream": 7, "start": 2 * MS, "end": 6 * MS},
        {"name": "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "stream": 7, "start": 6 * MS, "end": 10 * MS},
        {"name": "triton_poi_fused_mul_silu_0", "stream": 7, "start": 12 * MS, "end": 14 * MS},
        {"name": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "stream": 9, "start": 13 * MS, "end": 15 * MS},
        {"name": "void tk::attention::forward<128>", "stream": 7, "start": 15 * MS, "end": 20 * MS},
    ]
    s = summarize(kernels, steps=2, wall_s=0.050)
    assert s["wall_ms"] == pytest.approx(25.0) and s["window_ms"] == pytest.approx(10.0)  # per step
    assert s["main_stream"] == 7 and s["gpu_activities"] == 6
    assert s["main_busy_ms"] == pytest.approx(15 / 2) and s["main_idle_ms"] == pytest.approx(5 / 2)
    assert s["main_idle_other_stream_busy_ms"] == pytest.approx(3 / 2)  # 0-2 and 14-15
    assert s["main_idle_all_idle_ms"] == pytest.approx(2 / 2)  # 10-12
    main, other = s["streams"]
    assert main["main"] and main["stream"] == 7 and main["kernels"] == 2.0
    assert main["kinds_ms"] == pytest.approx({"gemm": 4.0, "attention": 2.5, "fused (triton)": 1.0})
    assert main["tk_ms"] == pytest.approx(4.5) and main["kernel_ms"] == pytest.approx(7.5)
    assert not other["main"] and other["kinds_ms"] == pytest.approx({"collective": 2.5})
    assert other["busy_ms"] == pytest.approx(2.5)
    assert s["top"][0]["kernel"] == "tk::attention::forward<128>" and s["top"][0]["calls"] == 0.5
    assert summarize([], steps=1, wall_s=0.01) == {"steps": 1, "wall_ms": 10.0, "gpu_activities": 0}


def test_idle_gaps_by_length_with_their_neighbours():
    us = 1000  # ns
    kernels = [{"name": "a", "stream": 1, "start": 0, "end": 10 * us},
               {"name": "b", "stream": 1, "start": 11 * us, "end": 30 * us},  # 1 us after a
               {"name": "c", "stream": 1, "start": 12 * us, "end": 20 * us},  # inside b: no gap
               {"name": "d", "stream": 1, "start": 33 * us, "end": 40 * us},  # 3 us after b (c ended earlier)
               {"name": "e", "stream": 1, "start": 290 * us, "end": 300 * us},  # 250 us: the host
               {"name": "x", "stream": 2, "start": 40 * us, "end": 290 * us}]  # another stream: not counted
    gaps = idle_gaps(kernels, stream=1, top=2)
    assert gaps["buckets"]["< 2 us"] == {"count": 1, "ms": pytest.approx(0.001)}
    assert gaps["buckets"]["2-5 us"] == {"count": 1, "ms": pytest.approx(0.003)}
    assert gaps["buckets"][">= 100 us"] == {"count": 1, "ms": pytest.approx(0.25)}
    assert gaps["buckets"]["5-20 us"]["count"] == gaps["buckets"]["20-100 us"]["count"] == 0
    assert gaps["idle_ms"] == pytest.approx(0.254)
    assert gaps["longest"] == [{"us": 250.0, "after": "d", "before": "e"}, {"us": 3.0, "after": "b", "before": "d"}]
    assert idle_gaps(kernels)["stream"] == 2  # the busiest stream where none is named
    assert idle_gaps([])["idle_ms"] == 0


def test_kernel_kinds():
    assert kernel_kind("void tk::loss::cross_entropy_forward<...>") == "loss"
    assert kernel_kind("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"
    assert kernel_kind("void multi_tensor_apply_kernel<...>") == "optimizer"
    assert kernel_kind("Memset (Device)") == "copy/fill" and kernel_kind("mystery") == "other"


def test_kernel_labels_keep_every_template_argument():
    """The profile tables' names: two GEMM kernels that differ only in the output type stay apart."""
    gemm = ("void tk::gemm::(anonymous namespace)::gemm_kernel<__nv_bfloat16, (tk::wgmma::major)1, "
            "(tk::wgmma::major)0, 1, 256, false, false, (tk::gemm::(anonymous namespace)::fused)0, {}>("
            "CUtensorMap_st, CUtensorMap_st, CUtensorMap_st, tk::gemm::(anonymous namespace)::extra_maps, "
            "tk::gemm::(anonymous namespace)::kernel_params)")
    assert kernel_label(gemm.format("float")) == ("tk::gemm::gemm_kernel<bf16, major=1, major=0, 1, 256, false, false, "
                                                  "fused=0, float>")
    assert kernel_label(gemm.format("__nv_bfloat16")).endswith("fused=0, bf16>")
    assert kernel_label("void tk::attention::(anonymous namespace)::rope_grad_kernel<__half, float, unsigned int>("
                        "tk::attention::rope_grad_args)") == ("tk::attention::rope_grad_kernel<fp16, float, "
                                                              "unsigned int>")
    adam = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "FusedOptimizerTensorListMetadata<4>, float*, bool>(at::native::(anonymous namespace)::"
            "FusedOptimizerTensorListMetadata<4>, float*, bool)")
    assert kernel_label(adam) == ("at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, float*, "
                                  "bool>")
    for plain in ("triton_poi_fused__to_copy_1", "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "Memset (Device)"):
        assert kernel_label(plain) == plain


def test_profiler_off_unless_asked_for(tmp_path):
    p = StepProfiler(tmp_path, 0, torch.device("cpu"), environ={})
    p.before(2)
    assert not p.active
    p.after(2)
    p.finish()
    assert not list(tmp_path.iterdir()) and p.done == 0 and p.spent_s == 0.0


def test_tiny_run_profiles_the_steps_asked_for(tmp_path, monkeypatch):
    """On the CPU the profile has no GPU activities, but the window, the records' flags and the pace that leaves
    the profiled steps out are those of a GPU run."""
    pytest.importorskip("litgpt")
    from thunder_tk.cli import main

    config = Path(__file__).resolve().parents[1] / "litgpt_configs" / "tiny.yaml"
    monkeypatch.setenv("THUNDER_TK_PROFILE_STEPS", "3:2")
    assert main(["pretrain", "--config", str(config), "--out_dir", str(tmp_path), "--train.max_steps", "6",
                 "--train.log_interval", "1", "--no-checkpoint", *ONE_LAYER]) == 0
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["first_step"] == 3 and profile["steps"] == 2 and profile["rank"] == 0
    assert profile["wall_ms"] > 0 and profile["gpu_activities"] == 0
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s.get("profiled")] == [3, 4]
    summary = json.loads((tmp_path / "summary.json").read_text())
    # Steps 2, 5 and 6 are the pace: the profiled ones are left out of both.
    assert summary["tokens_per_s_after_first_step"] > 0 and summary["step_seconds_median_after_first_step"] > 0
    # A window past the run's end stops with the run.
    out2 = tmp_path / "late"
    monkeypatch.setenv("THUNDER_TK_PROFILE_STEPS", "5:10")
    assert main(["pretrain", "--config", str(config), "--out_dir", str(out2), "--train.max_steps", "6",
                 "--no-checkpoint", *ONE_LAYER]) == 0
    assert json.loads((out2 / "profile.json").read_text())["steps"] == 2


def test_bad_setting_fails_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    pytest.importorskip("litgpt")
    from thunder_tk.cli import main

    config = Path(__file__).resolve().parents[1] / "litgpt_configs" / "tiny.yaml"
    monkeypatch.setenv("THUNDER_TK_PROFILE_STEPS", "1:3")
    assert main(["pretrain", "--config", str(config), "--out_dir", str(tmp_path), "--train.max_steps", "3"]) == 2
    assert "THUNDER_TK_PROFILE_STEPS='1:3'" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_resumed_runs_first_step_is_not_profiled(tmp_path, monkeypatch):
    """Resumed at step 3, the run's first step is step 4, which traces and compiles: a window starting there is
    not profiled (its time would be taken out of a pace that never counted it)."""
    pytest.importorskip("litgpt")
    from thunder_tk.cli import main

    config = Path(__file__).resolve().parents[1] / "litgpt_configs" / "tiny.yaml"
    monkeypatch.delenv("THUNDER_TK_PROFILE_STEPS", raising=False)
    assert main(["pretrain", "--config", str(config), "--out_dir", str(tmp_path), "--train.max_steps", "3",
                 *ONE_LAYER]) == 0
    monkeypatch.setenv("THUNDER_TK_PROFILE_STEPS", "4:1")
    assert main(["pretrain", "--config", str(config), "--out_dir", str(tmp_path), "--train.max_steps", "6",
                 "--resume", "--no-checkpoint", *ONE_LAYER]) == 0
    assert not (tmp_path / "profile.json").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["tokens_per_s_after_first_step"] > 0


def test_profiled_steps_launch_in_plain_order_unless_asked(monkeypatch, tmp_path):
    """A dependently launched kernel's profiled time would include its wait for the one before: profiled steps
    turn dependent launch off for their window (and back on after it), unless THUNDER_TK_PROFILE_LAUNCH_ORDER says
    dependent; a bad value is a config error naming the variable; without tk's kernels the order is "none"."""
    from standins import StandinBuild

    from thunder_tk import ops
    from thunder_tk.step_profile import launch_order_for_profiling, profiling_launch_order

    assert profiling_launch_order({}) == "plain"
    assert profiling_launch_order({"THUNDER_TK_PROFILE_LAUNCH_ORDER": " dependent "}) == "dependent"
    with pytest.raises(ConfigError, match="THUNDER_TK_PROFILE_LAUNCH_ORDER='sideways'"):
        profiling_launch_order({"THUNDER_TK_PROFILE_LAUNCH_ORDER": "sideways"})
    with pytest.raises(ValueError, match="launch order must be"):
        with launch_order_for_profiling("sideways"):
            pass

    StandinBuild(monkeypatch)
    assert ops.dependent_launch() is True
    with launch_order_for_profiling("plain") as order:
        assert order == "plain" and ops.dependent_launch() is False
    assert ops.dependent_launch() is True
    with launch_order_for_profiling("dependent") as order:
        assert order == "dependent" and ops.dependent_launch() is True
    with ops.dependent_launches(False), launch_order_for_profiling("dependent") as order:
        assert order == "plain"  # what the kernels really launch in

    p = StepProfiler(tmp_path, 0, torch.device("cpu"), environ={"THUNDER_TK_PROFILE_STEPS": "2"})
    p.before(2)
    assert p.active and ops.dependent_launch() is False
    p.after(2)
    assert not p.active and ops.dependent_launch() is True
    assert json.loads((tmp_path / "profile.json").read_text())["launch_order"] == "plain"
    with pytest.raises(ConfigError, match="THUNDER_TK_PROFILE_LAUNCH_ORDER"):
        StepProfiler(tmp_path, 0, torch.device("cpu"),
                     environ={"THUNDER_TK_PROFILE_STEPS": "2", "THUNDER_TK_PROFILE_LAUNCH_ORDER": "x"})


def test_without_kernels_the_launch_order_is_none(kernels_not_built):
    from thunder_tk.step_profile import launch_order_for_profiling

    with launch_order_for_profiling("plain") as order:
        assert order == "none"
