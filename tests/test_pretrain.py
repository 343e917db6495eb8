"""`thunder-tk pretrain` on a CPU: configs and their errors, the data stream, checkpoints, and the tiny run."""

import gc
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("litgpt")

from thunder_tk.cli import main
from thunder_tk.data import SyntheticTokens
from thunder_tk.litgpt_models import ConfigError
from thunder_tk.pretrain import (GcClock, OsCounters, StallTracer, bind_cpus, exclusive_cpus, learning_rate,
                                 parse_cpulist, pretrain)
from thunder_tk.pretrain_config import load_config, parse_overrides, precision_of

CONFIGS = Path(__file__).resolve().parents[1] / "litgpt_configs"
TINY = CONFIGS / "tiny.yaml"
# A model small enough that Thunder traces it in seconds.
MICRO = {
    "model_config": {"name": "micro", "block_size": 32, "vocab_size": 128, "padded_vocab_size": 128, "n_layer": 1,
                     "n_head": 2, "n_query_groups": 2, "n_embd": 64, "head_size": 32, "bias": False,
                     "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP", "intermediate_size": 128},
    "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_seq_length": 32, "max_steps": 4,
              "lr_warmup_steps": 1, "log_interval": 1},
}


@pytest.mark.parametrize("name", ["tiny.yaml", "llama-3.2-1b.yaml", "tinyllama-1.1b.yaml"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / name)
    assert config.compiler.executors == ["tk"]


@pytest.mark.parametrize("name", ["llama-3.2-1b.yaml", "tinyllama-1.1b.yaml"])
def test_one_gpu_configs_make_tk_adamw(name):
    """The one-GPU configs name thunder_tk.optim.AdamW with torch's arguments (fused included); on a CPU every
    parameter takes torch's path, with the reason."""
    from thunder_tk.optim import AdamW
    from thunder_tk.pretrain import build_optimizer, optimizer_report

    config = load_config(CONFIGS / name)
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = build_optimizer(config.optimizer, [p])
    assert type(optimizer) is AdamW and optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    p.grad = torch.ones(3)
    optimizer.step()
    assert optimizer_report(optimizer, config.optimizer.class_path) == {
        "class_path": "thunder_tk.optim.AdamW", "tensors_on_tk": 0, "tensors_on_torch": 1,
        "first_reason": "the parameter is on cpu, not a CUDA device"}


def test_eight_gpu_config_needs_eight_processes(tmp_path):
    config = load_config(CONFIGS / "llama-2-7b.yaml", {"devices": 8})
    assert config.devices == 8 and config.train.micro_batch_size == 1
    with pytest.raises(ConfigError, match="torchrun --nnodes 1 --nproc_per_node 8"):
        pretrain(load_config(CONFIGS / "llama-2-7b.yaml", {"out_dir": str(tmp_path)}))


def test_overrides_are_yaml_values():
    assert parse_overrides(["--train.max_steps", "20", "--compiler.executors=[tk, sdpa]", "--seed", "3"]) == {
        "train": {"max_steps": 20}, "compiler": {"executors": ["tk", "sdpa"]}, "seed": 3}
    config = load_config(TINY, parse_overrides(["--train.max_steps", "7", "--optimizer", "SGD"]))
    assert config.train.max_steps == 7 and config.optimizer.class_path == "torch.optim.SGD"


def test_model_config_fields_replace_those_of_model_name(tmp_path):
    from litgpt import Config

    from thunder_tk.litgpt_models import load_spec
    from thunder_tk.pretrain import model_config_of

    config = load_config(CONFIGS / "llama-2-7b.yaml", parse_overrides(["--model_config.n_layer", "8"]))
    cfg, seq = model_config_of(config)
    named = Config.from_name("Llama-2-7b-hf")
    assert (cfg.n_layer, seq) == (8, 4096)
    assert (cfg.n_embd, cfg.n_head, cfg.intermediate_size, cfg.padded_vocab_size) == (
        named.n_embd, named.n_head, named.intermediate_size, named.padded_vocab_size)
    with pytest.raises(ConfigError, match=r"^model_config.n_layers: not a field of LitGPT's Config$"):
        model_config_of(load_config(CONFIGS / "llama-2-7b.yaml", {"model_config": {"n_layers": 8}}))
    # The benchmarks' YAML loader takes the same combination.
    yaml_path = tmp_path / "short.yaml"
    yaml_path.write_text("model_name: Llama-3.2-1B\nmodel_config:\n  n_layer: 2\n")
    spec = load_spec(str(yaml_path))
    assert spec.config.n_layer == 2 and spec.config.n_query_groups == Config.from_name("Llama-3.2-1B").n_query_groups
    yaml_path.write_text("model_name: Llama-3.2-1B\nmodel_config: [2]\n")
    with pytest.raises(ConfigError, match="model_config: expected a mapping"):
        load_spec(str(yaml_path))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train": {"micro_batchsize": 2}}, "train.micro_batchsize: unknown key"),
        ({"train": {"micro_batch_size": "four"}}, "train.micro_batch_size: expected an integer, got 'four'"),
        ({"train": {"global_batch_size": 6}}, "train.global_batch_size: 6 is not a multiple of train.micro_batch_size (4)"),
        ({"train": {"max_steps": None, "max_tokens": None}}, "train.max_steps: give train.max_steps or train.max_tokens"),
        ({"train": {"max_steps": 0}}, "train.max_steps: must be at least 1"),
        ({"data": {"kind": "web"}}, "data.kind: expected synthetic or text"),
        ({"data": {"kind": "text"}}, "data.paths: text data needs at least one local file"),
        ({"optimizer": {"class_path": "os.system"}}, "optimizer.class_path: only torch.optim optimizers and thunder_tk.optim.AdamW"),
        ({"devices": "many"}, "devices: expected an integer or 'auto'"),
        ({"compiler": {"executors": "tk"}}, "compiler.executors: expected a list"),
        ({"compiler": {"disable": ["gemms"]}}, "compiler.disable: unknown name 'gemms'"),
        ({"compiler": {"disable": "gemm"}}, "compiler.disable: expected a list"),
        ({"compiler": {"cuda_graphs": True, "jit": False}}, "compiler.cuda_graphs: CUDA graphs are captured"),
        ({"compiler": {"cuda_graphs": "yes"}}, "compiler.cuda_graphs: expected"),
        ({"bogus": 1}, "bogus: unknown key"),
        ({"precision": "16-mixed"}, "precision: expected one of bf16-true, bf16-mixed, 32-true"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert message in str(e.value)


def test_run_time_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="train.max_seq_length: 64 exceeds the model's block_size 32"):
        pretrain(load_config(None, {**MICRO, "out_dir": str(tmp_path),
                                     "train": {**MICRO["train"], "max_seq_length": 64}}))
    with pytest.raises(ConfigError, match="compiler.executors: no executor named 'nosuch'"):
        pretrain(load_config(None, {**MICRO, "out_dir": str(tmp_path), "compiler": {"executors": ["nosuch"]}}))


def test_a_model_thunder_cannot_trace_is_one_message_and_trains_without_jit(tmp_path):
    """LitGPT's mixture-of-experts MLP: refused before the model is built, naming the key and the way round."""
    moe = {**MICRO, "out_dir": str(tmp_path), "model_config": {**MICRO["model_config"], "mlp_class_name": "LLaMAMoE",
                                                              "n_expert": 2, "n_expert_per_token": 1}}
    with pytest.raises(ConfigError, match=r"^model_config.mlp_class_name: LitGPT's mixture-of-experts MLP \(LLaMAMoE\)"
                                          r".*`--compiler.jit false` trains it in eager PyTorch$"):
        pretrain(load_config(None, moe))
    summary = pretrain(load_config(None, {**moe, "compiler": {"jit": False},
                                          "train": {**MICRO["train"], "max_steps": 1}}), checkpoints=False)
    assert summary["steps"] == 1


def test_a_sliding_window_model_trains_with_its_mask_built_in_a_few_ops(tmp_path, monkeypatch):
    """pretrain builds sliding-window masks with litgpt_models.vectorize_window_masks (LitGPT's loop over positions
    is traced a write at a time: minutes a layer at 2048), jitted or not, and the two train alike."""
    import thunder_tk.pretrain as pretrain_module
    from thunder_tk.litgpt_models import vectorize_window_masks

    changed = []
    monkeypatch.setattr(pretrain_module, "vectorize_window_masks", lambda m: changed.append(vectorize_window_masks(m)))
    window = {**MICRO, "model_config": {**MICRO["model_config"], "sliding_window_size": 8},
              "train": {**MICRO["train"], "max_steps": 2}}
    losses = []
    for jit in (True, False):
        out = tmp_path / str(jit)
        pretrain(load_config(None, {**window, "out_dir": str(out), "compiler": {"jit": jit}}), checkpoints=False)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in rows if "loss" in r])
    assert changed == [1, 1]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-4), losses


