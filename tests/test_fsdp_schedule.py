"""tk's FSDP schedule (thunder_tk/fsdp_schedule.py) on two CPU processes (gloo): the collectives of the traces
that run are issued in the order of need, waits sit just before their readers, the reduce-scatters go out during
the backward, and losses and gradients are those of the fuser's order. Thunder's default executors keep their own
order (the baseline is not changed)."""

from pathlib import Path

import pytest

from workers import run_two_ranks

pytest.importorskip("litgpt")

WORKER = Path(__file__).with_name("fsdp_schedule_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_schedule")
    return run_two_ranks(WORKER, ["tk", "tk-fused-order", "default"], tmp)


def test_gathers_in_the_order_of_need_and_waits_before_their_readers(runs):
    tk, fused = runs["tk"], runs["tk-fused-order"]
    # The fuser's order: parameters in module order, the embedding (read first) among the last; every wait before
    # the first GEMM, so the forward waits for every gather.
    assert fused["gathers"][0] == "t_model_lm_head_weight"
    assert max(fused["forward_waits"]) < fused["forward_first_gemm"]
    # tk's: the embedding gathered before any layer's GEMM weights, the lm_head's last; waits spread through the
    # forward, each before its reader.
    gathers = tk["gathers"]
    assert gathers[-1] == "t_model_lm_head_weight"
    assert gathers.index("t_model_transformer_wte_weight") < gathers.index("t_model_transformer_h_0_attn_qkv_weight")
    layer = [gathers.index(f"t_model_transformer_h_{i}_attn_qkv_weight") for i in range(3)]
    assert layer == sorted(layer)
    assert max(tk["forward_waits"]) > tk["forward_first_gemm"]
    assert sorted(gathers) == sorted(fused["gathers"])


def test_reduce_scatters_go_out_during_the_backward(runs):
    tk, fused = runs["tk"], runs["tk-fused-order"]
    assert len(tk["backward_reduce_scatters"]) == len(fused["backward_reduce_scatters"]) > 0
    assert min(tk["backward_reduce_scatters"]) < tk["backward_last_gemm"]  # the first ones before the last GEMM
    assert min(tk["backward_waits"]) > tk["backward_last_gemm"]  # their waits after the compute (read by the return)


def test_same_losses_and_gradients_in_either_order(runs):
    tk, fused = runs["tk"], runs["tk-fused-order"]
    assert tk["loss"] == pytest.approx(fused["loss"], rel=1e-6)
    assert tk["grads"].keys() == fused["grads"].keys()
    for name, norm in tk["grads"].items():
        assert norm == pytest.approx(fused["grads"][name], rel=1e-5), name


def test_every_trace_prints_as_python(runs):
    """Users print the traces of `thunder.last_traces` and run them (tk's passes' provenances are comments)."""
    for variant in ("tk", "tk-fused-order", "default"):
        assert runs[variant]["traces_not_python"] == [], variant


def test_the_baseline_keeps_its_order(runs):
    default = runs["default"]
    assert default["gathers"][0] == "t_model_lm_head_weight"
    assert max(default["forward_waits"]) < default["forward_first_gemm"]
    assert default["loss"] == pytest.approx(runs["tk"]["loss"], rel=1e-5)


def _synthetic_trace(regather: bool, tk_ops: bool = False):
    """Two gathered parameters, each read by a linear after its wait (the second gathers the first parameter again
    where `regather`: ZeRO-3's backward); `tk_ops`: gathered by tk's own symbol, as on GPUs. Built by hand:
    Thunder 0.2.6's ZeRO-3 keeps the forward's gathered parameters for the backward, so its traces never gather
    twice, and tk declines collectives on CPU."""
    import thunder
    import thunder.torch as ltorch
    from thunder.core import prims
    from thunder.core.proxies import FutureTensorProxy, TensorProxy
    from thunder.core.trace import TraceCtx, tracectx
    from thunder.executors.torchex import all_gather_prim_impl, wait_prim_impl

    from thunder_tk.lowering import tk_all_gather

    gather = tk_all_gather if tk_ops else all_gather_prim_impl
    trace = TraceCtx()
    with tracectx(trace):
        def tensor(name, shape):
            return TensorProxy(name, shape=shape, device=thunder.devices.cpu, dtype=thunder.dtypes.float32)

        p, q, x = tensor("p", (2, 4)), tensor("q", (2, 4)), tensor("x", (2, 4))
        trace.args = (p, q, x)
        f1 = FutureTensorProxy(name="f1", like=tensor("u1", (4, 4)))
        f2 = FutureTensorProxy(name="f2", like=tensor("u2", (4, 4)))
        w1, w2, y, z = tensor("w1", (4, 4)), tensor("w2", (4, 4)), tensor("y", (2, 4)), tensor("z", (2, 4))
        trace.bound_symbols = [
            prims.unpack_trivial.bind(p, name="p", output=p),
            prims.unpack_trivial.bind(q, name="q", output=q),
            prims.unpack_trivial.bind(x, name="x", output=x),
            gather.bind(p, None, True, None, output=f1),
            wait_prim_impl.bind(f1, output=w1),
            ltorch.linear.bind(x, w1, None, output=y),
            gather.bind(p if regather else q, None, True, None, output=f2),
            wait_prim_impl.bind(f2, output=w2),
            ltorch.linear.bind(y, w2, None, output=z),
            prims.python_return.bind(z, output=None),
        ]
    return trace


