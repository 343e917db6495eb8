"""Claim rules judged on CUDA-device proxies: every accept and every reason to decline."""

import pytest
import thunder
from thunder.core.devices import Device
from thunder.core.proxies import TensorProxy
from thunder.core.trace import detached_trace
from thunder.distributed.prims import DistributedReduceOps

from thunder_tk import _extension
from thunder_tk._extension import planning_for
from thunder_tk.claim_rules import RULES, RULES_BY_ID, check_sdpa
from thunder_tk.functional import attention_bwd_delta_symbol
import thunder.torch as ltorch
from thunder.core import prims
from thunder.distributed import prims as dist_prims

bf16, f16, f32, i64 = thunder.bfloat16, thunder.float16, thunder.float32, thunder.int64


@pytest.fixture(autouse=True)
def trace_context():
    with detached_trace():
        yield


def proxy(*shape, dtype=bf16, device="cuda:0"):
    return TensorProxy(shape=shape, dtype=dtype, device=Device(device))


def rule(symbol):
    return RULES_BY_ID[symbol.id if hasattr(symbol, "id") else symbol]


def judge(symbol, *args, **kwargs):
    with _extension.planning_for():
        return rule(symbol).judge(*args, **kwargs)


SDPA = ltorch.scaled_dot_product_attention
SDPA_NAME = "ltorch.scaled_dot_product_attention"


def test_one_rule_per_claimed_symbol():
    ids = [r.symbol_id for r in RULES]
    assert len(ids) == len(set(ids))
    assert {SDPA.id, ltorch.linear.id, prims.PrimIDs.LINEAR, ltorch.matmul.id, prims.PrimIDs.MATMUL,
            dist_prims.PrimIDs.ALL_GATHER, dist_prims.PrimIDs.REDUCE_SCATTER} <= set(ids)


# -- attention ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(16, 16), (16, 8), (32, 4), (8, 1)])
def test_sdpa_shape_constraints_accept(D, hq, hkv):
    q, k = proxy(2, hq, 1000, D), proxy(2, hkv, 1000, D)
    assert check_sdpa(q, k, k, None, 0.0, True, scale=None)
    assert check_sdpa(q, k, k, None, 0.0, False, scale=0.3)
    assert check_sdpa(proxy(1, hq, 1, D), proxy(1, hkv, 17, D), proxy(1, hkv, 17, D), None, 0.0, False)


