"""thunder_tk.CUDAGraphs without a GPU: the graphs it plans in a LitGPT step for an sm_90 device (one for the forward,
one for the backward; parameters and the forward's saved tensors read in place), what `explain` says of them, and a
CPU run, which it leaves op by op."""

import pytest
import thunder
import torch

import thunder_tk
from thunder_tk.cuda_graphs import is_graph_call


def _planned(transform, model_name="Llama-3.2-1B"):
    pytest.importorskip("litgpt")
    from thunder_tk.litgpt_models import build_meta_model, load_spec
    from thunder_tk.planning import trace_planned
    from thunder_tk.pretrain import LossModule

    spec = load_spec(model_name, n_layer=1, seq_len=128, micro_batch_size=1)
    model = build_meta_model(spec, torch.bfloat16)
    with torch.device("meta"):
        x = torch.randint(spec.config.padded_vocab_size, (1, 128))
    return trace_planned(LossModule(model), [x, x.clone()], transforms=[transform])


def test_a_planned_step_is_one_graph_forward_and_one_backward():
    transform = thunder_tk.CUDAGraphs()
    jitted = _planned(transform)
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    for trace in (forward, backward):
        graphs = [b for b in trace.bound_symbols if is_graph_call(b)]
        assert len(graphs) == 1
        # nothing but bookkeeping is left outside the graph
        outside = {b.sym.name for b in trace.bound_symbols if not is_graph_call(b)}
        assert outside <= {"unpack_trivial", "unpack_sequence", "clear_mutable_collection", "python_return",
                           "python_del"}, outside
    inside = {s.sym.name for t in (forward, backward) for b in t.bound_symbols if is_graph_call(b)
              for s in b.subsymbols}
    assert {"tk_linear_rope", "tk_attention_forward", "tk_attention_backward_qkv"} <= inside
    (fw_name, (_, fw_static)), (bw_name, (_, bw_static)) = transform.cuda_graph_runner.python_callables.items()
    # Read in place: the parameters (the forward's graph) and the forward's saved tensors (the backward's); copied in
    # at each replay: the tokens and targets, and the loss's incoming gradient.
    assert fw_static.count(False) == 2 and sum(fw_static) >= 9
    assert bw_static.count(False) <= 2 and sum(bw_static) >= 10


def test_explain_sees_through_the_graphs():
    jitted = _planned(thunder_tk.CUDAGraphs())
    report = thunder_tk.explain(jitted)
    assert report.calls["forward"] == {"CUDA graphs": 1} and report.calls["backward"] == {"CUDA graphs": 1}
    ran = {r.ran_by for r in report.rows if r.claimed_by_tk}
    assert "tk: tk_attention_forward" in ran, ran  # each op under its own name, not the graph's
    assert "forward: 1 call a step on the host (CUDA graphs 1)" in str(report)


def test_a_cpu_run_stays_op_by_op_and_computes_the_same():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    want = model(x)
    want.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    transform = thunder_tk.CUDAGraphs()
    jitted = thunder.jit(model, executors=[thunder_tk.tk], transforms=[transform])
    got = jitted(x)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)
    assert not any(is_graph_call(b) for b in thunder.last_traces(jitted)[-1].bound_symbols)
    assert transform.graphs_captured == 0


def test_graphs_plan_for_bf16_mixed_and_inference():
    """Under bf16 autocast (fp32 weights, Thunder's casts) the step is still one graph each way; an inference trace
    (no gradients) is one graph."""
    pytest.importorskip("litgpt")
    from thunder_tk.litgpt_models import build_meta_model, load_spec
    from thunder_tk.planning import trace_planned
    from thunder_tk.pretrain import LossModule

    spec = load_spec("Llama-3.2-1B", n_layer=1, seq_len=128, micro_batch_size=1)
    with torch.device("meta"):
        x = torch.randint(spec.config.padded_vocab_size, (1, 128))
    mixed = trace_planned(LossModule(build_meta_model(spec, torch.float32)), [x, x.clone()], autocast=torch.bfloat16,
                          transforms=[thunder_tk.CUDAGraphs()])
    for trace in (thunder.last_traces(mixed)[-1], thunder.last_backward_traces(mixed)[-1]):
        assert sum(is_graph_call(b) for b in trace.bound_symbols) == 1
    model = build_meta_model(spec, torch.bfloat16).requires_grad_(False)
    inference = trace_planned(model, [x], transforms=[thunder_tk.CUDAGraphs()])
    assert sum(is_graph_call(b) for b in thunder.last_traces(inference)[-1].bound_symbols) == 1
    assert not thunder.last_backward_traces(inference)


