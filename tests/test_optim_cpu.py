"""thunder_tk.optim.AdamW and ops.adamw_step on a machine without a GPU (nothing is launched).

On the CPU every parameter takes torch's own AdamW, so the optimizer must be torch.optim.AdamW bit for bit: weight
decay 0 and 0.1, maximize, AMSGrad, foreach, two groups with their own learning rates, a learning rate changed
between steps, a parameter without a gradient (skipped, no state), a closure. Its state_dict is torch's, both ways
(a checkpoint of either continues in the other, bit for bit), and loading one saved by a fused or capturable torch
AdamW leaves this class's settings (fused None, capturable False, step counts float32 on the CPU). `routes` names
every parameter torch took and why. ops.adamw_step's checks name the problem before any kernel is needed: most
with CPU tensors; the two that CPU tensors cannot reach (the checks ask for a CUDA device before the layout and the
step count) with FakeTensors on "cuda" (metadata only: no GPU, no memory). The compiled module's own checks are
tested where it is built without a GPU (CI)."""

import copy
import io
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from optim_twins import same_grads, torch_clip_factor as clip_factor, twins
from thunder_tk import ops
from thunder_tk.optim import AdamW

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")

SHAPES = [(5, 7), (13,), (), (3, 4, 2)]


def make_params(seed, shapes=SHAPES, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


clone_params = twins


def set_grads(pairs, g, skip=()):
    """The same random gradient on both parameters of each pair (none on the pairs whose index is in `skip`)."""
    same_grads(pairs, lambda a: torch.randn(a.shape, generator=g).to(a.dtype), skip)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (torch.equal would take -0.0 for 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().contiguous().view(ints), b.detach().contiguous().view(ints))


def assert_same_optimizers(ours, theirs, ours_params, their_params, label=""):
    """Parameters, every state tensor and the step counts bit for bit, the same state keys, equal group settings."""
    for i, (p, q) in enumerate(zip(ours_params, their_params)):
        assert same_bits(p, q), f"{label} param {i}: {(p.double() - q.double()).abs().max().item():.3g} off torch"
        sp, sq = ours.state.get(p, {}), theirs.state.get(q, {})
        assert sorted(sp) == sorted(sq), f"{label} param {i}: state keys {sorted(sp)} vs torch's {sorted(sq)}"
        for key in sp:
            assert same_bits(sp[key], sq[key]), f"{label} param {i}: state {key} differs from torch's"
            assert sp[key].device == sq[key].device, f"{label} param {i}: {key} on {sp[key].device}"
    for ga, gb in zip(ours.param_groups, theirs.param_groups):
        assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}


def saved(state_dict):
    """A state_dict as a checkpoint brings it back (torch.save, torch.load): no tensor shared with the optimizer."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def two_groups(params, lrs=(None, 5e-3)):
    """Parameters 0, 1 in one group (the default lr unless given) and the rest in another."""
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    for group, lr in zip(groups, lrs):
        if lr is not None:
            group["lr"] = lr
    return groups


CONFIGS = {
    "wd0": dict(weight_decay=0.0),
    "wd0.1": dict(weight_decay=0.1),
    "maximize": dict(weight_decay=0.1, maximize=True),
    "amsgrad": dict(weight_decay=0.1, amsgrad=True),
    "betas_eps": dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
    "foreach": dict(weight_decay=0.1, foreach=True),
    "foreach_amsgrad_maximize": dict(amsgrad=True, maximize=True, foreach=True),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_matches_torch_bit_for_bit(config):
    """Five steps of two groups (lr 2e-3 and 5e-3, then both halved after step 3), parameter 1 without a gradient
    throughout (no state), parameter 3 without one at step 2 (its step count then lags), a bf16 parameter among the
    fp32 ones: parameters, states and step counts as torch.optim.AdamW's, bit for bit, after every step."""
    ours_params = make_params(0) + make_params(1, [(6,)], torch.bfloat16)
    their_params = clone_params(ours_params)
    ours = AdamW(two_groups(ours_params), lr=2e-3, **config)
    theirs = torch.optim.AdamW(two_groups(their_params), lr=2e-3, **config)
    g = torch.Generator().manual_seed(2)
    for step in range(1, 6):
        if step == 4:
            for opt in (ours, theirs):
                for group in opt.param_groups:
                    group["lr"] *= 0.5
        set_grads(list(zip(ours_params, their_params)), g, skip={1} | ({3} if step == 2 else set()))
        ours.step()
        theirs.step()
        assert_same_optimizers(ours, theirs, ours_params, their_params, f"step {step}")
    assert ours_params[1] not in ours.state, "a parameter that never had a gradient got state"
    assert float(ours.state[ours_params[3]]["step"]) == 4 and float(ours.state[ours_params[0]]["step"]) == 5
    assert ours.routes["tk"] == 0 and ours.routes["torch"] == 4