@pytest.mark.parametrize(
    "make_args, reason",
    [
        (lambda: (proxy(2, 16, 128, 128),) * 3 + (proxy(128, 128, dtype=thunder.bool8), 0.0, False),
         "attn_mask is an input of the traced function"),
        (lambda: (proxy(2, 16, 128, 128),) * 3 + (None, 0.1, False), "dropout_p=0.1 > 0"),
        (lambda: (proxy(2, 16, 128, 96),) * 3 + (None, 0.0, False), "head_dim 96 not in {64, 128, 256}"),
        (lambda: (proxy(2, 16, 128, 512),) * 3 + (None, 0.0, False), "head_dim 512 not in {64, 128, 256}"),
        (lambda: (proxy(2, 16, 128, 128, dtype=f32),) * 3 + (None, 0.0, False), "dtype float32 not in {bfloat16, float16}"),
        (lambda: (proxy(2, 16, 128, 128), proxy(2, 16, 256, 128), proxy(2, 16, 256, 128), None, 0.0, True),
         "causal with Sq=128 != Sk=256"),
        (lambda: (proxy(2, 16, 128, 128), proxy(2, 6, 128, 128), proxy(2, 6, 128, 128), None, 0.0, False),
         "query heads 16 not a multiple of key/value heads 6"),
        (lambda: (proxy(16, 128, 128),) * 3 + (None, 0.0, False), "expects 4-D"),
        (lambda: (proxy(2, 16, 128, 128), proxy(2, 16, 128, 128, dtype=f16), proxy(2, 16, 128, 128), None, 0.0, False),
         "mixed dtypes"),
        (lambda: (proxy(2, 16, 128, 128), proxy(2, 16, 128, 64), proxy(2, 16, 128, 64), None, 0.0, False),
         "head dims differ"),
        (lambda: (proxy(2, 16, 128, 64), proxy(2, 16, 0, 64), proxy(2, 16, 0, 64), None, 0.0, False),
         "key/value length is 0"),
        (lambda: (proxy(2, 16, 0, 64), proxy(2, 16, 0, 64), proxy(2, 16, 0, 64), None, 0.0, True),
         "key/value length is 0"),
        (lambda: (proxy(1, 16, 1, 128), proxy(1, 16, 512, 128), proxy(1, 16, 512, 128), None, 0.0, True),
         "causal with Sq=1 != Sk=512"),
        (lambda: (proxy(2, 4, 128, 64),) * 3 + (None, 0.0, False, float("inf")), "scale=inf is not finite"),
        (lambda: (proxy(2, 4, 128, 64),) * 3 + (None, 0.0, False, float("nan")), "scale=nan is not finite"),
        (lambda: (proxy(2, 2, 128, 64), proxy(2, 4, 128, 64), proxy(2, 4, 128, 64), None, 0.0, False),
         "query heads 2 not a multiple of key/value heads 4"),
        (lambda: (proxy(1, 4, 128, 64), proxy(2, 4, 128, 64), proxy(2, 4, 128, 64), None, 0.0, False),
         "batch sizes differ: 1, 2, 2"),
    ],
)
def test_sdpa_declines_with_reason(make_args, reason):
    args = make_args()
    scale = args[6] if len(args) > 6 else None
    verdict = judge(SDPA, *args[:6], scale=scale)
    assert not verdict and reason in verdict.reason, verdict.reason


class FakeBuild:
    def __init__(self, *kernels):
        self._kernels = kernels

    def kernels(self):
        return list(self._kernels)


def test_sdpa_needs_the_forward_kernel_and_its_gradient_the_backward_kernel(monkeypatch):
    from thunder_tk import tk  # its rules carry the lowering (thunder_tk.lowering)

    sdpa = {r.symbol_id: r for r in tk.rules}[SDPA.id]
    assert (sdpa.kernel, sdpa.grad_kernel) == ("attention_forward", "attention_backward")
    assert sdpa.execution_transform is not None and sdpa.grad_transform is not None
    monkeypatch.setattr(_extension, "_real_capability", lambda index: (9, 0))
    q = proxy(2, 16, 1024, 128)
    args = (q, q, q, None, 0.0, True)

    monkeypatch.setattr(_extension, "_load", lambda: (FakeBuild("gemm"), ""))
    verdict = sdpa.judge(*args, scale=None)
    assert verdict.reason == "tk has no attention kernel yet (attention_forward is not in this build)"

    monkeypatch.setattr(_extension, "_load", lambda: (FakeBuild("gemm", "attention_forward"), ""))
    assert sdpa.judge(*args, scale=None)
    verdict = sdpa.judge_gradient()
    assert verdict.reason == "tk has no attention backward kernel in this build (attention_backward)"

    monkeypatch.setattr(_extension, "_load", lambda: (FakeBuild("attention_forward", "attention_backward"), ""))
    assert sdpa.judge(*args, scale=None) and sdpa.judge_gradient()
    # A rule without a lowering has no gradient; the table's rules get theirs from the executor.
    assert RULES_BY_ID[SDPA.id].judge_gradient().reason == f"tk has no gradient for {SDPA_NAME}"
    # A symbol whose gradient needs no kernel of its own.
    delta = {r.symbol_id: r for r in tk.rules}[attention_bwd_delta_symbol.id]
    assert delta.grad_kernel is None and delta.judge_gradient()


# -- devices and the build --------------------------------------------------------------------------