def _order(trace) -> list[str]:
    names = {"torch_all_gather_prim_impl": "gather", "tk_all_gather": "gather", "torch_wait_prim_impl": "wait",
             "linear": "linear"}
    return [names[b.sym.name] for b in trace.bound_symbols if b.sym.name in names]


def test_second_gather_goes_out_early_unless_it_regathers():
    from thunder_tk.fsdp_schedule import overlap_collectives

    # Two parameters: both gathers go out first, each wait just before its linear.
    assert _order(overlap_collectives(_synthetic_trace(False))) == ["gather", "gather", "wait", "linear", "wait",
                                                                    "linear"]
    # ZeRO-3's second gather of one parameter: only when needed, so the parameters are never all unsharded at once.
    assert _order(overlap_collectives(_synthetic_trace(True))) == ["gather", "wait", "linear", "gather", "wait",
                                                                   "linear"]
    # tk's own all-gather symbol (what runs on GPUs) is a collective to the schedule too.
    ordered = overlap_collectives(_synthetic_trace(False, tk_ops=True))
    assert _order(ordered) == ["gather", "gather", "wait", "linear", "wait", "linear"]
    assert sum(b.sym.name == "tk_all_gather" for b in ordered.bound_symbols) == 2
    assert_prints_as_python(ordered, "FSDP collectives issued in the order of need")


def assert_prints_as_python(trace, made_by: str):
    """The trace's program starts with its provenance as a comment (bare text there is not Python; these hand-made
    traces have no signature, so only that line is checked)."""
    first_line = str(trace).splitlines()[0]
    assert first_line.startswith(f"# Constructed by tk: {made_by}"), first_line
    compile(first_line, "trace", "exec")


def test_disabled_or_without_waits_the_trace_is_left_alone(monkeypatch):
    from thunder_tk.fsdp_schedule import overlap_collectives

    trace = _synthetic_trace(False)
    monkeypatch.setenv("THUNDER_TK_DISABLE", "collective_schedule")
    assert overlap_collectives(trace) is trace


def _scatter_order(trace) -> list[str]:
    return [f"wait {b.flat_proxy_args[0].name}" if b.sym.name == "torch_wait_prim_impl" else
            f"scatter {b.flat_proxy_outs[0].name}" if b.sym.name == "tk_reduce_scatter" else b.sym.name
            for b in trace.bound_symbols if b.sym.name in ("neg", "torch_wait_prim_impl", "tk_reduce_scatter")]


def test_reduce_scatters_are_waited_for_within_the_budget_when_kept_until_wait(monkeypatch):
    """tk's collectives keep their tensors until their waits (THUNDER_TK_COLLECTIVE_KEEP=wait, the default), so the
    schedule waits for the oldest reduce-scatters before a new one would take the unwaited inputs (1 MiB each here)
    past THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB; with `record` the waits stay at the end."""
    from test_cuda_graphs import _scattered_trace

    from thunder_tk.fsdp_schedule import overlap_collectives

    at_end = ["neg", "scatter f1", "neg", "scatter f2", "neg", "scatter f3", "neg", "scatter f4",
              "wait f1", "wait f2", "wait f3", "wait f4"]
    assert _scatter_order(overlap_collectives(_scattered_trace())) == at_end  # 4 MiB, within the default 1024
    monkeypatch.setenv("THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB", "2.5")
    within = overlap_collectives(_scattered_trace())
    assert _scatter_order(within) == ["neg", "scatter f1", "neg", "scatter f2", "neg", "wait f1", "scatter f3", "neg",
                                      "wait f2", "scatter f4", "wait f3", "wait f4"]
    assert _scatter_order(overlap_collectives(within)) == _scatter_order(within)  # applied again: no change
    assert_prints_as_python(within, "reduce-scatters waited for within THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB")
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_KEEP", "record")
    assert _scatter_order(overlap_collectives(_scattered_trace())) == at_end
    monkeypatch.setenv("THUNDER_TK_COLLECTIVE_KEEP", "later")
    with pytest.raises(ValueError, match="THUNDER_TK_COLLECTIVE_KEEP='later': expected wait or record"):
        overlap_collectives(_scattered_trace())