def test_kernels_false_and_tensor_lr_match_torch():
    """kernels=False and a tensor learning rate (both torch's path on any device) as torch.optim.AdamW."""
    for kwargs in (dict(kernels=False), dict(lr=torch.tensor(3e-3))):
        ours_params = make_params(3)
        their_params = clone_params(ours_params)
        ours = AdamW(ours_params, weight_decay=0.1, **kwargs)
        theirs = torch.optim.AdamW(their_params, weight_decay=0.1,
                                   **{k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()
                                      if k != "kernels"})
        g = torch.Generator().manual_seed(4)
        for step in range(3):
            set_grads(list(zip(ours_params, their_params)), g)
            ours.step()
            theirs.step()
        assert_same_optimizers(ours, theirs, ours_params, their_params, str(kwargs))


def test_closure_is_run_with_grad_and_its_loss_returned():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    x, y = torch.randn(16, 6), torch.randn(16, 2)

    def closure_for(m, opt):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()  # fails if step() ran the closure under no_grad
            return loss
        return closure

    ours = AdamW(model.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for _ in range(3):
        want = torch.nn.functional.mse_loss(model(x), y).item()
        loss = ours.step(closure_for(model, ours))
        their_loss = theirs.step(closure_for(twin, theirs))
        assert torch.is_tensor(loss) and loss.item() == want and same_bits(loss, their_loss)
    assert_same_optimizers(ours, theirs, list(model.parameters()), list(twin.parameters()))
    assert ours.step() is None  # no closure, no loss


def train(opt, params, g, steps, skip=()):
    """`steps` steps of random gradients (a generator for each, so two runs can be given the same ones)."""
    for _ in range(steps):
        for i, p in enumerate(params):
            p.grad = None if i in skip else torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_state_dict_round_trips_both_ways(amsgrad):
    """A checkpoint of ours loads into torch.optim.AdamW and one of torch's into ours, each then continuing bit for
    bit with an optimizer that never stopped; the two state_dicts are alike key for key."""
    start = make_params(5)
    kw = dict(lr=3e-3, weight_decay=0.1, amsgrad=amsgrad)
    for first, second in ((AdamW, torch.optim.AdamW), (torch.optim.AdamW, AdamW)):
        a_params, b_params, ref_params = clone_params(start), clone_params(start), clone_params(start)
        a = first(two_groups(a_params), **kw)
        ref = torch.optim.AdamW(two_groups(ref_params), **kw)
        train(a, a_params, torch.Generator().manual_seed(6), 3, skip={2})
        train(ref, ref_params, torch.Generator().manual_seed(6), 3, skip={2})
        sd, ref_sd = a.state_dict(), ref.state_dict()
        assert sd["param_groups"] == ref_sd["param_groups"]
        assert sorted(sd["state"]) == sorted(ref_sd["state"]) == [0, 1, 3]
        for i in sd["state"]:
            assert sorted(sd["state"][i]) == sorted(ref_sd["state"][i])
            assert all(same_bits(sd["state"][i][k], ref_sd["state"][i][k]) for k in sd["state"][i])

        b = second(two_groups(b_params), lr=1.0, weight_decay=0.0, amsgrad=amsgrad)  # settings from the checkpoint
        for p, q in zip(b_params, a_params):
            p.data.copy_(q.data)
        b.load_state_dict(saved(sd))
        assert b.param_groups[0]["lr"] == 3e-3 and b.param_groups[1]["weight_decay"] == 0.1
        g_b, g_ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        for _ in range(3):
            train(b, b_params, g_b, 1)
            train(ref, ref_params, g_ref, 1)
            assert_same_optimizers(b, ref, b_params, ref_params, f"{first.__module__} -> {second.__module__}")


def test_load_state_dict_keeps_this_class_settings():
    """A state saved by a fused and capturable torch AdamW (flags set by hand, step counts saved as float64) loads
    with fused None, capturable and differentiable False, and every step count a float32 tensor on the CPU; it
    then continues as torch's default AdamW would from the same checkpoint."""
    params = make_params(8)
    donor = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.1)
    train(donor, params, torch.Generator().manual_seed(9), 2)
    sd = saved(donor.state_dict())
    plain = copy.deepcopy(sd)
    for group in sd["param_groups"]:
        group["fused"], group["capturable"], group["differentiable"] = True, True, True
    for state in sd["state"].values():
        state["step"] = state["step"].double()

    ours_params, their_params = clone_params(params), clone_params(params)
    ours = AdamW(ours_params)
    ours.load_state_dict(sd)
    for group in ours.param_groups:
        assert group["fused"] is None and group["capturable"] is False and group["differentiable"] is False
    assert len(ours.state) == len(params)
    for state in ours.state.values():
        assert state["step"].device.type == "cpu" and state["step"].dtype == torch.float32
        assert state["step"].item() == 2
    theirs = torch.optim.AdamW(their_params)
    theirs.load_state_dict(plain)
    g_ours, g_theirs = torch.Generator().manual_seed(10), torch.Generator().manual_seed(10)
    for _ in range(2):
        train(ours, ours_params, g_ours, 1)
        train(theirs, their_params, g_theirs, 1)
        assert_same_optimizers(ours, theirs, ours_params, their_params)