def test_device_reasons():
    cpu = proxy(2, 4, 8, 64, device="cpu")
    assert judge(attention_bwd_delta_symbol, cpu, cpu).reason == "tensor on cpu"
    a, b = proxy(2, 4, 8, 64), proxy(2, 4, 8, 64, device="cuda:1")
    assert "several devices" in judge(attention_bwd_delta_symbol, a, b).reason
    with _extension.planning_for((8, 0)):
        verdict = rule(attention_bwd_delta_symbol).judge(a, a)
    assert verdict.reason == "GPU is sm_80; tk kernels need sm_90 (Hopper)"


def test_without_a_gpu(kernels_built, monkeypatch):
    monkeypatch.setattr(_extension, "_real_capability", lambda index: None)
    a = proxy(2, 4, 8, 64)
    assert rule(attention_bwd_delta_symbol).judge(a, a).reason == "no CUDA device cuda:0 is visible"


def test_on_an_sm90_gpu(kernels_built, monkeypatch):
    monkeypatch.setattr(_extension, "_real_capability", lambda index: (9, 0))
    a = proxy(2, 4, 8, 64)
    assert rule(attention_bwd_delta_symbol).judge(a, a)


def test_kernels_not_built_declines_everything(kernels_not_built):
    a = proxy(2, 4, 8, 64)
    for r in RULES:
        verdict = r.judge(a, a)
        assert not verdict and verdict.reason == f"kernels not built: {kernels_not_built}"


# -- GEMMs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("symbol", [ltorch.linear, prims.PrimIDs.LINEAR])
def test_linear_reasons(symbol):
    r = rule(symbol)
    assert r.check(proxy(4, 7, 1024), proxy(4096, 1024), None)
    assert r.check(proxy(1, 8), proxy(3, 8), proxy(3))
    assert r.check(proxy(4, 1004), proxy(64, 1004)).reason == "K=1004 not a multiple of 8"
    assert r.check(proxy(4, 64, dtype=f32), proxy(64, 64, dtype=f32)).reason == "dtype float32 not in {bfloat16, float16}"
    assert r.check(proxy(4, 64), proxy(2, 64, 64)).reason == "weight is 3-D, expected 2-D"
    assert "bias must be a 1-D bfloat16" in r.check(proxy(4, 64), proxy(8, 64), proxy(8, dtype=f32)).reason
    assert judge(symbol, proxy(4, 64), proxy(8, 64), None)
    assert judge(symbol, proxy(2, 3, 64), proxy(8, 64), proxy(8))


@pytest.mark.parametrize("symbol", [ltorch.matmul, prims.PrimIDs.MATMUL])
def test_matmul_reasons(symbol):
    r = rule(symbol)
    assert r.check(proxy(33, 64), proxy(64, 17))
    assert r.check(proxy(2, 33, 64), proxy(64, 17)).reason == "only 2-D @ 2-D is claimed; got 3-D @ 2-D"
    assert r.check(proxy(33, 12), proxy(12, 17)).reason == "K=12 not a multiple of 8"
    assert judge(symbol, proxy(33, 64), proxy(64, 17))


# -- collectives ----------------------------------------------------------------------------------------


