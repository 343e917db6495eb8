"""Python entry points of the kernels: argument checks, output allocation and the launch.

Each op validates what the kernel assumes and raises an error naming the problem, so a bad call never
reaches the GPU. Launches go on the current stream of the inputs' device and never synchronise.
"""

from __future__ import annotations

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