def test_routes_name_every_parameter_torch_took_and_why():
    """On the CPU nothing goes to the kernel: each parameter with a gradient is declined with its group, position,
    shape and reason (the CPU, its dtype, AMSGrad, kernels=False); a parameter without a gradient is not listed."""
    a, b, c = make_params(11, [(3, 4), (5,), (2,)])
    d = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
    e = torch.nn.Parameter(torch.randn(2, 3).to(torch.bfloat16))
    opt = AdamW([{"params": [a, b, d]}, {"params": [e, c]}])
    for p in (a, d, e, c):
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.routes["tk"] == 0 and opt.routes["torch"] == 4
    declined = opt.routes["declined"]
    assert [entry[:3] for entry in declined] == [(0, 0, (3, 4)), (0, 2, (7,)), (1, 0, (2, 3)), (1, 1, (2,))]
    for group, position, shape, reason in declined:
        if shape == (7,):
            assert "float64" in reason, reason
        else:
            assert "cpu" in reason.lower(), reason

    b.grad = torch.ones_like(b)
    a.grad = None
    opt.step()  # the routes are the last step's
    assert [entry[:3] for entry in opt.routes["declined"]] == [(0, 1, (5,)), (0, 2, (7,)), (1, 0, (2, 3)),
                                                                (1, 1, (2,))]
    reasons = [entry[3] for entry in opt.routes["declined"]]
    assert opt.route_counts() == {"tk": 0, "torch": 4, "declined": {r: reasons.count(r) for r in reasons}}
    assert list(opt.route_counts()["declined"]) == list(dict.fromkeys(reasons))  # in the order first met

    for kwargs, words in ((dict(amsgrad=True), "amsgrad"), (dict(kernels=False), "kernels=False"),
                          (dict(lr=torch.tensor(1e-3)), "tensor")):
        p = torch.nn.Parameter(torch.randn(4))
        p.grad = torch.ones(4)
        opt = AdamW([p], **kwargs)
        opt.step()
        assert opt.routes["tk"] == 0 and opt.routes["torch"] == 1
        assert [(i, j, s) for i, j, s, _ in opt.routes["declined"]] == [(0, 0, (4,))]
        assert words in opt.routes["declined"][0][3], opt.routes


def test_deep_copy_and_pickle_keep_working():
    """torch.optim.AdamW survives copy.deepcopy and pickling (its state is defaults, state and param_groups); so must
    this class, kernels=False included."""
    import pickle

    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.ones(3)
    opt = AdamW([p], kernels=False)
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        q = clone.param_groups[0]["params"][0]
        q.grad = torch.ones(3)
        clone.step()
        assert clone.kernels is False and clone.routes["torch"] == 1


def test_sparse_gradients_raise():
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 3), (4, 3))
    with pytest.raises(RuntimeError, match="sparse"):
        AdamW([p]).step()


@pytest.mark.parametrize("kwarg", ["capturable", "differentiable"])
def test_torch_only_arguments_are_refused(kwarg):
    with pytest.raises(ValueError, match="capturable and differentiable are not supported"):
        AdamW([torch.nn.Parameter(torch.randn(2))], **{kwarg: True})


@pytest.mark.parametrize("fused", [None, False, True])
def test_fused_is_accepted_and_changes_nothing(fused):
    """A config written for torch.optim.AdamW(fused=True) needs only its class changed; the group keeps fused None
    (this class's path), so its state_dict and results stay those of torch's default path on the CPU."""
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.nn.Parameter(p.detach().clone())
    ours, theirs = AdamW([p], fused=fused), torch.optim.AdamW([q])
    for _ in range(2):
        p.grad, q.grad = torch.ones(3), torch.ones(3)
        ours.step()
        theirs.step()
    assert_same_optimizers(ours, theirs, [p], [q])


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def quad(*tensors):
    """adamw_step's four lists, one entry per tensor given (each entry's four tensors the given one's clones)."""
    return ([t for t in tensors], [t.clone() for t in tensors], [t.clone() for t in tensors],
            [t.clone() for t in tensors])