class FakeGroup:
    """Stands in for a torch ProcessGroup: the rules read only its size, name and global ranks."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.group_name = "fake"

    def size(self):
        return len(self.ranks)


@pytest.fixture
def node_of_two(monkeypatch):
    """A node with two GPUs that reach each other, processes started by torchrun (2 per node)."""
    from thunder_tk import collectives

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(collectives, "_group_ranks", lambda g: g.ranks)
    monkeypatch.setattr(collectives, "_visible_gpus", lambda: 2)
    monkeypatch.setattr(collectives, "_peer_access", lambda i, j: True)
    return collectives


def test_collective_reasons(node_of_two):
    ag, rs = rule(dist_prims.PrimIDs.ALL_GATHER), rule(dist_prims.PrimIDs.REDUCE_SCATTER)
    pair = FakeGroup([0, 1])
    for dtype in (bf16, f16, f32):
        assert ag.check(proxy(1024, dtype=dtype), pair, True, None)
        assert rs.check(proxy(1024, dtype=dtype), DistributedReduceOps.SUM, pair, True, None)
        assert rs.check(proxy(1024, dtype=dtype), DistributedReduceOps.AVG, pair, True, 0)
    assert ag.check(proxy(1024, dtype=i64), pair, True, None).reason == "dtype int64 not in {bfloat16, float16, float32}"
    assert ag.check(proxy(4, 4), pair, True, 1).reason == "dim=1; only dim 0 is supported"
    assert rs.check(proxy(8), DistributedReduceOps.MAX, pair, True, None).reason == "reduce op MAX not in {SUM, AVG}"


def test_collective_group_reasons(node_of_two, monkeypatch):
    ag = rule(dist_prims.PrimIDs.ALL_GATHER)
    x = proxy(1024)
    assert ag.check(x, FakeGroup([0]), True, None).reason == "the process group has one rank (nothing to exchange)"
    assert "spans 2 nodes (ranks [1, 2], 2 per node)" in ag.check(x, FakeGroup([1, 2]), True, None).reason
    assert "serve up to 16 GPUs" in ag.check(x, FakeGroup(range(17)), True, None).reason
    monkeypatch.setattr(node_of_two, "_peer_access", lambda i, j: (i, j) != (1, 0))
    assert ag.check(x, FakeGroup([0, 1]), True, None).reason == (
        "GPUs 1 and 0 have no peer access (no NVLink/PCIe P2P between them)")
    monkeypatch.setattr(node_of_two, "_visible_gpus", lambda: 1)
    assert "this process sees 1 GPU(s) but the group's local ranks are [0, 1]" in ag.check(
        x, FakeGroup([0, 1]), True, None).reason
    # Planning without GPUs judges only what the process group says.
    with planning_for():
        assert ag.check(x, FakeGroup([0, 1]), True, None)
        assert "spans 2 nodes" in ag.check(x, FakeGroup([1, 2]), True, None).reason
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # without torchrun's variables, global rank = GPU index
    monkeypatch.setattr(node_of_two, "_visible_gpus", lambda: 2)
    monkeypatch.setattr(node_of_two, "_peer_access", lambda i, j: True)
    assert ag.check(x, FakeGroup([0, 1]), True, None)


def test_rules_can_be_disabled_by_name_or_family(monkeypatch, node_of_two):
    with planning_for():
        assert judge(dist_prims.PrimIDs.ALL_GATHER, proxy(64), FakeGroup([0, 1]), True, None)
        monkeypatch.setenv("THUNDER_TK_DISABLE", "collective")
        v = judge(dist_prims.PrimIDs.ALL_GATHER, proxy(64), FakeGroup([0, 1]), True, None)
        assert not v and v.reason == "disabled by THUNDER_TK_DISABLE"
        assert judge(ltorch.matmul, proxy(33, 64), proxy(64, 17))
        monkeypatch.setenv("THUNDER_TK_DISABLE", "ltorch.matmul, attention")
        assert judge(ltorch.matmul, proxy(33, 64), proxy(64, 17)).reason == "disabled by THUNDER_TK_DISABLE"
        assert judge(prims.PrimIDs.MATMUL, proxy(33, 64), proxy(64, 17))


# -- thunder_tk's own symbol ---------------------------------------------------------------------------


def test_attention_bwd_delta_rule():
    a = proxy(2, 4, 9, 128)
    assert judge(attention_bwd_delta_symbol, a, a)
    assert judge(attention_bwd_delta_symbol, proxy(2, 4, 9, 128, dtype=f32), proxy(2, 4, 9, 128, dtype=f32))
    assert "expects (B, H, S, D)" in judge(attention_bwd_delta_symbol, proxy(4, 9, 128), proxy(4, 9, 128)).reason
    assert "shapes differ" in judge(attention_bwd_delta_symbol, a, proxy(2, 4, 9, 64)).reason
    assert "mixed dtypes" in judge(attention_bwd_delta_symbol, a, proxy(2, 4, 9, 128, dtype=f16)).reason
    i = proxy(2, 4, 9, 128, dtype=i64)
    assert "dtype int64" in judge(attention_bwd_delta_symbol, i, i).reason


# -- the GEMM size policy ------------------------------------------------------------------------------------


@pytest.mark.gemm_size_policy
def test_gemm_size_policy_leaves_small_products_to_cublas():
    from thunder_tk.claim_rules import GEMM_MIN_K, gemm_output_tiles

    # 128 x 256 tiles; 128 x 128 where those fill the last wave of 132 SMs clearly better
    assert gemm_output_tiles(8192, 4096, 132) == 64 * 16
    assert gemm_output_tiles(256, 4096, 132) == 2 * 32  # 32 wide tiles fill 24%, 64 narrow ones 48%
    assert gemm_output_tiles(256, 14336, 132) == 2 * 56  # 85%: wide
    linear, matmul = rule(ltorch.linear), rule(prims.PrimIDs.MATMUL)
    # decoding and small batches (the skinny kernel) against 4096- to 14336-wide weights
    v = judge(ltorch.linear, proxy(1, 1, 4096), proxy(11008, 4096))
    assert not v and v.reason.startswith("1 x 11008 output: at most 64 rows against fewer than 65536 columns")
    assert "gemm_size_policy" in v.reason
    assert not judge(prims.PrimIDs.MATMUL, proxy(64, 14336), proxy(14336, 4096))
    assert judge(ltorch.linear, proxy(1, 4096), proxy(128256, 4096))  # the lm_head at one token
    # more rows: fewer tiles than half the SMs (256 tokens against 4096 columns: 64 narrow tiles)
    v = judge(prims.PrimIDs.MATMUL, proxy(256, 11008), proxy(11008, 4096))
    assert not v and v.reason.startswith("256 x 4096 output: 64 tiles for 132 SMs; cuBLAS is faster at this size")
    assert judge(prims.PrimIDs.LINEAR, proxy(256, 4096), proxy(14336, 4096))  # 112 tiles: claimed
    # a training step's products
    assert judge(prims.PrimIDs.LINEAR, proxy(2, 2048, 4096), proxy(4096, 4096))
    assert judge(prims.PrimIDs.MATMUL, proxy(2048, 8192), proxy(8192, 2048))  # dW of 8192 tokens, 128 tiles
    # a short reduction (dW of 256 tokens)
    v = judge(prims.PrimIDs.MATMUL, proxy(4096, 256), proxy(256, 4096))
    assert not v and v.reason.startswith(f"K=256 < {GEMM_MIN_K}: cuBLAS is faster at this depth")
    assert judge(prims.PrimIDs.MATMUL, proxy(4096, GEMM_MIN_K), proxy(GEMM_MIN_K, 4096))
    # the support checks come first
    assert linear.check(proxy(1, 1004), proxy(64, 1004)).reason == "K=1004 not a multiple of 8"
    assert matmul.check(proxy(2, 3, 64), proxy(64, 5)).reason.startswith("only 2-D @ 2-D")


@pytest.mark.gemm_size_policy
def test_gemm_size_policy_can_be_turned_off(monkeypatch):
    small = (proxy(16, 4096), proxy(4096, 4096))
    assert not judge(ltorch.linear, *small)
    monkeypatch.setenv("THUNDER_TK_DISABLE", "gemm_size_policy")
    assert judge(ltorch.linear, *small)
    monkeypatch.delenv("THUNDER_TK_DISABLE")
    from thunder_tk.claim_rules import known_disable_names

    assert "gemm_size_policy" in known_disable_names()


@pytest.mark.gemm_size_policy
def test_gemm_size_policy_counts_the_gpus_multiprocessors(monkeypatch, kernels_built):
    monkeypatch.setattr(_extension, "_real_capability", lambda index: (9, 0))
    monkeypatch.setattr(_extension, "_real_multiprocessors", lambda index: 114)  # an H100 PCIe
    a, w = proxy(256, 4096), proxy(4096, 4096)  # 64 narrow tiles: over half of 114 SMs, under half of 132
    assert rule(ltorch.linear).judge(a, w, None)
    with _extension.planning_for():
        assert not rule(ltorch.linear).judge(a, w, None)