def test_a_failed_capture_names_the_region_and_its_calls(monkeypatch):
    """A capture that fails (a call in the region waits on the host) is reported with what the region calls."""
    transform = thunder_tk.CUDAGraphs()
    _planned(transform)
    runner = transform.cuda_graph_runner
    name = next(iter(runner.python_callables))

    def failing(self, fn, args, mask):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(type(runner), "build_cuda_graph", failing)
    with pytest.raises(RuntimeError, match=rf"capturing {name} failed \(CUDA error: operation not permitted.*"
                                           r"Its calls: .*tk_attention_forward"):
        runner.call_cuda_graph(name, *[None] * len(runner.python_callables[name][1]))


class _ReplayOnCpu:
    """Stands in for a CUDA graph on a CPU: replay runs the region again and writes its results into the buffers
    of the first run, as a graph's kernels write into the addresses they were captured with. Graphs share one pool,
    so a graph may have its temporaries where a graph captured after it keeps its outputs: replay poisons those
    (`captured`, the pool's graphs in capture order)."""

    def __init__(self, fn, inputs, captured: list):
        self.fn, self.inputs, self.captured = fn, inputs, captured
        self.outputs = fn(*inputs)
        captured.append(self)

    def replay(self):
        for later in self.captured[self.captured.index(self) + 1:]:
            for o in later.outputs:
                if isinstance(o, torch.Tensor) and o.is_floating_point():
                    o.fill_(float("nan"))
        for kept, fresh in zip(self.outputs, self.fn(*self.inputs)):
            if isinstance(kept, torch.Tensor):
                for d, stride in enumerate(kept.stride()):  # an expanded output: its memory holds one of each
                    if stride == 0:
                        kept, fresh = kept.narrow(d, 0, 1), fresh.narrow(d, 0, 1)
                kept.copy_(fresh)


def cpu_capture():
    """Stand-ins for the runner's capture and for freeing a storage in it, on a CPU: a capture is a _ReplayOnCpu of
    the region to capture; memory freed in a capture holds the graph's later temporaries on a GPU, so each replay
    overwrites it with NaN bytes where the region frees it (the capture's own run computes nothing on a GPU)."""
    pools, capturing = {}, []

    def capture(self, fn, capture_fn, args, static_args_mask):
        inputs = tuple(a if static or not isinstance(a, torch.Tensor) else torch.empty_like(a).copy_(a)
                       for a, static in zip(args, static_args_mask))
        capturing.append(True)
        try:
            graph = _ReplayOnCpu(capture_fn, inputs, pools.setdefault(id(self), []))
        finally:
            capturing.pop()
        return graph, inputs, graph.outputs

    def poison(storage):
        if not capturing:
            torch.empty(0, dtype=torch.uint8).set_(storage).fill_(255)
        return True

    return capture, poison


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """CUDAGraphs capturing CPU traces into _ReplayOnCpu: the runner's buffer semantics, checked without a GPU."""
    from thunder_tk import cuda_graphs

    capture, poison = cpu_capture()
    monkeypatch.setattr(cuda_graphs, "_on_cuda", lambda t: True)
    monkeypatch.setattr(cuda_graphs._SharedPoolRunner, "_capture", capture)
    monkeypatch.setattr(cuda_graphs, "_free_storage", poison)