def test_cli_reports_one_message(capsys):
    assert main(["pretrain", "--config", str(TINY), "--train.micro_batchsize", "2"]) == 2
    err = capsys.readouterr().err
    assert "train.micro_batchsize: unknown key" in err and "Traceback" not in err
    assert main(["pretrain", "--config", "missing.yaml"]) == 2
    assert "config file missing.yaml does not exist" in capsys.readouterr().err


def test_synthetic_stream_is_deterministic_and_learnable():
    a, b = SyntheticTokens(512, 64, seed=1), SyntheticTokens(512, 64, seed=1)
    assert torch.equal(a.sample(123), b.sample(123))
    assert not torch.equal(a.sample(123), a.sample(124))
    assert not torch.equal(a.sample(123), SyntheticTokens(512, 64, seed=2).sample(123))
    s = a.sample(7)
    assert s.shape == (65,) and s.dtype == torch.int64 and 0 <= int(s.min()) and int(s.max()) < 512
    steps = (s[1:] - s[:-1]) % 512  # mostly one stride: predictable from context
    assert torch.mode(steps).values.item() > 0 and (steps == torch.mode(steps).values).float().mean() > 0.7


def test_learning_rate_schedule():
    assert learning_rate(0, 100, 1e-3, 10, 1e-5) == pytest.approx(1e-4)
    assert learning_rate(9, 100, 1e-3, 10, 1e-5) == pytest.approx(1e-3)
    assert learning_rate(100, 100, 1e-3, 10, 1e-5) == pytest.approx(1e-5)
    assert 1e-5 < learning_rate(55, 100, 1e-3, 10, 1e-5) < 1e-3