def test_adamw_step_errors_name_the_problem_cpu_tensors():
    x = torch.randn(3, 4)
    P, G, M, V = quad(x, x.clone())
    with pytest.raises(ValueError, match=r"params, grads, exp_avgs and exp_avg_sqs differ in length \(2, 1, 2, 2\)"):
        ops.adamw_step(P, G[:1], M, V, step=1, **HYPER)
    with pytest.raises(ValueError, match=r"differ in length \(2, 2, 2, 3\)"):
        ops.adamw_step(P, G, M, V + [x], step=1, **HYPER)
    # An entry's own checks come before the device's: the entry with the problem is the first.
    with pytest.raises(ValueError, match=r"entry 0: grad is torch.float16, the parameter torch.float32"):
        ops.adamw_step(P, [G[0].half(), G[1]], M, V, step=1, **HYPER)
    with pytest.raises(ValueError, match=r"entry 0: exp_avg_sq \(4, 3\) is not shaped like the parameter \(3, 4\)"):
        ops.adamw_step(P, G, M, [V[0].reshape(4, 3), V[1]], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"entry 0: exp_avg \(12,\) is not shaped like the parameter \(3, 4\)"):
        ops.adamw_step(P, G, [M[0].reshape(-1), M[1]], V, step=1, **HYPER)
    with pytest.raises(ValueError, match=r"entry 0: dtype torch.float64 not in \{bfloat16, float16, float32\}"):
        ops.adamw_step(*quad(x.double()), step=1, **HYPER)
    with pytest.raises(ValueError, match=r"entry 0: dtype torch.int32 not in"):
        ops.adamw_step(*quad(x.int()), step=1, **HYPER)
    with pytest.raises(ValueError, match=r"entry 0: the parameter is on cpu, not a CUDA device"):
        ops.adamw_step(P, G, M, V, step=1, **HYPER)
    with pytest.raises(ValueError, match=r"entry 0: grad is on meta, the parameter on cpu"):
        ops.adamw_step(P, [G[0].to("meta"), G[1]], M, V, step=1, **HYPER)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 4), (3, 4))
    with pytest.raises(ValueError, match=r"entry 0: grad is torch.sparse_coo, not dense"):
        ops.adamw_step(P[:1], [sparse], M[:1], V[:1], step=1, **HYPER)
    # A transposed (non-contiguous) CPU tensor is refused too, but for the device: the layout is checked after it
    # (its own message: the FakeTensor test below). The step count comes first, even for empty lists.
    with pytest.raises(ValueError, match=r"entry 0: the parameter is on cpu"):
        ops.adamw_step(*quad(x.t()), step=1, **HYPER)
    for step in (0, -1, float("nan")):
        with pytest.raises(ValueError, match=r"step must be at least 1"):
            ops.adamw_step(P, G, M, V, step=step, **HYPER)
        with pytest.raises(ValueError, match=r"step must be at least 1"):
            ops.adamw_step([], [], [], [], step=step, **HYPER)
    assert ops.adamw_step([], [], [], [], step=1, **HYPER) is None  # nothing to do


def test_adamw_step_layout_and_step_errors_on_fake_cuda_tensors():
    """The checks past the device's: contiguity of each of the four tensors, then tensor subclasses (the kernel
    needs a plain tensor's flat storage: FSDP2's DTensor, and these FakeTensors, are declined), and the step count
    (counted before the update: at least 1), on FakeTensors on "cuda"."""
    with FakeTensorMode():
        x = torch.empty(3, 4, device="cuda")
        P, G, M, V = quad(x, x)
        assert ops.adamw_unsupported(P[0], G[0], M[0], V[0]) == "param is a FakeTensor, not a plain tensor"
        t = torch.empty(4, 3, device="cuda").t()
        for name, lists in (("param", ([t], [t.contiguous()], [t.contiguous()], [t.contiguous()])),
                            ("grad", ([x], [t], [x], [x])),
                            ("exp_avg", ([x], [x], [t], [x])),
                            ("exp_avg_sq", ([x], [x], [x], [t]))):
            with pytest.raises(ValueError, match=rf"entry 0: {name} is not contiguous \(strides \(1, 3\)\)"):
                ops.adamw_step(*lists, step=1, **HYPER)
        with pytest.raises(ValueError, match=r"entry 0: param is a FakeTensor, not a plain tensor"):
            ops.adamw_step(P, G, M, V, step=1, **HYPER)
        for step in (0, 0.5, -1, math.nan):
            with pytest.raises(ValueError, match=rf"step must be at least 1 \(counted before the update\); got {step}"):
                ops.adamw_step(P, G, M, V, step=step, **HYPER)


def test_optimizer_declines_fake_cuda_tensors_by_layout():
    """adamw_unsupported's reasons for the optimizer's routes, for tensors on "cuda" (FakeTensors: metadata only)."""
    with FakeTensorMode():
        x = torch.empty(6, 2, device="cuda", dtype=torch.bfloat16)
        assert ops.adamw_unsupported(x, x, x, x) == "param is a FakeTensor, not a plain tensor"
        assert "not contiguous" in ops.adamw_unsupported(x[:, :1], x[:, :1], x[:, :1], x[:, :1])
        assert ops.adamw_unsupported(x, x.float(), x, x) == "grad is torch.float32, the parameter torch.bfloat16"
        assert ops.adamw_unsupported(x.double(), x.double(), x.double(), x.double()).startswith("dtype torch.float64")
        assert ops.adamw_unsupported(x, x, x, x.cpu()) == "exp_avg_sq is on cpu, the parameter on cuda:0"
        assert ops.adamw_unsupported(x, x, x.view(3, 4), x).startswith("exp_avg (3, 4) is not shaped like")