def _mlp_pair():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    reference.load_state_dict(model.state_dict())
    return model, reference


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("copy_gradients", [False, True])
def test_gradients_are_the_graph_buffers_without_a_copy(graphs_on_cpu, copy_gradients):
    """A plain loop (zero_grad(set_to_none=True)): each .grad is the backward graph's buffer, not a clone (a clone
    with copy_gradients=True), and holds that step's gradient of that step's batch."""
    model, reference = _mlp_pair()
    transform = thunder_tk.CUDAGraphs(copy_gradients=copy_gradients)
    jitted = thunder.jit(model, executors=[thunder_tk.tk], transforms=[transform])
    for step in range(3):
        x = torch.randn(4, 16)
        jitted(x).square().sum().backward()
        reference(x).square().sum().backward()
        for p, want in zip(model.parameters(), _grads(reference)):
            torch.testing.assert_close(p.grad, want)
        buffers = {o.untyped_storage().data_ptr() for entry in transform.cuda_graph_runner.cuda_graph_cache.values()
                   for o in entry[2] if isinstance(o, torch.Tensor)}
        in_buffers = [p.grad.untyped_storage().data_ptr() in buffers for p in model.parameters()]
        assert in_buffers == [not copy_gradients] * len(in_buffers), step
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert transform.graphs_captured == 2