def _losses(out_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """Four steps of MICRO with torch.optim.AdamW in one run: what each resumed run must reproduce."""
    straight = tmp_path_factory.mktemp("straight")
    pretrain(load_config(None, {**MICRO, "out_dir": str(straight)}))
    return straight


@pytest.mark.parametrize("optimizer", ["torch.optim.AdamW", "thunder_tk.optim.AdamW"])
def test_resume_continues_bit_identically(tmp_path, straight_run, optimizer):
    """Two steps, a checkpoint, then a resumed run to four: the losses and the weights are the straight torch run's
    bit for bit, with either optimizer class (tk's AdamW on a CPU takes torch's path; its step counts, views of one
    buffer, go through the checkpoint and back)."""
    micro = {**MICRO, "optimizer": {"class_path": optimizer}}
    straight = straight_run
    split = tmp_path / "split"
    pretrain(load_config(None, {**micro, "out_dir": str(split), "train": {**MICRO["train"], "max_steps": 2}}))
    assert (split / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    summary = pretrain(load_config(None, {**micro, "out_dir": str(split)}), resume=True)
    assert summary["optimizer"]["class_path"] == optimizer
    assert summary["steps"] == 4
    a, b = _losses(straight), _losses(split)
    assert [a[s] for s in (1, 2, 3, 4)] == [b[s] for s in (1, 2, 3, 4)]
    sa = torch.load(straight / "checkpoints" / "step-00000004" / "rank0.pt", weights_only=False)
    sb = torch.load(split / "checkpoints" / "step-00000004" / "rank0.pt", weights_only=False)
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k


def test_precision_names_map_to_weights_and_autocast():
    assert precision_of(None, "cuda") == ("bf16-true", "bfloat16", None)
    assert precision_of(None, "cpu") == ("32-true", "float32", None)
    assert precision_of("bf16-mixed", "cuda") == ("bf16-mixed", "float32", "bfloat16")
    assert precision_of("32-true", "cuda") == ("32-true", "float32", None)


@pytest.mark.parametrize("precision, weights, linear_inputs",
                         [("bf16-true", torch.bfloat16, "bf16"), ("bf16-mixed", torch.float32, "bf16")])
def test_precision_sets_the_weights_and_what_the_linears_compute_in(tmp_path, precision, weights, linear_inputs):
    """LitGPT's precisions: the checkpoint holds weights of the parameter dtype, and the traced linears take inputs of
    the compute dtype (bf16-mixed: fp32 weights cast by Thunder's autocast)."""
    summary = pretrain(load_config(None, {**MICRO, "out_dir": str(tmp_path), "precision": precision,
                                          "train": {**MICRO["train"], "max_steps": 2, "save_interval": 2}}))
    assert summary["precision"] == precision
    state = torch.load(tmp_path / "checkpoints" / "step-00000002" / "rank0.pt", weights_only=False)
    assert {v.dtype for v in state["model"].values() if v.is_floating_point()} == {weights}
    assert all(math.isfinite(loss) for loss in _losses(tmp_path).values())
    rows = json.loads((tmp_path / "explain.json").read_text())["rows"]
    linears = [r for r in rows if r["symbol"] == "prims.linear"]
    assert linears and all(r["inputs"].startswith(linear_inputs) for r in linears), [r["inputs"] for r in linears]


def test_checkpoints_are_written_atomically_at_intervals(tmp_path):
    pretrain(load_config(None, {**MICRO, "out_dir": str(tmp_path), "train": {**MICRO["train"], "save_interval": 3}}))
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert folders == ["step-00000003", "step-00000004"]
    assert not list((tmp_path / "checkpoints").rglob(".*tmp*"))
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000004"


def test_tiny_config_end_to_end(tmp_path, capsys, monkeypatch):
    """The README's main job on a CPU: trains, writes metrics, checkpoint, summary and the explain report."""
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_ENGINE", "auto")
    assert main(["pretrain", "--config", str(TINY), "--out_dir", str(tmp_path), "--train.max_steps", "12"]) == 0
    out = capsys.readouterr().out
    assert "step 12/12 | loss" in out and "done: 12 steps" in out
    losses = _losses(tmp_path)
    assert losses[12] < losses[1]  # it learns the synthetic stream
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["device"] == "cpu"
    # Step 10's evaluation traces and compiles a trace of its own: timed apart, and not part of the training pace,
    # which stays near the median step's (the evaluation alone takes longer than any step after the first).
    assert summary["evaluation_seconds"] > summary["step_seconds_max_after_first_step"], summary
    per_step = summary["global_batch_size"] * summary["seq_len"] / summary["step_seconds_median_after_first_step"]
    assert summary["tokens_per_s_after_first_step"] > 0.5 * per_step, summary
    assert ", evaluation " in out and summary["checkpoint_seconds"] == 0.0  # no save_interval: saved at the end
    assert summary["tk_environment"]["THUNDER_TK_COLLECTIVE_ENGINE"] == "auto"
    assert all(k.startswith("THUNDER_TK_") for k in summary["tk_environment"])
    explain = (tmp_path / "explain.txt").read_text()
    assert "prims.linear" in explain and "ltorch.scaled_dot_product_attention" in explain
    assert json.loads((tmp_path / "explain.json").read_text())["rows"]


def test_gc_clock_counts_collections_while_installed():
    clock = GcClock()
    with clock.installed():
        gc.collect()
        gc.collect()
    gc.collect()  # not counted: removed
    seconds, collections = clock.take()
    assert collections == 2 and seconds > 0
    assert clock.take() == (0.0, 0)


def test_cpulists_parse_as_the_kernel_writes_them():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5} and parse_cpulist("") == set()


def test_exclusive_cpus_share_each_numa_node_among_its_gpus():
    node0, node1 = set(range(0, 16)), set(range(16, 32))
    near = [node0, node0, node1, node1]  # GPUs 0-1 on node 0, 2-3 on node 1
    shares = [exclusive_cpus(r, near, node0 | node1) for r in range(4)]
    assert shares == [set(range(0, 8)), set(range(8, 16)), set(range(16, 24)), set(range(24, 32))]
    # A container allowed only part of a node: the allowed CPUs near the GPU, shared out
    allowed = set(range(4, 12)) | node1
    assert [exclusive_cpus(r, near, allowed) for r in (0, 1)] == [set(range(4, 8)), set(range(8, 12))]
    # Unknown neighbourhoods, or none of them allowed: every local rank shares out the allowed CPUs
    assert [exclusive_cpus(r, [None] * 3, set(range(6))) for r in range(3)] == [{0, 1}, {2, 3}, {4, 5}]
    assert exclusive_cpus(1, [node1, node1], node0) == set(range(8, 16))
    # More ranks than CPUs: never an empty set
    assert [exclusive_cpus(r, [None] * 4, {7, 9}) for r in range(4)] == [{7}, {7}, {9}, {9}]
    for r in range(4):
        assert exclusive_cpus(r, [None] * 4, {3}) == {3}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_bind_cpus_binds_only_when_asked(monkeypatch):
    before = os.sched_getaffinity(0)
    try:
        monkeypatch.delenv("THUNDER_TK_CPU_AFFINITY", raising=False)
        assert bind_cpus(0, 2) is None and os.sched_getaffinity(0) == before
        monkeypatch.setenv("THUNDER_TK_CPU_AFFINITY", "pinned")
        with pytest.raises(ConfigError, match="THUNDER_TK_CPU_AFFINITY='pinned': expected none or exclusive"):
            bind_cpus(0, 2)
        monkeypatch.setenv("THUNDER_TK_CPU_AFFINITY", "exclusive")
        if len(before) >= 2:  # no GPU here: the two local ranks share out the allowed CPUs
            first = bind_cpus(0, 2)
            assert os.sched_getaffinity(0) == set(first)
            os.sched_setaffinity(0, before)  # as the second rank's process would start
            second = bind_cpus(1, 2)
            assert set(first) | set(second) == before and not set(first) & set(second)
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_os_counters_tell_a_busy_main_thread_from_a_waiting_one():
    import time

    counters = OsCounters()
    counters.take()
    time.sleep(0.2)
    waited = counters.take()
    end = time.perf_counter() + 0.2
    scratch = []
    while time.perf_counter() < end:
        scratch.append(bytearray(1 << 16))  # busy, and touching fresh pages
        if len(scratch) > 64:
            scratch.clear()
    busy = counters.take()
    assert set(waited) == set(busy) == set(OsCounters.KEYS)
    assert waited["main_thread_cpu_s"] < 0.05 and busy["main_thread_cpu_s"] > 0.1
    assert waited["voluntary_switches"] >= 1  # the sleep
    assert all(isinstance(v, (int, float)) and v >= 0 for v in busy.values())


def test_fsdp_kernel_settings_only_on_several_gpus_and_never_over_the_environment():
    from thunder_tk.pretrain import FSDP_KERNEL_SETTINGS, apply_fsdp_kernel_settings

    env = {}
    assert apply_fsdp_kernel_settings(1, env) == {} and env == {}
    assert apply_fsdp_kernel_settings(4, env) == FSDP_KERNEL_SETTINGS and env == FSDP_KERNEL_SETTINGS
    assert FSDP_KERNEL_SETTINGS == {"THUNDER_TK_COLLECTIVE_BLOCKS": "32", "THUNDER_TK_GEMM_SCHEDULE": "dynamic"}
    env = {"THUNDER_TK_GEMM_SCHEDULE": "static"}
    assert apply_fsdp_kernel_settings(2, env) == {"THUNDER_TK_COLLECTIVE_BLOCKS": "32"}
    assert env["THUNDER_TK_GEMM_SCHEDULE"] == "static"


def test_stall_tracer_writes_every_stack_of_a_step_past_its_threshold(tmp_path, monkeypatch):
    import time

    monkeypatch.delenv("THUNDER_TK_STALL_TRACE", raising=False)
    assert StallTracer(tmp_path, 0).file is None  # off unless asked for
    monkeypatch.setenv("THUNDER_TK_STALL_TRACE", "half a second")
    with pytest.raises(ConfigError, match="THUNDER_TK_STALL_TRACE='half a second' is not a number of seconds"):
        StallTracer(tmp_path, 0)
    monkeypatch.setenv("THUNDER_TK_STALL_TRACE", "0.05")
    tracer = StallTracer(tmp_path, 0)
    start = time.perf_counter()
    tracer.arm(0)
    time.sleep(0.3)  # past the threshold: the stacks are written while the step still runs
    tracer.disarm(time.perf_counter() - start)
    start = time.perf_counter()
    tracer.arm(1)
    tracer.disarm(time.perf_counter() - start)  # a quick step: nothing
    tracer.close()
    text = (tmp_path / "stall_traces.txt").read_text()
    assert "-- step 1:" in text and "-- step 2:" in text and text.count("Timeout") == 1
    # The slow step's line of what the system did: the main thread slept, so its CPU time is far below 0.3 s.
    (line,) = [x for x in text.splitlines() if x.startswith("-- host work")]
    counters = json.loads(line.split("meanwhile: ", 1)[1])
    assert set(counters) == set(OsCounters.KEYS)
    if sys.platform.startswith("linux"):
        assert 0 <= counters["main_thread_cpu_s"] < 0.2 and counters["voluntary_switches"] >= 1
    assert "test_stall_tracer_writes_every_stack" in text  # the main thread's frame, where it sat
    other_rank = StallTracer(tmp_path, 2)
    assert other_rank.file.name.endswith("stall_traces.rank2.txt")
    other_rank.close()


def test_baseline_executors_without_checkpoints(tmp_path, capsys):
    """`compiler.executors: [default]` is Thunder's default list with a general fuser in nvFuser's place;
    --no-checkpoint (benchmark runs) writes none, and the summary carries what the comparison reads."""
    import thunder_tk
    from thunder_tk.executor import is_general_fuser
    from thunder_tk.pretrain import resolve_executors

    baseline = resolve_executors(["default"])
    assert [ex.name for ex in baseline] == [ex.name for ex in thunder_tk.baseline_executors()]
    assert thunder_tk.tk not in baseline and sum(is_general_fuser(ex) for ex in baseline) == 1
    # one layer of the tiny config: what is checked is the run's bookkeeping, not the model (a layer less to trace)
    assert main(["pretrain", "--config", str(TINY), "--out_dir", str(tmp_path), "--train.max_steps", "3",
                 "--compiler.executors", "[default]", "--no-checkpoint", "--model_config.n_layer", "1"]) == 0
    assert not (tmp_path / "checkpoints").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["executors"] == ["default"] and summary["tokens_per_s_per_device_after_first_step"] > 0
    assert summary["peak_memory_gib"] is None and summary["peak_reserved_gib"] is None  # CPU
    assert summary["mfu_after_first_step"] is None and summary["cuda_graphs_memory_gib"] is None
    # Two steps after the first, one logging interval each: the median pace is at most the slowest interval's.
    pace, slowest = summary["step_seconds_median_after_first_step"], summary["step_seconds_max_after_first_step"]
    assert 0 < pace <= slowest
    assert summary["tokens_per_s_per_device_median_step"] == pytest.approx(summary["global_batch_size"]
                                                                         * summary["seq_len"] / pace)
    # Each logged step says how long the host took to issue it and what the garbage collector cost since the last.
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < s["host_seconds"] <= s["step_seconds"] and s["gc_seconds"] >= 0 and s["gc_collections"] >= 0
               for s in steps if "step_seconds" in s)
    # ... and by phase: the phases are parts of the host's time (the rest is the learning rate and bookkeeping);
    # the allocator's counters are CUDA's (None here).
    for s in (s for s in steps if "step_seconds" in s):
        phases = s["host_phases"]
        assert set(phases) == {"batch", "forward", "backward", "clip", "optimizer"}
        assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
        assert sum(phases.values()) <= s["host_seconds"] + 1e-5
        assert s["alloc_retries"] is None and s["device_allocs"] is None
    assert not any(isinstance(c, GcClock) for c in gc.callbacks)  # removed when the run ends