# The compiled module's own checks (tk::optim::adamw_unsupported and the binding's), where it is built and there is
# no GPU (CI): no address is read; a call the checks pass fails at the launch for want of a device, except one with
# no elements at all, which launches nothing.
A, B, C, D = 1 << 12, 2 << 12, 3 << 12, 4 << 12  # 16-byte aligned addresses, never read


@pytest.fixture
def ext(extension_without_gpu):
    if not hasattr(extension_without_gpu, "adamw"):
        pytest.skip("this build has no adamw")
    return extension_without_gpu


def ext_adamw(ext, **changes):
    args = dict(params=[A], grads=[B], exp_avgs=[C], exp_avg_sqs=[D], numels=[4096], dtype=0, lr=1e-3, beta1=0.9,
                beta2=0.999, eps=1e-8, weight_decay=0.1, step=1.0, maximize=False, clip_sq_norm=0, clip_max_norm=0.0,
                stream=0)
    args.update(changes)
    return ext.adamw(**args)


def test_compiled_checks(ext):
    with pytest.raises(RuntimeError, match="launching adamw failed"):
        ext_adamw(ext)
    with pytest.raises(RuntimeError, match="launching adamw failed"):  # unaligned, fp32, several entries
        ext_adamw(ext, params=[A + 4, A], grads=[B, B], exp_avgs=[C, C], exp_avg_sqs=[D, D], numels=[7, 0], dtype=2)
    ext_adamw(ext, params=[0, 0], grads=[0, 0], exp_avgs=[0, 0], exp_avg_sqs=[0, 0], numels=[0, 0])  # no elements
    ext_adamw(ext, params=[], grads=[], exp_avgs=[], exp_avg_sqs=[], numels=[])
    with pytest.raises(ValueError, match="thunder_tk adamw: dtype must be bfloat16, float16 or float32"):
        ext_adamw(ext, dtype=3)
    with pytest.raises(ValueError, match="thunder_tk adamw: the step count must be at least 1"):
        ext_adamw(ext, step=0.0)
    with pytest.raises(ValueError, match="thunder_tk adamw: the step count must be at least 1"):
        ext_adamw(ext, step=math.nan)
    with pytest.raises(ValueError, match="thunder_tk adamw: element counts must not be negative"):
        ext_adamw(ext, numels=[-1])
    with pytest.raises(ValueError, match="thunder_tk adamw: a tensor with elements has a null pointer"):
        ext_adamw(ext, grads=[0])
    with pytest.raises(ValueError, match="thunder_tk adamw: params, grads, exp_avgs, exp_avg_sqs and numels differ"):
        ext_adamw(ext, numels=[1, 2])
    with pytest.raises(RuntimeError, match="launching adamw failed"):  # clipped: the norm read on the device
        ext_adamw(ext, clip_sq_norm=A, clip_max_norm=1.0)


def ext_sq_norm(ext, **changes):
    args = dict(tensors=[A, B], numels=[4096, 7], dtype=0, workspace=C, workspace_size=ext.sq_norm_workspace(2),
                out=D, accumulate=False, stream=0)
    args.update(changes)
    return ext.sq_norm(**args)


def test_compiled_sq_norm_checks(ext):
    assert ext.sq_norm_workspace(0) == 0
    assert 0 < ext.sq_norm_workspace(1) == ext.sq_norm_workspace(256) < ext.sq_norm_workspace(257)
    with pytest.raises(RuntimeError, match="launching sq_norm failed"):
        ext_sq_norm(ext)
    with pytest.raises(RuntimeError, match="launching sq_norm failed"):  # nothing to read: the sum (0) still written
        ext_sq_norm(ext, tensors=[], numels=[], workspace=0, workspace_size=0)
    with pytest.raises(ValueError, match="thunder_tk sq_norm: dtype must be bfloat16, float16 or float32"):
        ext_sq_norm(ext, dtype=3)
    with pytest.raises(ValueError, match="thunder_tk sq_norm: the workspace is smaller than sq_norm_workspace"):
        ext_sq_norm(ext, workspace_size=ext.sq_norm_workspace(2) - 1)
    with pytest.raises(ValueError, match="thunder_tk sq_norm: the output is needed"):
        ext_sq_norm(ext, out=0)
    with pytest.raises(ValueError, match="thunder_tk sq_norm: the workspace is needed"):
        ext_sq_norm(ext, workspace=0)
    with pytest.raises(ValueError, match="thunder_tk sq_norm: element counts must not be negative"):
        ext_sq_norm(ext, numels=[5, -1])
    with pytest.raises(ValueError, match="thunder_tk sq_norm: a tensor with elements has a null pointer"):
        ext_sq_norm(ext, tensors=[A, 0])
    with pytest.raises(ValueError, match="thunder_tk sq_norm: tensors and numels differ in length"):
        ext_sq_norm(ext, numels=[1])


# -- clipping by the global norm (AdamW.clip_grad_norm_): on the CPU, torch's foreach norms and torch's path ------