class _SavedViews(torch.nn.Module):
    """Saved tensors that are views of one another (halves of one product, as q, k and v of a qkv projection) and
    an output that is also saved (exp's result), which the caller reads after the backward."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(32, 8)

    def forward(self, x):
        a, b = self.up(x).chunk(2, dim=-1)
        y = self.down(torch.nn.functional.gelu(a) * b)
        return y, torch.exp(y)


def test_the_backward_graph_reuses_the_saved_tensors_memory(graphs_on_cpu):
    """The backward's graph frees each tensor the forward's graph only saved for it after its last read (freed
    memory is poisoned here, as a GPU's later temporaries would overwrite it): the gradients stay exact over steps,
    and so does an output the caller reads after the backward."""
    torch.manual_seed(0)
    model, reference = _SavedViews(), _SavedViews()
    reference.load_state_dict(model.state_dict())
    transform = thunder_tk.CUDAGraphs()
    jitted = thunder.jit(model, executors=[thunder_tk.tk], transforms=[transform])
    for step in range(3):
        x = torch.randn(4, 16)
        y, e = jitted(x)
        y_ref, e_ref = reference(x)
        (y.square().sum() + e.sum()).backward()
        (y_ref.square().sum() + e_ref.sum()).backward()
        torch.testing.assert_close(e, e_ref)  # returned and saved: kept
        for p, want in zip(model.parameters(), _grads(reference)):
            torch.testing.assert_close(p.grad, want)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert transform.cuda_graph_runner.freed_saved_bytes > 0
    assert transform.memory()["saved_reused"] == transform.cuda_graph_runner.freed_saved_bytes
    assert transform.graphs_captured == 2


def test_memory_counts_the_graphs_outputs_and_input_copies(graphs_on_cpu):
    """CUDAGraphs.memory: the outputs the graphs keep (each storage once: the gradients handed out are among them)
    and the buffers the batch is copied into; no pool on a CPU."""
    model, _ = _mlp_pair()
    transform = thunder_tk.CUDAGraphs()
    jitted = thunder.jit(model, executors=[thunder_tk.tk], transforms=[transform])
    assert transform.memory() == {"pool": 0, "pool_allocated": 0, "outputs": 0, "input_copies": 0,
                                  "saved_reused": 0}
    x = torch.randn(4, 16)
    jitted(x).square().sum().backward()
    memory = transform.memory()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # The backward's outputs hold every parameter's gradient; the forward's, at least its (4, 8) output.
    assert memory["outputs"] >= weights + 4 * 8 * 4, memory
    assert memory["input_copies"] >= x.numel() * x.element_size(), memory
    assert memory["pool"] == memory["pool_allocated"] == 0


@pytest.mark.parametrize("set_to_none", [True, False])
def test_kept_gradients_are_moved_before_the_next_replay(graphs_on_cpu, set_to_none):
    """Gradient accumulation over two batches, and zero_grad(set_to_none=False) between steps: a .grad still kept
    when a graph replays (the next forward, whose temporaries may share the backward's buffers) is moved out of the
    graph's buffer first, so nothing is overwritten or added twice."""
    model, reference = _mlp_pair()
    jitted = thunder.jit(model, executors=[thunder_tk.tk], transforms=[thunder_tk.CUDAGraphs()])
    for step in range(3):
        for micro in range(2):
            x = torch.randn(4, 16)
            jitted(x).square().sum().backward()
            reference(x).square().sum().backward()
        for p, want in zip(model.parameters(), _grads(reference)):
            torch.testing.assert_close(p.grad, want)
        model.zero_grad(set_to_none=set_to_none)
        reference.zero_grad(set_to_none=set_to_none)


def test_an_input_gradient_is_not_a_graph_buffer(graphs_on_cpu):
    """Only parameters' gradients are handed out as the graph's buffers (the runner moves those): an input's .grad
    is autograd's copy, and keeps its value through later replays."""
    model, reference = _mlp_pair()
    jitted = thunder.jit(model, executors=[thunder_tk.tk], transforms=[thunder_tk.CUDAGraphs()])
    x = torch.randn(4, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    jitted(x).square().sum().backward()
    reference(x_ref).square().sum().backward()
    kept = x.grad
    for _ in range(2):  # later replays write the graphs' buffers again
        jitted(torch.randn(4, 16, requires_grad=True)).square().sum().backward()
    torch.testing.assert_close(kept, x_ref.grad)


def _gathered_trace():
    """A forward under FSDP as it runs on GPUs, built by hand (tk declines collectives on CPU): two parameters
    gathered by tk, each read by a linear after its wait, and an NCCL gather of the result with its wait. Unpacking
    cuts a graph, so the plan moves it to the top first (else each gather would be cut from its wait)."""
    import thunder.torch as ltorch
    from thunder.core import prims
    from thunder.core.proxies import FutureTensorProxy, TensorProxy
    from thunder.core.trace import TraceCtx, tracectx
    from thunder.executors.torchex import all_gather_prim_impl, wait_prim_impl

    from thunder_tk.lowering import tk_all_gather

    trace = TraceCtx()
    with tracectx(trace):
        def tensor(name, shape):
            return TensorProxy(name, shape=shape, device=thunder.devices.Device("cuda:0"),
                               dtype=thunder.dtypes.bfloat16)

        p, q, x = tensor("p", (2, 4)), tensor("q", (2, 4)), tensor("x", (2, 4))
        trace.args = (p, q, x)
        f1, f2 = (FutureTensorProxy(name=n, like=tensor(f"u{n}", (4, 4))) for n in ("f1", "f2"))
        f3 = FutureTensorProxy(name="f3", like=tensor("u3", (4, 4)))
        w1, w2, y, z, out = (tensor(n, s) for n, s in (("w1", (4, 4)), ("w2", (4, 4)), ("y", (2, 4)),
                                                          ("z", (2, 4)), ("out", (4, 4))))
        unpack = {t.name: prims.unpack_trivial.bind(t, name=t.name, output=t) for t in (p, q, x)}
        trace.bound_symbols = [  # each gather just after its parameter's unpacking, as FSDP's schedule puts it
            unpack["p"],
            tk_all_gather.bind(p, None, True, None, output=f1),
            unpack["q"],
            tk_all_gather.bind(q, None, True, None, output=f2),
            unpack["x"],
            wait_prim_impl.bind(f1, output=w1),
            ltorch.linear.bind(x, w1, None, output=y),
            wait_prim_impl.bind(f2, output=w2),
            ltorch.linear.bind(y, w2, None, output=z),
            all_gather_prim_impl.bind(z, None, True, None, output=f3),
            wait_prim_impl.bind(f3, output=out),
            prims.python_return.bind(out, output=None),
        ]
    return trace


def _calls(trace) -> tuple[list[list[str]], list[str]]:
    """Names of the calls inside each graph, and of those outside (bookkeeping left out)."""
    graphs = [[s.sym.name for s in b.subsymbols if s.sym.name not in ("python_del", "python_return")]
              for b in trace.bound_symbols if is_graph_call(b)]
    outside = [b.sym.name for b in trace.bound_symbols
               if not is_graph_call(b) and b.sym.name not in ("unpack_trivial", "python_return", "python_del")]
    return graphs, outside


def test_tk_collectives_are_captured_with_their_waits(monkeypatch):
    """Under FSDP tk's gathers and their waits go into the graph with the compute (their launches are capturable),
    and the graph's replay is ordered against the channels' other launches; NCCL's gather and its wait stay out."""
    from thunder_tk import collectives

    transform = thunder_tk.CUDAGraphs()
    graphs, outside = _calls(transform._fused_with_collectives(_gathered_trace()))
    assert graphs == [["tk_all_gather", "tk_all_gather", "torch_wait_prim_impl", "linear", "torch_wait_prim_impl",
                       "linear"]]
    assert outside == ["torch_all_gather_prim_impl", "torch_wait_prim_impl"]
    runner = transform.cuda_graph_runner
    (name,) = runner.with_collectives
    assert set(runner.python_callables) == {name}
    events = []
    monkeypatch.setattr(collectives, "graph_replay", lambda device: events.append("order"))
    monkeypatch.setattr(runner, "_call", lambda fn_name, args: events.append(fn_name))
    runner.call_cuda_graph(name)
    assert events == ["order", name, "order"]


def test_a_collective_planned_apart_from_its_wait_stays_out(monkeypatch):
    """A graph may not hold a collective whose wait is elsewhere (the capture's stream would not be joined, and the
    Work would cross into the trace): such a pair runs outside the graphs, and the plan is redone without it."""
    from thunder_tk.cuda_graphs import CUDAGraphs

    decide = CUDAGraphs._captured_collective
    monkeypatch.setattr(CUDAGraphs, "_captured_collective", lambda self, b: decide(self, b) and not (
        b.sym.name == "torch_wait_prim_impl" and b.flat_proxy_args[0].name == "f2"))
    from thunder.core.proxies import FutureTensorProxy

    transform = thunder_tk.CUDAGraphs()
    fused = transform._fused_with_collectives(_gathered_trace())
    _, outside = _calls(fused)
    assert outside.count("tk_all_gather") >= 1 and "f2" in transform._kept_out
    gather_q = next(b for b in fused.bound_symbols if b.sym.name == "tk_all_gather" and b.args[0].name == "q")
    assert not is_graph_call(gather_q)
    graphs = [b for b in fused.bound_symbols if is_graph_call(b)]
    assert not any(isinstance(p, FutureTensorProxy) for b in graphs for p in (*b.flat_proxy_args, *b.flat_proxy_outs))
    # the first plan's graphs are forgotten
    assert set(transform.cuda_graph_runner.python_callables) == {b.sym.name for b in graphs}


def test_fsdp_steps_in_graphs_hold_their_collectives(tmp_path):
    """FSDP's real traces (two gloo ranks, their collectives playing tk's, the graphs stood in for on CPU): the
    forward's gathers and the backward's reduce-scatters all go into the graphs with their waits, ZeRO-2 and ZeRO-3,
    and three steps give the losses and gradients of the step without graphs, the backward's graph reusing the
    memory of the tensors the forward saved for it (poisoned here once freed)."""
    from pathlib import Path

    from workers import run_two_ranks

    runs = run_two_ranks(Path(__file__).with_name("fsdp_graphs_worker.py"),
                         ["plain", "graphs", "plain-zero3", "graphs-zero3", "graphs-window"], tmp_path)
    # Within the reduce-scatters' budget the backward's waits stay at its end; past it, they move up.
    assert runs["graphs"]["early_waits"] == 0 and runs["graphs-window"]["early_waits"] > 0
    for plain, graphs in (("plain", "graphs"), ("plain-zero3", "graphs-zero3"), ("plain", "graphs-window")):
        want, got = runs[plain], runs[graphs]
        assert got["forward"][0] > 0 and got["forward"][1] == 0, got["forward"]
        assert got["backward"][0] > 0 and got["backward"][1] == 0, got["backward"]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
        for name, norm in want["grads"].items():
            assert got["grads"][name] == pytest.approx(norm, rel=1e-6), name
        assert got["freed_saved_bytes"] > 0, graphs
    # Nothing keeps the unsharded parameters that FSDP replaced (the runner held them: 2.79 GiB a GPU at 1B).
    assert all(run["stray_parameter_bytes"] == 0 for run in runs.values()), runs


def _scattered_trace():
    """A backward under FSDP as it runs on GPUs, built by hand: four 1 MiB gradients, each reduce-scattered by tk as
    soon as it is computed, every wait at the end (FSDP's schedule)."""
    import thunder.torch as ltorch
    from thunder.core import prims
    from thunder.core.proxies import FutureTensorProxy, TensorProxy
    from thunder.core.trace import TraceCtx, tracectx
    from thunder.executors.torchex import wait_prim_impl

    from thunder_tk.lowering import tk_reduce_scatter

    trace = TraceCtx()
    with tracectx(trace):
        def tensor(name, shape):
            return TensorProxy(name, shape=shape, device=thunder.devices.Device("cuda:0"),
                               dtype=thunder.dtypes.bfloat16)

        x = tensor("x", (512, 1024))
        trace.args = (x,)
        bsyms, waited = [prims.unpack_trivial.bind(x, name="x", output=x)], []
        for i in range(1, 5):
            g, f = tensor(f"g{i}", (512, 1024)), FutureTensorProxy(name=f"f{i}", like=tensor(f"s{i}", (256, 1024)))
            bsyms += [ltorch.neg.bind(x, output=g), tk_reduce_scatter.bind(g, None, None, True, None, output=f)]
        for i in range(1, 5):
            waited.append(tensor(f"w{i}", (256, 1024)))
            bsyms.append(wait_prim_impl.bind(bsyms[2 * i].output, output=waited[-1]))
        bsyms.append(prims.python_return.bind(tuple(waited), output=None))
        trace.bound_symbols = bsyms
    return trace


def _graph_order(trace) -> list[str]:
    (graph,) = [b for b in trace.bound_symbols if is_graph_call(b)]
    return [f"wait {s.flat_proxy_args[0].name}" if s.sym.name == "torch_wait_prim_impl" else
            f"scatter {s.flat_proxy_outs[0].name}" if s.sym.name == "tk_reduce_scatter" else s.sym.name
            for s in graph.subsymbols if s.sym.name not in ("python_del", "python_return")]


def test_captured_reduce_scatters_are_waited_for_within_a_budget(monkeypatch):
    """Inside a capture a reduce-scatter's input is held until its wait: the plan waits for the oldest ones before a
    reduce-scatter that would take the unwaited inputs past THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB (op by op and within
    the budget, the trace's order is kept)."""
    default = _graph_order(thunder_tk.CUDAGraphs()._fused_with_collectives(_scattered_trace()))
    assert default == ["neg", "scatter f1", "neg", "scatter f2", "neg", "scatter f3", "neg", "scatter f4",
                       "wait f1", "wait f2", "wait f3", "wait f4"]
    monkeypatch.setenv("THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB", "2.5")
    within = _graph_order(thunder_tk.CUDAGraphs()._fused_with_collectives(_scattered_trace()))
    assert within == ["neg", "scatter f1", "neg", "scatter f2", "neg", "wait f1", "scatter f3", "neg", "wait f2",
                      "scatter f4", "wait f3", "wait f4"]
    monkeypatch.setenv("THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB", "lots")
    with pytest.raises(ValueError, match="THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB='lots' is not a number"):
        thunder_tk.CUDAGraphs()._fused_with_collectives(_scattered_trace())
