"""Python entry points of the kernels: argument checks, output allocation and the launch.

Each op validates what the kernel assumes and raises an error naming the problem, so a bad call never
reaches the GPU. Launches go on the current stream of the inputs' device and never synchronise (except once per
device, when the dynamic GEMM schedule's counters are first made).
"""

from __future__ import annotations

import os

import torch

from thunder_tk import _extension

_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class KernelUnavailableError(RuntimeError):
    """Raised when a kernel is called where it cannot run (no build, no sm_90 GPU)."""


def _require_kernels(device: torch.device) -> object:
    ext = _extension.extension()
    if ext is None:
        raise KernelUnavailableError(_extension.unavailable_reason())
    cap = _extension.device_capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap != _extension.SUPPORTED_CAPABILITY:
        raise KernelUnavailableError(f"thunder_tk kernels need an sm_90 GPU; {device} is sm_{cap[0]}{cap[1]}" if cap else f"no GPU {device}")
    return ext


def _stream_handle(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# ------------------------------------------------------------------------------------------------
# Attention backward pre-pass: delta = rowsum(dO * O)


def attention_bwd_delta_reference(o: torch.Tensor, grad_o: torch.Tensor) -> torch.Tensor:
    """fp32 reference: sum over the last dim of grad_o * o."""
    return (grad_o.float() * o.float()).sum(-1)


def check_attention_bwd_delta_args(o: torch.Tensor, grad_o: torch.Tensor) -> None:
    if not isinstance(o, torch.Tensor) or not isinstance(grad_o, torch.Tensor):
        raise TypeError("attention_bwd_delta expects two tensors (o, grad_o)")
    if o.ndim != 4:
        raise ValueError(f"attention_bwd_delta expects (B, H, S, D) tensors; o has {o.ndim} dims")
    if o.shape != grad_o.shape:
        raise ValueError(f"o and grad_o must have the same shape; got {tuple(o.shape)} and {tuple(grad_o.shape)}")
    if o.dtype != grad_o.dtype:
        raise ValueError(f"o and grad_o must have the same dtype; got {o.dtype} and {grad_o.dtype}")
    if o.dtype not in _DTYPE_CODES:
        raise ValueError(f"attention_bwd_delta supports bfloat16, float16 and float32, not {o.dtype}")
    if o.device != grad_o.device:
        raise ValueError(f"o and grad_o must be on one device; got {o.device} and {grad_o.device}")
    if o.device.type != "cuda":
        raise ValueError(f"attention_bwd_delta runs on CUDA tensors; got a tensor on {o.device}")


def attention_bwd_delta(
    o: torch.Tensor, grad_o: torch.Tensor, *, out: torch.Tensor | None = None, _tuning: tuple[int, bool] = (0, True)
) -> torch.Tensor:
    """delta[b, h, s] = sum_d grad_o[b, h, s, d] * o[b, h, s, d], in fp32, by the tk kernel.

    Any strides are accepted; rows whose last dim is not contiguous are copied first. `out`, if given, is
    a float32 (B, H, S) tensor (any strides) that receives the result.
    """
    check_attention_bwd_delta_args(o, grad_o)
    ext = _require_kernels(o.device)
    B, H, S, D = o.shape
    if D > 1 and o.stride(-1) != 1:
        o = o.contiguous()
    if D > 1 and grad_o.stride(-1) != 1:
        grad_o = grad_o.contiguous()
    if out is None:
        delta = torch.empty((B, H, S), dtype=torch.float32, device=o.device)
    else:
        if out.dtype != torch.float32 or tuple(out.shape) != (B, H, S) or out.device != o.device:
            raise ValueError(
                f"out must be a float32 tensor of shape {(B, H, S)} on {o.device}; "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        delta = out
    with torch.cuda.device(o.device):
        ext.attention_bwd_delta(
            o.data_ptr(), grad_o.data_ptr(), delta.data_ptr(), _DTYPE_CODES[o.dtype], B, H, S, D,
            list(o.stride()[:3]), list(grad_o.stride()[:3]), list(delta.stride()), _stream_handle(o.device),
            *_tuning,
        )
    return delta


# ------------------------------------------------------------------------------------------------
# GEMM: C = A B (+ bias)

_GEMM_DTYPES = (torch.bfloat16, torch.float16)


def _gemm_layout(t: torch.Tensor, k_dim: int) -> tuple[int, int] | None:
    """(stride along the other dim, stride along K) when the kernel can read `t` in place, else None.

    In place means: 16-byte aligned, a unit stride along K (K-major) or along the other dim (MN-major), and the
    remaining (leading) stride a multiple of 8 elements, as TMA needs."""
    other = 1 - k_dim
    n_other = t.shape[other]
    s_other, s_k = t.stride(other), t.stride(k_dim)
    if t.data_ptr() % 16:
        return None
    if s_k == 1:
        lead = s_other if n_other > 1 else 8  # a single line has no leading stride
        return (lead, 1) if lead % 8 == 0 else None
    if s_other == 1 or n_other == 1:
        return (1, s_k) if s_k % 8 == 0 else None
    return None


def check_gemm_args(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"gemm expects 2-D operands; got {a.ndim}-D and {b.ndim}-D")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm shapes do not match: ({a.shape[0]}, {a.shape[1]}) @ ({b.shape[0]}, {b.shape[1]})")
    if a.dtype != b.dtype or a.dtype not in _GEMM_DTYPES:
        raise ValueError(f"gemm supports bfloat16 or float16 operands of one dtype; got {a.dtype} and {b.dtype}")
    if a.device != b.device or a.device.type != "cuda":
        raise ValueError(f"gemm runs on CUDA tensors on one device; got {a.device} and {b.device}")
    if a.shape[1] % 8:
        raise ValueError(f"gemm needs K a multiple of 8; K={a.shape[1]}")
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != b.shape[1] or bias.dtype != a.dtype
                             or bias.device != a.device):
        raise ValueError(f"bias must be a 1-D {a.dtype} tensor of {b.shape[1]} elements on {a.device}")


# Tile schedule of the GEMM: "static" (block i takes tiles i, i + grid, ...) or "dynamic" (blocks take tiles from
# a counter as they get to them: blocks that start late, on SMs another kernel held, take fewer).
GEMM_SCHEDULE_ENV = "THUNDER_TK_GEMM_SCHEDULE"
# Dynamic-schedule counters: per device a ring of zeroed int32 counters 128 bytes apart, one per launch (a launch
# re-zeroes its own). A counter comes round again after _TICKET_RING launches, far beyond any queue's depth.
_TICKET_RING = 4096
_ticket_rings: dict[int, torch.Tensor] = {}
_ticket_next: dict[int, int] = {}


def _gemm_tickets(device: torch.device, schedule: str | None) -> int:
    """The counter address for one launch, or 0 for the static schedule."""
    schedule = schedule or os.environ.get(GEMM_SCHEDULE_ENV, "static")
    if schedule not in ("static", "dynamic"):
        raise ValueError(f"gemm schedule must be 'static' or 'dynamic' (from {GEMM_SCHEDULE_ENV}); got {schedule!r}")
    # Under CUDA-graph capture a launch would keep its counter for every replay, however far apart: static.
    if schedule == "static" or torch.cuda.is_current_stream_capturing():
        return 0
    ring = _ticket_rings.get(device.index)
    if ring is None:
        ring = torch.zeros(_TICKET_RING * 32, dtype=torch.int32, device=device)
        torch.cuda.current_stream(device).synchronize()  # once per device: launches on any stream see zeros
        _ticket_rings[device.index] = ring
    i = _ticket_next.get(device.index, 0)
    _ticket_next[device.index] = (i + 1) % _TICKET_RING
    return ring.data_ptr() + 128 * i


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
         out: torch.Tensor | None = None, _group_rows: int = 0, _cluster: int = 0,
         _schedule: str | None = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) (+ bias (N,)) by the tk kernel, bf16/fp16 with fp32 accumulation.

    Operands are read in place when one of their strides is 1 (either major) and the other a multiple of 8;
    others are copied first. `out`, if given, is an (M, N) tensor with unit column stride.
    """
    check_gemm_args(a, b, bias)
    ext = _require_kernels(a.device)
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    elif out.shape != (M, N) or out.dtype != a.dtype or out.device != a.device or (N > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be a {a.dtype} ({M}, {N}) tensor on {a.device} with unit column stride")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros((), dtype=a.dtype, device=a.device))
    a_layout = _gemm_layout(a, 1)
    if a_layout is None:  # copy to fresh (aligned) row-major storage: K-major, leading stride K
        a = a.clone(memory_format=torch.contiguous_format)
        a_layout = (K, 1)
    b_layout = _gemm_layout(b, 0)
    if b_layout is None:  # copy to fresh K-major (N, K) storage, leading stride K
        b = b.t().clone(memory_format=torch.contiguous_format).t()
        b_layout = (K, 1)
    if bias is not None:
        bias = bias.contiguous()
    (a_sm, a_sk), (b_sn, b_sk) = a_layout, b_layout
    with torch.cuda.device(a.device):
        ext.gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), 0 if bias is None else bias.data_ptr(),
                 _DTYPE_CODES[a.dtype], M, N, K, a_sm, a_sk, b_sk, b_sn, out.stride(0) if M > 1 else N,
                 _stream_handle(a.device), _group_rows, _cluster, _gemm_tickets(a.device, _schedule))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T (+ bias): `torch.nn.functional.linear` on the tk GEMM."""
    if weight.ndim != 2:
        raise ValueError(f"linear expects a 2-D weight; got {weight.ndim}-D")
    lead = x.shape[:-1]
    y = gemm(x.reshape(-1, x.shape[-1]), weight.t(), bias)
    return y.reshape(*lead, weight.shape[0])