@pytest.mark.parametrize("max_norm", [1e-2, 1e6], ids=["clipped", "under-max-norm"])
def test_clip_grad_norm_then_step_as_torch(max_norm):
    """Three steps of two groups, fp32, bf16 and float64 parameters and one without a gradient: clip_grad_norm_
    returns the gradients' norm (as torch.nn.utils.clip_grad_norm_'s, and float64's), and the step is
    torch.optim.AdamW's bit for bit after the gradients were multiplied by torch's clip factor for that norm; the
    gradients stay as they were. Under max_norm (factor 1) also as torch's plain clip_grad_norm_ and step."""
    ours_params = make_params(20) + make_params(21, [(6,)], torch.bfloat16) + make_params(23, [(4,)], torch.float64)
    their_params = clone_params(ours_params)
    ours = AdamW(two_groups(ours_params), lr=2e-3, weight_decay=0.1)
    theirs = torch.optim.AdamW(two_groups(their_params), lr=2e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(22)
    for step in range(1, 4):
        set_grads(list(zip(ours_params, their_params)), g, skip={1})
        grads = [None if p.grad is None else p.grad.clone() for p in ours_params]
        norm = ours.clip_grad_norm_(max_norm)
        want = math.sqrt(sum(float(x.double().square().sum()) for x in grads if x is not None))
        assert norm.dtype == torch.float32 and norm.shape == () and abs(norm.item() - want) <= 1e-6 * want
        if max_norm > 1:
            their_norm = torch.nn.utils.clip_grad_norm_(their_params, max_norm)
            assert abs(their_norm.item() - want) <= 1e-2 * want  # torch's norm of the bf16 gradient is bf16
        else:
            torch._foreach_mul_([q.grad for q in their_params if q.grad is not None], clip_factor(norm, max_norm))
        ours.step()
        theirs.step()
        assert_same_optimizers(ours, theirs, ours_params, their_params, f"step {step}")
        for p, x in zip(ours_params, grads):
            assert (p.grad is None and x is None) or same_bits(p.grad, x)


def test_clip_is_used_by_one_step_and_dropped_by_zero_grad():
    """The step after clip_grad_norm_ is clipped, the one after it not; zero_grad() (a batch's gradients thrown
    away) drops a clip not yet applied; a second clip_grad_norm_ replaces the first."""
    p = torch.nn.Parameter(torch.randn(5))
    q = torch.nn.Parameter(p.detach().clone())
    ours, theirs = AdamW([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2)

    def grads(value):
        p.grad, q.grad = torch.full((5,), value), torch.full((5,), value)

    grads(3.0)
    norm = ours.clip_grad_norm_(1e-3)
    q.grad.mul_(clip_factor(norm, 1e-3))
    ours.step()
    theirs.step()
    grads(3.0)
    ours.step()  # no clip pending: unclipped
    theirs.step()
    assert_same_optimizers(ours, theirs, [p], [q])
    ours.clip_grad_norm_(1e-3)
    ours.zero_grad()
    theirs.zero_grad()
    assert p.grad is None
    grads(2.0)
    ours.step()
    theirs.step()
    assert_same_optimizers(ours, theirs, [p], [q])
    grads(2.0)
    ours.clip_grad_norm_(1e-3)
    norm = ours.clip_grad_norm_(0.5)  # replaces the first
    q.grad.mul_(clip_factor(norm, 0.5))
    ours.step()
    theirs.step()
    assert_same_optimizers(ours, theirs, [p], [q])


def test_clip_grad_norm_edges_and_errors():
    p = torch.nn.Parameter(torch.randn(4))
    opt = AdamW([p])
    norm = opt.clip_grad_norm_(1.0)  # no gradients: norm 0, as torch's, and nothing pending
    assert norm.item() == 0.0 and opt._clip is None
    for bad in (0, -1.0, math.nan, True, "1", None):
        with pytest.raises(ValueError, match="clip_grad_norm_: max_norm must be a positive number"):
            opt.clip_grad_norm_(bad)
    p.grad = torch.ones(4)
    assert opt.clip_grad_norm_(math.inf).item() == 2.0  # max_norm inf: the norm, factor 1
    p.grad = torch.tensor([1.0, math.inf, 0.0, 0.0])
    assert opt.clip_grad_norm_(1.0).item() == math.inf  # non-finite norms carry through, as torch's default
    p.grad = torch.ones(4)
    opt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="a closure recomputes the gradients that clip_grad_norm_ measured"):
        opt.step(lambda: None)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,))
    with pytest.raises(RuntimeError, match="clip_grad_norm_ does not support sparse gradients"):
        opt.clip_grad_norm_(1.0)


