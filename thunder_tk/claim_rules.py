"""Which trace symbols tk claims, and when: one rule per symbol, as data.

A rule's checker reads metadata only (shapes, dtypes, devices, flags); it never touches the GPU, so the
rules can be judged on a machine without one. It returns a `Verdict`: accept, or a reason a person can act on.
Checks run in a fixed order: build, device, then the symbol's own constraints, then whether this build has the
kernel. The first failing check is the reason shown.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import thunder
import thunder.torch as ltorch
from thunder.core import prims
from thunder.core.proxies import TensorProxy, pyval
from thunder.distributed import prims as dist_prims

from thunder_tk import _extension, attention_masks, ops
from thunder_tk.functional import attention_bwd_delta_symbol

# Kernels this version's csrc/ provides (a GPU test checks the build reports exactly these).
KERNELS_IN_SOURCE = frozenset({"adamw", "all_gather", "attention_backward", "attention_bwd_delta", "attention_forward",
                               "attention_rope_grad", "cross_entropy_backward", "cross_entropy_forward",
                               "cross_entropy_forward_grad", "embedding_backward", "gemm", "gemm_fp32", "gemm_rope",
                               "gemm_sum", "gemm_swiglu", "gemm_swiglu_grad", "reduce_scatter", "rms_norm",
                               "sq_norm"})

DISABLE_ENV = "THUNDER_TK_DISABLE"
"""Comma-separated rule names or families tk must not claim (e.g. ``collective`` or ``ltorch.linear``)."""
DISABLE_OPTION = "tk_disable"
"""The same per jitted function: ``thunder.jit(fn, executors=[tk], tk_disable="gemm")`` (a string as above, or a list).
Unlike the environment variable, the option refuses names it does not know (`known_disable_names`)."""
# Features the two switches also turn off (not rules): the cross-entropy's gradient from its forward
# (lowering.FORWARD_GRAD_KERNEL), D written over the logits (pattern_fusion.OVERWRITE_LOGITS) and attention on
# grouped K/V instead of repeat_interleave's copies (pattern_fusion.GROUPED_KV), SwiGLU's two products and
# silu(h1) * h2 in one launch (pattern_fusion.SWIGLU), its backward in the output projection's dX GEMM
# (pattern_fusion.SWIGLU_GRAD), and the attention backward writing the qkv projection's gradient with the rotary
# embedding's backward (pattern_fusion.QKV_GRAD), two products that meet in an add in one launch
# (pattern_fusion.GEMM_SUM), and RMSNorm's forward and backward on tk's kernels (rms_norm_fusion.RMS_NORM).
# The GEMM size policy (GEMM_SIZE_POLICY below) is one too: turned off, tk claims every GEMM its kernel supports.
GEMM_SIZE_POLICY = "gemm_size_policy"
# So is the FSDP schedule (fsdp_schedule.COLLECTIVE_SCHEDULE): turned off, the fuser's order of collectives stays.
DISABLE_FEATURES = frozenset({"cross_entropy_forward_grad", "cross_entropy_gradient_over_logits", GEMM_SIZE_POLICY,
                              "attention_grouped_kv", "collective_schedule", "gemm_swiglu", "gemm_swiglu_grad",
                              "attention_qkv_grad", "gemm_rope", "gemm_sum", "rms_norm", "cast_merge",
                              "gemm_fp32_out", "view_calls", "direct_regions"})


def _env_names() -> set[str]:
    return {x.strip() for x in os.environ.get(DISABLE_ENV, "").split(",") if x.strip()}


def _option_names() -> set[str]:
    from thunder.core.compile_data import get_compile_option

    option = get_compile_option(DISABLE_OPTION, "rule names or families tk must not claim, features it must not use")
    if option is None:
        return set()
    if isinstance(option, str):
        option = option.split(",")
    if not isinstance(option, (list, tuple, set, frozenset)) or not all(isinstance(x, str) for x in option):
        raise ValueError(f"{DISABLE_OPTION}: expected a string or a list of strings, got {option!r}")
    names = {x.strip() for x in option if x.strip()}
    unknown = names - known_disable_names()
    if unknown:
        raise ValueError(f"{DISABLE_OPTION}: unknown name(s) {sorted(unknown)}; known: "
                         f"{', '.join(sorted(known_disable_names()))}")
    return names


def known_disable_names() -> frozenset[str]:
    """Every name THUNDER_TK_DISABLE and tk_disable act on: rule names, families and DISABLE_FEATURES."""
    return frozenset({r.name for r in RULES} | {r.family for r in RULES}) | DISABLE_FEATURES


def collective_switches() -> set[str]:
    """The THUNDER_TK_DISABLE names that change which collectives run, or in what order: the collective rules and
    family, and the FSDP schedule. Every rank of a group must list the same ones, or the ranks would wait in
    different libraries (or for collectives in different orders)."""
    collective = {r.name for r in RULES if r.family == "collective"} | {"collective", "collective_schedule"}
    return _env_names() & collective


def disabled_names() -> set[str]:
    """What the environment and the compile option being compiled turn off: rule names, families, features."""
    return _env_names() | _option_names()


def disabled_by(rule: "ClaimRule") -> str | None:
    """Which switch turns the rule off (its name or its family listed), or None."""
    for source, names in ((DISABLE_ENV, _env_names()), (f"the {DISABLE_OPTION} compile option", _option_names())):
        if rule.name in names or rule.family in names:
            return source
    return None


def feature_disabled_by(name: str) -> str | None:
    """Which switch lists the feature `name` (DISABLE_FEATURES): DISABLE_ENV or DISABLE_OPTION, or None."""
    for source, names in ((DISABLE_ENV, _env_names()), (DISABLE_OPTION, _option_names())):
        if name in names:
            return source
    return None


class TensorMetadata:
    """A proxy's shape and torch dtype, for the ops module's checks written against tensors (ops.*_unsupported)."""

    def __init__(self, p: TensorProxy):
        self.shape = tuple(p.shape)
        self.dtype = thunder.dtypes.to_torch_dtype(p.dtype)
        self.ndim = len(self.shape)


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.accepted


ACCEPT = Verdict(True)


def decline(reason: str) -> Verdict:
    return Verdict(False, reason)


@dataclass(frozen=True)
class ClaimRule:
    """How tk claims one symbol."""

    symbol_id: Hashable
    name: str  # as a user reads it in a trace, e.g. "ltorch.linear"
    family: str  # "attention", "gemm", "collective", "attention_bwd_delta"
    kernel: str  # the compiled kernel the claim needs
    check: Callable[..., Verdict]  # the symbol's own constraints, on normalized bound-symbol args
    # The compiled kernel tk's gradient of the symbol needs besides `kernel` (None: the gradient is made of
    # `kernel` and ops Thunder runs anyway). In a training trace tk takes the symbol only with its gradient.
    grad_kernel: str | None = None
    # Filled by the executor once the kernel exists: how a claimed symbol is lowered.
    execution_transform: Callable | None = field(default=None, compare=False)
    grad_transform: Callable | None = field(default=None, compare=False)

    def judge(self, *args, **kwargs) -> Verdict:
        switch = disabled_by(self)
        if switch:
            return decline(f"disabled by {switch}")
        reason = _extension.kernels_usable_reason()
        if reason:
            return decline(reason)
        tensors = [a for a in _flatten(args, kwargs) if isinstance(a, TensorProxy)]
        verdict = check_devices(tensors)
        if not verdict:
            return verdict
        verdict = self.check(*args, **kwargs)
        if not verdict:
            return verdict
        if not _extension.kernel_in_build(self.kernel):
            return decline(f"tk has no {self.family} kernel yet ({self.kernel} is not in this build)")
        return ACCEPT

    def judge_gradient(self) -> Verdict:
        """Whether tk can also run the gradient of a symbol whose forward `judge` accepted (metadata only)."""
        if self.grad_transform is None:
            return decline(f"tk has no gradient for {self.name}")
        if self.grad_kernel is not None and not _extension.kernel_in_build(self.grad_kernel):
            return decline(f"tk has no {self.family} backward kernel in this build ({self.grad_kernel})")
        return ACCEPT


def _flatten(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, (tuple, list)):
            yield from a
        else:
            yield a


# ------------------------------------------------------------------------------------------------
# Shared checks


def check_devices(tensors: list[TensorProxy]) -> Verdict:
    if not tensors:
        return decline("no tensor arguments")
    devices = {str(t.device) for t in tensors}
    for t in tensors:
        if type(t).__name__ == "DTensorProxy":
            return decline("DTensor arguments are not supported")
        if t.device.type != "cuda":
            return decline(f"tensor on {t.device.type}")
    if len(devices) > 1:
        return decline(f"tensors on several devices: {', '.join(sorted(devices))}")
    index = tensors[0].device.index
    cap = _extension.device_capability(index)
    if cap is None:
        return decline(f"no CUDA device cuda:{index or 0} is visible")
    if cap != _extension.SUPPORTED_CAPABILITY:
        return decline(f"GPU is sm_{cap[0]}{cap[1]}; tk kernels need sm_90 (Hopper)")
    return ACCEPT


HALF_DTYPES = (thunder.bfloat16, thunder.float16)  # what the GEMM, SwiGLU and summed-product launches take


def _dtype_name(d) -> str:
    return str(d).rsplit(".", 1)[-1]


def check_half_dtypes(*tensors: TensorProxy) -> Verdict:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        return decline("mixed dtypes: " + ", ".join(sorted(_dtype_name(d) for d in dtypes)))
    (dtype,) = dtypes
    if dtype not in HALF_DTYPES:
        return decline(f"dtype {_dtype_name(dtype)} not in {{bfloat16, float16}}")
    return ACCEPT


def _first_failure(*verdicts: Callable[[], Verdict]) -> Verdict:
    for v in verdicts:
        result = v()
        if not result:
            return result
    return ACCEPT


# ------------------------------------------------------------------------------------------------
# Attention

ATTENTION_HEAD_DIMS = ops.ATTENTION_HEAD_DIMS  # what the kernels take


def _dims(dims) -> str:
    return "{" + ", ".join(str(d) for d in dims) + "}"


def check_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None) -> Verdict:
    """What `ops.attention_forward` (and the backward) can compute of ltorch.scaled_dot_product_attention.

    Thunder 0.2.6's symbol has no `enable_gqa`: its math broadcasts heads, so only Hkv == Hq or Hkv == 1 trace
    at all; the kernel reads key/value head h // (Hq // Hkv) for query head h, which is that broadcast (and
    torch's `enable_gqa` grouping for any Hkv dividing Hq).
    """
    if attn_mask is not None and pyval(is_causal):
        return decline("attn_mask is given with is_causal=True")
    if pyval(dropout_p) != 0.0:
        return decline(f"dropout_p={pyval(dropout_p)} > 0")
    if not (query.ndim == key.ndim == value.ndim == 4):
        return decline(f"expects 4-D (B, H, S, D) tensors; got {query.ndim}-D, {key.ndim}-D, {value.ndim}-D")
    verdict = check_half_dtypes(query, key, value)
    if not verdict:
        return verdict
    (B, Hq, Sq, D), (Bk, Hkv, Sk, Dk), (Bv, Hv, Sv, Dv) = query.shape, key.shape, value.shape
    if not (B == Bk == Bv):
        return decline(f"batch sizes differ: {B}, {Bk}, {Bv}")
    if (Hkv, Sk) != (Hv, Sv):
        return decline(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    if not (D == Dk == Dv):
        return decline(f"head dims differ: q {D}, k {Dk}, v {Dv}")
    if D not in ATTENTION_HEAD_DIMS:
        return decline(f"head_dim {D} not in {_dims(ATTENTION_HEAD_DIMS)}")
    if Hkv == 0 or Hq % Hkv:
        return decline(f"query heads {Hq} not a multiple of key/value heads {Hkv}")
    if Sk == 0:
        return decline("key/value length is 0 (every softmax row would be empty)")
    causal = pyval(is_causal)
    if attn_mask is not None:
        # Recognised only where the trace makes the mask from constants (attention_masks); any other mask is declined.
        pattern = attention_masks.pattern_of(attn_mask, Sq, Sk)
        if isinstance(pattern, str):
            return decline(pattern)
        causal = pattern.causal
    if causal and Sq != Sk:
        return decline(f"causal with Sq={Sq} != Sk={Sk}")
    if scale is not None and (reason := ops.attention_scale_unsupported(pyval(scale))):
        return decline(reason)
    return ACCEPT


def sdpa_without_mask(args, kwargs) -> tuple[tuple, dict, str] | None:
    """An SDPA call whose attn_mask is a constant all-keep or causal mask (attention_masks), with the mask replaced
    by is_causal, and how the mask was read; None for any other call. What tk hands an attention executor that
    takes the symbol in its place: with no mask, cuDNN and SDPA run their flash kernels, and SDPA's memory-efficient
    kernel no longer meets a batch-broadcast mask (executor.FALLBACK_SHAPE_LIMITS)."""
    try:
        bound = inspect.signature(check_sdpa).bind(*args, **kwargs)
    except TypeError:
        return None
    given = bound.arguments
    mask, query, key = given.get("attn_mask"), given["query"], given["key"]
    if not isinstance(mask, TensorProxy) or pyval(given.get("is_causal", False)):
        return None
    if not (isinstance(query, TensorProxy) and isinstance(key, TensorProxy) and query.ndim == key.ndim == 4):
        return None
    pattern = attention_masks.pattern_of(mask, query.shape[2], key.shape[2])
    if isinstance(pattern, str) or pattern.window is not None:
        return None
    given["attn_mask"], given["is_causal"] = None, pattern.causal
    return bound.args, bound.kwargs, pattern.describe()


# ------------------------------------------------------------------------------------------------
# GEMMs


def _check_gemm_operands(a, b, k: int) -> Verdict:
    verdict = check_half_dtypes(a, b)
    if not verdict:
        return verdict
    if k % 8:
        return decline(f"K={k} not a multiple of 8")
    return ACCEPT


# Where tk's GEMM is well behind cuBLAS it leaves the product to cuBLAS (H100, 2026-11-24, benchmarks/NOTES.md, "GEMMs
# of few tokens"; `gemm.py --tokens ... --graphs`):
# - at most SKINNY_MAX_M rows (decoding, small batches) the skinny kernel streams the weight over every SM: on
#   lm_head-sized weights (N >= GEMM_SKINNY_MIN_N) 1.06-1.08x cuBLAS, on 4096- to 14336-wide ones 0.73-0.98x (its
#   fixed costs weigh on 20-60 us products);
# - more rows, but fewer output tiles than half the SMs: the persistent grid of 128-row tiles leaves SMs idle
#   (256 tokens against 4096-wide weights: 0.61-0.93x; at 66-128 tiles it runs 0.90-0.98x, its usual level);
# - K below GEMM_MIN_K: a tile's products are short and its epilogue costs as much (dW of 256 tokens: 0.75-0.85x).
GEMM_MIN_K = 512
GEMM_SKINNY_MIN_N = 65536
_GEMM_BM = 128
gemm_size_policy_default = True  # the policy where neither switch names it (the test suite's small GEMMs: off)


def gemm_output_tiles(m: int, n: int, sms: int) -> int:
    """Output tiles of tk's persistent GEMM for an m x n product: 128 x 256, or 128 x 128 where the kernel takes
    narrow tiles (its tile_n_of: 256-wide tiles fill under 80% of the grid's last wave, 128-wide ones 10 points more)."""
    rows = -(-m // _GEMM_BM)
    if rows == 0 or n == 0:
        return 0

    def tiles(width):
        return rows * -(-n // width)

    def fill(width):
        return tiles(width) / (-(-tiles(width) // sms) * sms)

    wide, narrow = fill(256), fill(128)
    return tiles(128) if wide < 0.8 and narrow > wide + 0.1 else tiles(256)


def check_gemm_size(m: int, n: int, k: int, device_index: int | None) -> Verdict:
    """Decline dimensions past the kernels' largest (always), then, under the size policy, products where tk's GEMM
    is measured well behind cuBLAS (see above)."""
    if reason := ops.gemm_dims_unsupported(M=m, N=n, K=k):
        return decline(reason)
    if not gemm_size_policy_default or GEMM_SIZE_POLICY in disabled_names():
        return ACCEPT
    off = f"(turn the size policy off with {DISABLE_ENV} or {DISABLE_OPTION}={GEMM_SIZE_POLICY!r})"
    if m <= ops.SKINNY_MAX_M:
        if n < GEMM_SKINNY_MIN_N:
            return decline(f"{m} x {n} output: at most {ops.SKINNY_MAX_M} rows against fewer than "
                           f"{GEMM_SKINNY_MIN_N} columns, cuBLAS is faster {off}")
    else:
        sms = _extension.multiprocessor_count(device_index)
        tiles = gemm_output_tiles(m, n, sms)
        if 2 * tiles < sms:
            return decline(f"{m} x {n} output: {tiles} tiles for {sms} SMs; cuBLAS is faster at this size {off}")
    if k < GEMM_MIN_K:
        return decline(f"K={k} < {GEMM_MIN_K}: cuBLAS is faster at this depth {off}")
    return ACCEPT


def check_linear(a, w, bias=None) -> Verdict:
    if w.ndim != 2:
        return decline(f"weight is {w.ndim}-D, expected 2-D")
    if a.ndim < 1:
        return decline("input is 0-D")
    verdict = _check_gemm_operands(a, w, a.shape[-1])
    if not verdict:
        return verdict
    if bias is not None and (bias.dtype != w.dtype or bias.ndim != 1):
        return decline(f"bias must be a 1-D {_dtype_name(w.dtype)} tensor; got {bias.ndim}-D {_dtype_name(bias.dtype)}")
    return check_gemm_size(math.prod(a.shape[:-1]), w.shape[0], a.shape[-1], a.device.index)


def check_matmul(a, b) -> Verdict:
    if a.ndim != 2 or b.ndim != 2:
        return decline(f"only 2-D @ 2-D is claimed; got {a.ndim}-D @ {b.ndim}-D")
    verdict = _check_gemm_operands(a, b, a.shape[1])
    if not verdict:
        return verdict
    return check_gemm_size(a.shape[0], b.shape[1], a.shape[1], a.device.index)


# ------------------------------------------------------------------------------------------------
# Cross-entropy (the loss of a language model: its logits are the largest activation of the step)

_LOSS_DTYPES = (thunder.bfloat16, thunder.float16, thunder.float32)


def check_cross_entropy(a, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0) -> Verdict:
    """What `ops.cross_entropy_forward` / `_backward` compute of ltorch.cross_entropy: 2-D logits and class-index
    targets, no class weights or label smoothing, reduction mean, sum or none."""
    if weight is not None:
        return decline("class weights are given")
    if size_average is not None or reduce is not None:
        return decline("deprecated size_average/reduce arguments")
    if pyval(label_smoothing) != 0.0:
        return decline(f"label_smoothing={pyval(label_smoothing)} (only 0 is supported)")
    if pyval(reduction) not in ops.CROSS_ENTROPY_REDUCTIONS:
        return decline(f"reduction={pyval(reduction)!r} not in {{mean, sum, none}}")
    if a.ndim != 2:
        return decline(f"logits are {a.ndim}-D; only (rows, classes) is claimed")
    if target.ndim != 1 or target.shape[0] != a.shape[0]:
        return decline(f"target of shape {tuple(target.shape)} is not one class index per row (probability "
                       "targets are not supported)")
    if a.dtype not in _LOSS_DTYPES:
        return decline(f"dtype {_dtype_name(a.dtype)} not in {{bfloat16, float16, float32}}")
    if target.dtype != thunder.int64:
        return decline(f"target dtype {_dtype_name(target.dtype)} is not int64")
    if a.shape[0] == 0 or a.shape[1] == 0:
        return decline(f"empty logits {tuple(a.shape)}")
    if a.shape[0] >= 2**31:
        return decline(f"{a.shape[0]} rows (at most 2^31 - 1)")
    return ACCEPT


# ------------------------------------------------------------------------------------------------
# Collectives

_COLLECTIVE_DTYPES = (thunder.bfloat16, thunder.float16, thunder.float32)


def _check_collective(a, group, dim) -> Verdict:
    from thunder_tk.collectives import group_support_reason

    if a.dtype not in _COLLECTIVE_DTYPES:
        return decline(f"dtype {_dtype_name(a.dtype)} not in {{bfloat16, float16, float32}}")
    if dim not in (None, 0):
        return decline(f"dim={dim}; only dim 0 is supported")
    if a.ndim == 0:
        return decline("0-d tensor (collectives run along dim 0)")
    reason = group_support_reason(group, planning=_extension.planning())
    return decline(reason) if reason else ACCEPT


def check_all_gather(a, group, do_async, dim=None) -> Verdict:
    return _check_collective(a, group, dim)


def check_reduce_scatter(a, op, group, do_async, dim=None) -> Verdict:
    if getattr(op, "name", str(op)) not in ("SUM", "AVG"):
        return decline(f"reduce op {getattr(op, 'name', op)} not in {{SUM, AVG}}")
    return _check_collective(a, group, dim)


# ------------------------------------------------------------------------------------------------
# thunder_tk's own symbols


def check_attention_bwd_delta(o, grad_o) -> Verdict:
    if o.ndim != 4:
        return decline(f"expects (B, H, S, D) tensors; got {o.ndim}-D")
    if tuple(o.shape) != tuple(grad_o.shape):
        return decline(f"shapes differ: {tuple(o.shape)} vs {tuple(grad_o.shape)}")
    if o.dtype != grad_o.dtype:
        return decline(f"mixed dtypes: {_dtype_name(o.dtype)}, {_dtype_name(grad_o.dtype)}")
    if o.dtype not in _COLLECTIVE_DTYPES:
        return decline(f"dtype {_dtype_name(o.dtype)} not in {{bfloat16, float16, float32}}")
    return ACCEPT


def check_embedding_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq, sparse) -> Verdict:
    """What ops.embedding_backward computes of the embedding's gradient: dense, unscaled."""
    reason = ops.embedding_backward_unsupported(TensorMetadata(grad), TensorMetadata(indices), int(pyval(num_weights)),
                                                int(pyval(padding_idx)), bool(pyval(scale_grad_by_freq)),
                                                bool(pyval(sparse)))
    return decline(reason) if reason else ACCEPT


# ------------------------------------------------------------------------------------------------
# The table

RULES: tuple[ClaimRule, ...] = (
    ClaimRule(ltorch.scaled_dot_product_attention.id, "ltorch.scaled_dot_product_attention", "attention",
              "attention_forward", check_sdpa, grad_kernel="attention_backward"),
    ClaimRule(ltorch.linear.id, "ltorch.linear", "gemm", "gemm", check_linear),
    ClaimRule(prims.PrimIDs.LINEAR, "prims.linear", "gemm", "gemm", check_linear),
    ClaimRule(ltorch.matmul.id, "ltorch.matmul", "gemm", "gemm", check_matmul),
    ClaimRule(ltorch.cross_entropy.id, "ltorch.cross_entropy", "loss", "cross_entropy_forward", check_cross_entropy,
              grad_kernel="cross_entropy_backward"),
    ClaimRule(prims.PrimIDs.MATMUL, "prims.matmul", "gemm", "gemm", check_matmul),
    ClaimRule(dist_prims.PrimIDs.ALL_GATHER, "all_gather", "collective", "all_gather", check_all_gather),
    ClaimRule(dist_prims.PrimIDs.REDUCE_SCATTER, "reduce_scatter", "collective", "reduce_scatter",
              check_reduce_scatter),
    ClaimRule(attention_bwd_delta_symbol.id, "thunder_tk.attention_bwd_delta", "attention_bwd_delta",
              "attention_bwd_delta", check_attention_bwd_delta),
    ClaimRule(ltorch.embedding_backward.id, "ltorch.embedding_backward", "embedding", "embedding_backward",
              check_embedding_backward),
)

RULES_BY_ID: dict[Hashable, ClaimRule] = {r.symbol_id: r for r in RULES}