def _word_tokenizer(folder: Path, corpus: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir()
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def test_local_text_files_with_a_local_tokenizer(tmp_path):
    text = " ".join(["the cat sat on the mat and a dog ran far away"] * 40)
    (tmp_path / "corpus.txt").write_text(text)
    tokenizer = _word_tokenizer(tmp_path / "tok", [text])
    data = {"kind": "text", "paths": [str(tmp_path / "corpus.txt")], "tokenizer_dir": str(tokenizer)}
    summary = pretrain(load_config(None, {**MICRO, "out_dir": str(tmp_path / "out"), "data": data,
                                         "compiler": {"jit": False}, "train": {**MICRO["train"], "max_steps": 2}}))
    assert summary["steps"] == 2
    with pytest.raises(ConfigError, match="data.paths: .*missing.txt not found"):
        pretrain(load_config(None, {**MICRO, "out_dir": str(tmp_path / "o2"),
                                     "data": {**data, "paths": [str(tmp_path / "missing.txt")]}}))


def test_compiler_disable_reaches_the_executor(tmp_path):
    """compiler.disable is Thunder's tk_disable option: explain names it as the reason for the turned-off rules."""
    assert pretrain(load_config(None, {**MICRO, "out_dir": str(tmp_path), "compiler": {"disable": ["gemm"]},
                                       "train": {**MICRO["train"], "max_steps": 1}})) is not None
    explain = (tmp_path / "explain.txt").read_text()
    gemm_lines = [line for line in explain.splitlines() if "linear" in line]
    assert gemm_lines and all("disabled by the tk_disable compile option" in line for line in gemm_lines), explain


def test_bad_collective_settings_fail_before_the_model_is_built(monkeypatch):
    from thunder_tk.pretrain import check_collective_environment

    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_ENGINE", "dma")
    check_collective_environment(1)  # one process: no collectives, nothing to check
    with pytest.raises(ConfigError, match=r"engine must be one of.*THUNDER_TK_COLLECTIVE_ENGINE='dma'"):
        check_collective_environment(4)
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_ENGINE", "auto")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_CE_SLOTS", "1")
    with pytest.raises(ConfigError, match=r"copy_slots must be >= 2.*THUNDER_TK_COLLECTIVE_CE_SLOTS='1'"):
        check_collective_environment(2)
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_CE_SLOTS", "many")
    with pytest.raises(ConfigError, match="THUNDER_TK_COLLECTIVE_CE_SLOTS='many' is not an integer"):
        check_collective_environment(2)
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_CE_SLOTS", "4")
    check_collective_environment(2)