def test_clip_grad_norm_over_a_process_group():
    """process_group: the squared norm summed over the group's ranks (one gloo rank here: the same norm)."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        p = torch.nn.Parameter(torch.randn(6))
        p.grad = torch.full((6,), 2.0)
        opt = AdamW([p])
        assert opt.clip_grad_norm_(1.0, process_group=dist.group.WORLD).item() == pytest.approx(math.sqrt(24))
    finally:
        dist.destroy_process_group()


def test_sq_norm_and_clip_argument_errors_cpu_tensors():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"sq_norm: entry 0 is on cpu, not a CUDA device"):
        ops.sq_norm([x])
    with pytest.raises(ValueError, match=r"sq_norm: entry 0 is dtype torch.int32 not in"):  # before the device
        ops.sq_norm([x.int(), x])
    with FakeTensorMode():  # past the device's check: metadata only
        y = torch.empty(4, 6, device="cuda")
        assert ops.sq_norm_unsupported(y) == "a FakeTensor, not a plain tensor"
        assert not ops.sq_norm_list_alike([y])
    with pytest.raises(ValueError, match=r"no tensors and no `out`"):
        ops.sq_norm([])
    P, G, M, V = quad(x)
    with pytest.raises(ValueError, match="adamw_step: grad_sq_norm and max_norm go together"):
        ops.adamw_step(P, G, M, V, step=1, max_norm=1.0, **HYPER)
    with pytest.raises(ValueError, match="adamw_step: max_norm must be a positive number; got 0"):
        ops.adamw_step(P, G, M, V, step=1, grad_sq_norm=torch.ones(()), max_norm=0, **HYPER)
    with pytest.raises(ValueError, match="adamw_step: grad_sq_norm must be a one-element float32 tensor"):
        ops.adamw_step(P, G, M, V, step=1, grad_sq_norm=torch.ones(2), max_norm=1.0, **HYPER)


# The kernel route on the CPU, with a stand-in for the launch: CPU tensors pass the device checks, and the stand-in
# finds the tensors behind the addresses it is handed and updates them by torch's single-tensor AdamW, so that the
# optimizer's host path (the full one and the kept plan) is checked for handing the right tensors, step counts and
# settings to the kernel, bit for bit against torch.optim.AdamW.
class KernelStandIn:
    def __init__(self, monkeypatch, optimizer):
        self.optimizer, self.launches, self.planned = optimizer, [], []
        monkeypatch.setattr(ops, "_require_kernels", lambda device: self)
        monkeypatch.setattr(ops, "_adamw_launch_ptrs", self.launch)
        adamw_unsupported = ops.adamw_unsupported

        def unsupported_but_for_the_cpu(p, g, m, v):  # the checks past the device's: contiguity
            reason = adamw_unsupported(p, g, m, v)
            if reason != f"the parameter is on {p.device}, not a CUDA device":
                return reason
            for name, t in (("param", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
                if not t.is_contiguous():
                    return f"{name} is not contiguous (strides {tuple(t.stride())})"
            return None

        def lists_alike(params, grads, exp_avgs, exp_avg_sqs):
            everything = [*params, *grads, *exp_avgs, *exp_avg_sqs]
            return len({t.dtype for t in everything}) == 1 and all(
                unsupported_but_for_the_cpu(*four) is None for four in zip(params, grads, exp_avgs, exp_avg_sqs))

        monkeypatch.setattr(ops, "adamw_unsupported", unsupported_but_for_the_cpu)
        monkeypatch.setattr(ops, "adamw_lists_alike", lists_alike)
        monkeypatch.setattr(ops, "_is_cuda", lambda t: True)  # the bulk checks' device test
        monkeypatch.setattr(AdamW, "_device_reason", lambda opt, device: None)
        planned_update = AdamW._planned_update

        def spy(opt, index, group):
            used = planned_update(opt, index, group)
            self.planned.append(used)
            return used

        monkeypatch.setattr(AdamW, "_planned_update", spy)

    def tensors_by_address(self):
        found = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                for t in (p, p.grad, state.get("exp_avg"), state.get("exp_avg_sq")):
                    if t is not None:
                        found.setdefault(t.data_ptr(), []).append(t)
        return found

    def launch(self, ext, device, dtype, params, grads, exp_avgs, exp_avg_sqs, numels, *, step, lr, beta1, beta2,
               eps, weight_decay, maximize, grad_sq_norm=None, max_norm=None):
        assert ext is self
        self.launches.append(dict(count=len(params), step=step, lr=lr, clipped=grad_sq_norm is not None))
        found = self.tensors_by_address()
        pick = [[found[a][0] for a in addresses] for addresses in (params, grads, exp_avgs, exp_avg_sqs)]
        assert numels == [t.numel() for t in pick[0]] and all(t.dtype == dtype for lst in pick for t in lst)
        gs = pick[1]
        if grad_sq_norm is not None:
            gs = [g * clip_factor(grad_sq_norm.sqrt(), max_norm) for g in gs]
        _torch_single_tensor_adamw(pick[0], gs, pick[2], pick[3], step, lr, beta1, beta2, eps, weight_decay, maximize)


def _torch_single_tensor_adamw(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay,
                               maximize):
    from torch.optim.adamw import adamw

    steps = [torch.tensor(float(step) - 1) for _ in params]  # counted up inside, as the optimizer's own
    adamw([p.detach() for p in params], grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, capturable=False,
          differentiable=False, fused=None, grad_scale=None, found_inf=None, has_complex=False, amsgrad=False,
          beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)


def test_kept_plan_hands_the_kernel_what_the_full_path_would(monkeypatch):
    """A group whose every parameter went to the kernel keeps a plan: later steps check the fresh gradients in full
    and the parameters and moments for having been replaced, and take one launch with the kept addresses. Each
    change a plan cannot carry sends that step down the full path (which plans again where it can): a parameter's
    storage replaced, a moment buffer replaced, a gradient missing, a non-contiguous gradient (declined to torch,
    by name), a load_state_dict. Every step bit for bit as torch.optim.AdamW, learning-rate changes included."""
    shapes = [(5, 7), (13,), (3, 4, 2), (1,)]
    ours_params = make_params(21, shapes)
    their_params = clone_params(ours_params)
    ours = AdamW(ours_params, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(their_params, lr=1e-2, weight_decay=0.1)
    kernel = KernelStandIn(monkeypatch, ours)
    g = torch.Generator().manual_seed(5)
    pairs = list(zip(ours_params, their_params))

    def step(skip=(), expect_planned=None, expect_tk=len(shapes)):
        set_grads(pairs, g, skip)
        kernel.planned.clear()
        ours.step()
        theirs.step()
        assert_same_optimizers(ours, theirs, ours_params, their_params)
        if expect_planned is not None:
            assert kernel.planned == [expect_planned]
        assert ours.routes["tk"] == expect_tk, ours.routes

    step(expect_planned=False)  # the first step plans
    for _ in range(2):
        step(expect_planned=True)
    assert kernel.launches[-1] == dict(count=4, step=3.0, lr=1e-2, clipped=False)
    for group in (*ours.param_groups, *theirs.param_groups):
        group["lr"] = 3e-3  # a scheduler's change is read every step
    step(expect_planned=True)
    assert kernel.launches[-1]["lr"] == 3e-3

    ours_params[1].data = ours_params[1].data.clone()  # new storage behind the same Parameter
    step(expect_planned=False)
    step(expect_planned=True)
    state = ours.state[ours_params[2]]
    state["exp_avg"] = state["exp_avg"].clone()
    step(expect_planned=False)
    step(expect_planned=True)

    step(skip=(0,), expect_planned=False, expect_tk=3)  # a parameter without a gradient: no plan
    launches = len(kernel.launches)
    step(expect_planned=False)  # counts differ now: one launch per count
    assert [launch["step"] for launch in kernel.launches[launches:]] == [9.0, 10.0]
    step(expect_planned=True)

    set_grads(pairs, g)
    ours_params[0].grad = torch.randn(7, 5, generator=g).t()  # (5, 7) with strides (1, 5): not contiguous
    their_params[0].grad = ours_params[0].grad.clone()
    ours.step()
    theirs.step()
    assert_same_optimizers(ours, theirs, ours_params, their_params)
    assert ours.routes["tk"] == 3 and "grad is not contiguous" in ours.routes["declined"][0][3]

    step(expect_planned=False)
    step(expect_planned=True)
    set_grads(pairs, g)
    norm = ours.clip_grad_norm_(0.5)
    for q in their_params:
        q.grad.mul_(clip_factor(norm, 0.5))
    kernel.planned.clear()
    ours.step()
    theirs.step()
    assert kernel.planned == [True] and kernel.launches[-1]["clipped"]
    assert_same_optimizers(ours, theirs, ours_params, their_params)

    ours.load_state_dict(saved(ours.state_dict()))
    step(expect_planned=False)  # a loaded state is planned afresh
    step(expect_planned=True)


def test_hand_set_step_counts_are_packed_for_the_plan(monkeypatch):
    """A state set by hand (each step count its own tensor, as benchmarks and converters write it) is planned too:
    its counts become views of one buffer, their values kept, and the next step takes the plan."""
    ours_params = make_params(31, [(4, 3), (6,)])
    their_params = clone_params(ours_params)
    ours = AdamW(ours_params, lr=1e-2)
    theirs = torch.optim.AdamW(their_params, lr=1e-2)
    kernel = KernelStandIn(monkeypatch, ours)
    for opt, params in ((ours, ours_params), (theirs, their_params)):
        for i, p in enumerate(params):
            opt.state[p] = {"step": torch.tensor(float(7 + i)), "exp_avg": torch.full_like(p, 0.01 * (i + 1)),
                            "exp_avg_sq": torch.full_like(p, 1e-4)}
    g = torch.Generator().manual_seed(32)
    for planned in (False, True):
        set_grads(list(zip(ours_params, their_params)), g)
        kernel.planned.clear()
        ours.step()
        theirs.step()
        assert kernel.planned == [planned]
        assert_same_optimizers(ours, theirs, ours_params, their_params)
    steps = [ours.state[p]["step"] for p in ours_params]
    assert [float(s) for s in steps] == [9.0, 10.0] and steps[0]._base is steps[1]._base is not None
