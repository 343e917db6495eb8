"""Python entry points of the kernels: argument checks, output allocation and the launch.

Each op validates what the kernel assumes and raises an error naming the problem, so a bad call never
reaches the GPU. Launches go on the current stream of the inputs' device and never synchronise (except once per
device, when the dynamic GEMM schedule's counters are first made).
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import struct

import torch

from thunder_tk import _extension, env_settings

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


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch._C._cuda_getDevice()


def _stream_handle(device: torch.device) -> int:
    # The raw cudaStream_t of the device's current stream, without building a torch.cuda.Stream: each tk call in
    # a training step pays this, and a step whose host work outruns its GPU work runs at the host's pace.
    return torch._C._cuda_getCurrentRawStream(_device_index(device))


def _on(device: torch.device):
    """The device guard for a launch: none where the device is current already (the usual case), which skips
    torch.cuda.device's two device switches per call."""
    index = _device_index(device)
    return contextlib.nullcontext() if index == torch._C._cuda_getDevice() else torch.cuda.device(index)


def dependent_launch() -> bool:
    """Whether tk's kernels launch programmatically dependent on the kernel before them in the stream: scheduled
    while it finishes, set up on the SMs it has left, and waiting for it before their first memory access (the
    default; THUNDER_TK_DEPENDENT_LAUNCH=0 turns it off). False where no kernels are built."""
    ext = _extension.extension()
    return bool(ext is not None and ext.dependent_launch())


def set_dependent_launch(enabled: bool) -> bool:
    """Turns programmatic dependent launch on or off for every later tk launch in this process; returns the
    previous setting. Results are the same either way; only the gaps between kernels change."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_dependent_launch: expected a bool, got {type(enabled).__name__}")
    ext = _extension.extension()
    if ext is None:
        raise KernelUnavailableError(_extension.unavailable_reason())
    previous = bool(ext.dependent_launch())
    ext.set_dependent_launch(enabled)
    return previous


@contextlib.contextmanager
def dependent_launches(enabled: bool):
    """set_dependent_launch(enabled) for the block, the previous setting restored after it."""
    previous = set_dependent_launch(enabled)
    try:
        yield
    finally:
        set_dependent_launch(previous)


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
    o: torch.Tensor, grad_o: torch.Tensor, *, out: torch.Tensor | None = None, zero: torch.Tensor | None = None,
    _tuning: tuple[int, bool] | None = None
) -> torch.Tensor:
    """delta[b, h, s] = sum_d grad_o[b, h, s, d] * o[b, h, s, d], in fp32, by the tk kernel.

    Any strides are accepted; rows whose last dim is not contiguous are copied first. `out`, if given, is
    a float32 (B, H, S) tensor (any strides) that receives the result. `zero`, if given, is a contiguous float32
    (B, H, S, D) tensor (D a multiple of 4) that the same pass sets to zero: the backward's dQ accumulator, cleared
    beside the reads instead of by a fill of its own. `_tuning` (rows per lane group, a grid of resident blocks) is
    for sweeps; by default THUNDER_TK_ATTN_DELTA_ROWS, whose "auto" (rows 0) leaves the rows and grid to the launcher.
    """
    check_attention_bwd_delta_args(o, grad_o)
    if _tuning is None:
        rows = env_settings.ATTN_DELTA_ROWS.read()
        _tuning = (0 if rows == "auto" else int(rows), False)
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
    if zero is not None and (not isinstance(zero, torch.Tensor) or zero.dtype != torch.float32
                             or tuple(zero.shape) != (B, H, S, D) or not zero.is_contiguous()
                             or zero.device != o.device):
        raise ValueError(f"zero must be a contiguous float32 tensor of shape {(B, H, S, D)} on {o.device}")
    with _on(o.device):
        ext.attention_bwd_delta(
            o.data_ptr(), grad_o.data_ptr(), delta.data_ptr(), _DTYPE_CODES[o.dtype], B, H, S, D,
            list(o.stride()[:3]), list(grad_o.stride()[:3]), list(delta.stride()), _stream_handle(o.device),
            *_tuning, zero.data_ptr() if zero is not None and zero.numel() else 0,
        )
    return delta


# ------------------------------------------------------------------------------------------------
# Attention forward: O = softmax(scale Q K^T (causal)) V and the log-sum-exp of each query row

ATTENTION_HEAD_DIMS = (64, 128, 256)
_ATTENTION_DTYPES = (torch.bfloat16, torch.float16)


def check_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                         scale: float | None = None, window: int | None = None) -> None:
    """Raises an error naming the first problem with the arguments of attention_forward."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise TypeError("attention expects three tensors (q, k, v)")
    if not (q.ndim == k.ndim == v.ndim == 4):
        raise ValueError(f"attention expects 4-D (B, H, S, D) tensors; got {q.ndim}-D, {k.ndim}-D, {v.ndim}-D")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _ATTENTION_DTYPES:
        raise ValueError(f"attention supports bfloat16 and float16, not {q.dtype}")
    if not (q.device == k.device == v.device) or q.device.type != "cuda":
        raise ValueError(f"q, k and v must be CUDA tensors on one device; got {q.device}, {k.device}, {v.device}")
    (B, Hq, Sq, D), (Bk, Hkv, Sk, Dk) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if B != Bk:
        raise ValueError(f"batch sizes differ: q {B}, k/v {Bk}")
    if D != Dk:
        raise ValueError(f"head dims differ: q {D}, k/v {Dk}")
    if D not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported (64, 128 or 256)")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if Sk == 0 and Sq > 0:
        raise ValueError("key/value length is 0: every query row would be empty")
    if is_causal and Sq != Sk:
        raise ValueError(f"causal attention needs equal query and key lengths; got {Sq} and {Sk}")
    if scale is not None and (reason := attention_scale_unsupported(scale)):
        raise ValueError(reason)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise ValueError(f"window must be None or an int (keys per query row), not {window!r}")
        if window < 1:
            raise ValueError(f"window must be at least 1 (a row keeps its own key), not {window}; None: no window")
        if not is_causal:
            raise ValueError(f"a sliding window (window={window}) needs is_causal=True")


def _kernel_window(window: int | None, Sk: int) -> int:
    """The kernels' window argument for a checked `window`: 0 (none) where it is None or keeps every causal key
    (window >= Sk)."""
    return 0 if window is None or window >= Sk else int(window)


def _window_mask(Sq: int, Sk: int, window: int | None, device) -> torch.Tensor:
    """The causal mask (True: dropped) of query i against key j: j > i, and with a window also j <= i - window."""
    ones = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    mask = ones.triu(1)
    if window is not None:
        mask |= ones.tril(-int(window))
    return mask


def attention_scale_unsupported(scale: float) -> str | None:
    """Why the kernels cannot take `scale`, or None. They take |scale| and |scale| log2(e) as float32: a magnitude that
    float32 rounds to 0 (other than 0 itself, which _kernel_scale handles) or whose base-2 factor overflows it would
    reach them as a scale they refuse or as an infinite one."""
    scale = float(scale)
    if not math.isfinite(scale):
        return f"scale={scale} is not finite"
    if scale != 0 and not (_as_float32(abs(scale)) > 0 and math.isfinite(_as_float32(abs(scale) * math.log2(math.e)))):
        return f"scale={scale} is outside float32's range (the kernels compute in float32)"
    return None


def _as_float32(x: float) -> float:
    """x rounded to float32 (inf past its range), in plain Python: the check runs on every attention call."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _kernel_scale(q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, float, float]:
    """(q, scale, sign) as the kernels take them: they want scale > 0 (row maxima of raw scores), so a negative
    scale is folded into q ((-q) k^T |scale| is the same scores; dq flips sign), and 0 (uniform weights) becomes
    1e-30 (scores times it round to 0 in the exponent, lse to log(Sk))."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if scale < 0:
        return -q, -scale, -1.0
    return q, (scale if scale > 0 else 1e-30), 1.0


def _tma_reads_in_place(t: torch.Tensor) -> bool:
    """Whether TMA can read t where it is: unit last stride, every other stride (of a dimension longer than 1) a
    positive multiple of 16 bytes, and a 16-byte aligned base."""
    strides_ok = all(size == 1 or (stride > 0 and stride * t.element_size() % 16 == 0)
                     for size, stride in zip(t.shape[:-1], t.stride()[:-1]))
    return t.stride(-1) == 1 and strides_ok and t.data_ptr() % 16 == 0


def _tma_readable(t: torch.Tensor) -> torch.Tensor:
    """t itself when TMA can read it in place, else a contiguous copy in fresh (aligned) storage: not
    t.contiguous(), which is t itself where t is contiguous but starts off a 16-byte boundary."""
    return t if _tma_reads_in_place(t) else t.clone(memory_format=torch.contiguous_format)


def _row_vectors(shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """An empty float32 (B, H, S) tensor whose rows start at 16-byte aligned addresses (S padded to a multiple of 4
    in memory): what the attention backward's TMA loads of lse and delta rows need."""
    B, H, S = shape
    return torch.empty((B, H, (S + 3) // 4 * 4), dtype=torch.float32, device=device)[..., :S]


def _rows_tma_readable(t: torch.Tensor) -> torch.Tensor:
    """t itself when TMA can read its (B, H, S) float32 rows in place, else a copy in a _row_vectors buffer."""
    if _tma_reads_in_place(t):
        return t
    out = _row_vectors(tuple(t.shape), t.device)
    out.copy_(t)
    return out


def attention_forward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                                scale: float | None = None,
                                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 math: (o, lse) as attention_forward defines them (o in float64 here); `window` (with is_causal):
    query i keeps keys i - window < j <= i."""
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = k.double().repeat_interleave(Hq // Hkv, dim=1)
    v = v.double().repeat_interleave(Hq // Hkv, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    if is_causal:
        Sq, Sk = s.shape[-2:]
        s = s.masked_fill(_window_mask(Sq, Sk, window, s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                      scale: float | None = None, window: int | None = None, _max_blocks: int = 0,
                      _schedule: str = "dynamic", _tail_split: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """o = softmax(scale q k^T, causal mask) v and lse = logsumexp of the scaled scores, by the tk kernel.

    q is (B, Hq, Sq, D), k and v (B, Hkv, Sk, D) with Hkv dividing Hq (query head h reads key/value head
    h // (Hq // Hkv)); bf16 or fp16; D 64, 128 or 256; scale defaults to 1/sqrt(D); causal masks key j > query i and
    needs Sq == Sk. window (causal only; LitGPT's, Mistral's sliding window): query i keeps keys i - window < j <= i,
    its own and window - 1 before it; None, or window >= Sk, is plain causal. Inputs are read in place when the
    last dim is contiguous and the other strides are multiples of 8 elements (LitGPT's transposed views qualify);
    others are copied first. Returns o (B, Hq, Sq, D) in the
    input dtype, a transposed view of a contiguous (B, Sq, Hq, D) buffer, and lse (B, Hq, Sq) in float32 (natural
    log), which the backward pass consumes.
    _max_blocks (tests only) caps the persistent grid, so that small shapes walk several tiles per block;
    _schedule "dynamic" (blocks take the next tile from a counter; causal tiles heaviest first within chunks of
    heads that fit L2) or "static" (block i takes tiles i, i + grid, ...; what CUDA-graph capture gets).
    With the dynamic schedule and no causal mask, where the last wave of tiles would leave most multiprocessors
    idle, its tiles are walked in key ranges by several blocks and merged (fp32 scratch of up to a wave of tiles);
    _tail_split=False (tests) walks them whole.
    """
    check_attention_args(q, k, v, is_causal, scale, window)
    ext = _require_kernels(q.device)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    # o is laid out (B, Sq, Hq, D) in memory, as torch's flash and cuDNN backends return it: the usual next step,
    # o.transpose(1, 2).reshape(B, Sq, Hq * D) for the output projection, is then a view. A (B, Hq, Sq, D) o made
    # that a copy, which the projection's weight gradient kept alive until the backward (one (B, Sq, Hq * D)
    # activation per layer more than Thunder's default executors at the step's memory peak).
    o = torch.empty((B, Sq, Hq, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = _row_vectors((B, Hq, Sq), q.device)  # rows 16-byte aligned, as the backward's TMA reads them
    if o.numel() == 0:
        return o, lse
    q, scale, _ = _kernel_scale(q, scale)
    q, k, v = _tma_readable(q), _tma_readable(k), _tma_readable(v)
    tickets = _launch_tickets(q.device, _schedule, "attention")
    with _on(q.device):
        floats, counts = (ext.attention_forward_split_plan(B, Hq, Sq, Sk, D, bool(is_causal), int(_max_blocks),
                                                           bool(tickets)) if _tail_split else (0, 0))
        scratch = torch.empty(floats, dtype=torch.float32, device=q.device) if floats else None
        if counts > _SPLIT_COUNT_SLOT:
            raise AssertionError(f"attention forward: {counts} split counters, more than a slot's {_SPLIT_COUNT_SLOT}")
        count_slot = _zeroed_slot(q.device, "attention_split", _SPLIT_COUNT_SLOT, 64) if counts else 0
        ext.attention_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                              _DTYPE_CODES[q.dtype], B, Hq, Hkv, Sq, Sk, D, list(q.stride()[:3]),
                              list(k.stride()[:3]), list(v.stride()[:3]), list(o.stride()[:3]),
                              list(lse.stride()[:2]), scale, bool(is_causal), _stream_handle(q.device),
                              int(_max_blocks), tickets, scratch.data_ptr() if floats else 0, floats, count_slot,
                              counts, _kernel_window(window, Sk))
    return o, lse


def attention_backward_reference(q, k, v, o, lse, grad_o, *, is_causal=False, scale=None, window=None):
    """float64 autograd through attention_forward_reference: (dq, dk, dv) in float64 (o and lse unused)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_forward_reference(q64, k64, v64, is_causal=is_causal, scale=scale, window=window)
    return torch.autograd.grad(out, (q64, k64, v64), grad_o.double())


# The backward kernel's block: 128 keys (64 at D = 256), walking 64-query steps over the query heads of its key/value
# head (or of a part of them: group_split).
_BWD_KEYS, _BWD_QUERIES = 128, 64


def _bwd_keys(D: int) -> int:
    return 64 if D == 256 else _BWD_KEYS


# A unit's cost beyond its steps, in steps (kernel time against steps, 2026-11-24). Not its start and end: a persistent
# grid that loads the next unit under the last one's epilogue measured the same (benchmarks/NOTES.md, session 15).
_BWD_BLOCK_OVERHEAD_STEPS = 2.2
_BWD_STEP_FLOP_RATE = 3.0e12  # one SM's rate in a step (about 400 TFLOP/s over 132), to price the parts' sum in steps
# Summing the parts of dK and dV (torch's reduction: 9.5 us per 8.4 MB read on the H100, 2026-11-24) and its two
# launches, which a small backward does not hide. A split must win by a margin to be taken.
_PART_SUM_SECONDS_PER_BYTE = 1.2e-12
_PART_SUM_LAUNCH_SECONDS = 1e-5
_SPLIT_MARGIN = 0.9


def _bwd_makespan(blocks_per_tile: int, kv_tiles: int, q_tiles: int, heads: int, causal: bool, sms: int,
                  tile_steps: int = 2, window: int = 0) -> float:
    """The backward grid's time in steps on `sms` multiprocessors, each block walking `heads` query heads: causal
    key tiles t take q_tiles - tile_steps t steps a head (tile_steps: query tiles per key tile, 2 for 128 keys) and
    start heaviest first (the longest block or the mean load, whichever is more); full ones are alike and run in
    whole waves. With a sliding window (the kernel's: 0 none) a key tile's steps stop at the tile of its last key's
    last query (as the kernel's walk does), so the tiles are nearly alike."""
    blocks = blocks_per_tile * kv_tiles
    if not causal:
        return -(-blocks // sms) * (heads * q_tiles + _BWD_BLOCK_OVERHEAD_STEPS)
    if window:
        keys = tile_steps * _BWD_QUERIES
        tile_steps_of = [min(q_tiles, (keys * (t + 1) - 2 + window) // _BWD_QUERIES + 1) - tile_steps * t
                         for t in range(kv_tiles)]
        total = blocks_per_tile * (heads * sum(tile_steps_of) + kv_tiles * _BWD_BLOCK_OVERHEAD_STEPS)
        return max(heads * max(tile_steps_of) + _BWD_BLOCK_OVERHEAD_STEPS, total / sms)
    steps = kv_tiles * q_tiles - tile_steps * kv_tiles * (kv_tiles - 1) // 2  # sum over t of q_tiles - tile_steps t
    total = blocks_per_tile * (heads * steps + kv_tiles * _BWD_BLOCK_OVERHEAD_STEPS)
    return max(heads * q_tiles + _BWD_BLOCK_OVERHEAD_STEPS, total / sms)


# The backward's last wave (not causal): where the units (128 keys of a head, or of a part of a group) leave the last
# wave mostly empty, its units are walked in query ranges by several blocks, and the last part of each sums the parts'
# fp32 dK, dV. A part pays a unit's overhead and the merge (its dK, dV written, the last part reading them all).
# Parts that fit one round on the GPU: 2-4 of them (D = 64, 4 units in quarters: 1.008-1.021x). Parts in several
# rounds pay more, since the whole units' last wave ends ragged and each round starts on multiprocessors at different
# times: _BWD_RAGGED_STEPS a part more fits what they measured at D = 128 with 68 units left (H100, in one process:
# S = 2048, 32-step units, 0.98-1.00x; 4096, 0.99-1.02x; 8192, 1.00-1.02x; 16384, 1.01-1.03x; benchmarks/NOTES.md).
# So several rounds are taken only for units of _BWD_ROUNDS_MIN_STEPS steps or more, in 3-8 parts.
_BWD_MERGE_STEPS = 1.5
_BWD_MIN_PART_STEPS = 4
_BWD_RAGGED_STEPS = 4.3
_BWD_ROUNDS_MIN_STEPS = 128


@functools.lru_cache(maxsize=256)
def backward_tail_split(units: int, steps: int, causal: bool, sms: int) -> tuple[int, int]:
    """(split_from, parts): the backward's units from split_from on are each walked in `parts` query ranges, where
    that shortens the last wave by 10% or more on `sms` multiprocessors (in one round of parts, or in several for
    long units); (units, 0) walks every unit whole. `steps`: a unit's 64-query steps."""
    r = units % sms
    if causal or units <= sms or r == 0:
        return units, 0
    best, best_time = 0, (steps + _BWD_BLOCK_OVERHEAD_STEPS) * _SPLIT_MARGIN
    for parts in range(2, 9):
        rounds = -(-r * parts // sms)
        if steps < parts * _BWD_MIN_PART_STEPS or (rounds == 1 and parts > 4) or \
                (rounds > 1 and (parts < 3 or steps < _BWD_ROUNDS_MIN_STEPS)):
            continue
        part = steps / parts + _BWD_BLOCK_OVERHEAD_STEPS + _BWD_MERGE_STEPS + (_BWD_RAGGED_STEPS if rounds > 1 else 0)
        if rounds * part < best_time:
            best, best_time = parts, rounds * part
    return (units - r, best) if best else (units, 0)


@functools.lru_cache(maxsize=256)  # a pure function of the shape, asked on every backward call
def backward_group_split(B: int, Hq: int, Hkv: int, Sq: int, Sk: int, D: int, causal: bool, sms: int,
                         window: int = 0) -> int:
    """In how many parts the backward splits each key/value head's query heads (1: a block walks the whole group and
    dK, dV leave it summed). B * Hkv * key tiles blocks can be too few for the GPU, or too few to even out causal
    blocks' lengths (multi-query heads, small batches); then more blocks each walk part of the group, and dK, dV
    are summed over the parts afterwards, which the split's predicted time must pay for and still win by 10%.
    `window`: the kernel's sliding window (0: none)."""
    G = Hq // Hkv
    if G == 1:
        return 1
    keys = _bwd_keys(D)
    kv_tiles, q_tiles, tile_steps = -(-Sk // keys), -(-Sq // _BWD_QUERIES), keys // _BWD_QUERIES
    step_s = 5 * 2 * keys * _BWD_QUERIES * D / _BWD_STEP_FLOP_RATE
    whole = _bwd_makespan(B * Hkv, kv_tiles, q_tiles, G, causal, sms, tile_steps, window)
    best, best_steps = 1, whole
    for split in (s for s in range(2, G + 1) if G % s == 0):
        part_bytes = 2 * (split + 1) * B * Hkv * Sk * D * 2  # dK and dV: the parts read, the sums written
        summing = (part_bytes * _PART_SUM_SECONDS_PER_BYTE + 2 * _PART_SUM_LAUNCH_SECONDS) / step_s
        steps = _bwd_makespan(B * Hkv * split, kv_tiles, q_tiles, G // split, causal, sms, tile_steps,
                              window) + summing
        if steps < best_steps:
            best, best_steps = split, steps
    return best if best_steps < _SPLIT_MARGIN * whole else 1


def dq_finalize_mode(requested: str | None = None, causal: bool = False) -> str:
    """How attention_backward rounds dQ: "pass" (after the backward kernel, in stream order) or "overlap" (the
    backward counts each group of dQ rows in as its blocks finish them, and the pass, launched dependent on the
    kernel, rounds each group once it is complete, on the multiprocessors the kernel's last wave frees).
    `requested`, else THUNDER_TK_DQ_FINALIZE (read on every call), else "auto": overlap without a causal mask
    (0.3-1.4% faster on an H200 at S = 2048-4096, session 64), the pass with one (0.2-1.2% slower overlapped: the
    causal walk's short last units leave no wave to hide under)."""
    mode = env_settings.DQ_FINALIZE.read(requested)
    return ("pass" if causal else "overlap") if mode == "auto" else mode


def dq_zero_mode(requested: str | None = None) -> str:
    """Where the backward's fp32 dQ accumulator is zeroed: "pass" (by the delta pass, beside its reads, in a buffer
    of the call's own) or "ahead" (by the previous backward kernel on the stream, under its products: two
    accumulators per device and stream take turns, _DqAccumulators). `requested`, else THUNDER_TK_DQ_ZERO (read on
    every call), else "auto": "ahead" (0.5-1.8% faster on an H200, the delta pass then only reading; session 65).
    Under CUDA-graph capture a launch always takes "pass" (a graph's replays would need the turns' state of the
    capture)."""
    mode = env_settings.DQ_ZERO.read(requested)
    return "ahead" if mode == "auto" else mode


class _DqAccumulators:
    """Two fp32 dQ accumulators of one device and stream that take turns: a backward adds into one while its kernel
    zeroes the other (backward_args::zero_next) for the next backward on the stream, so that the delta pass zeroes
    only an accumulator not known to be zero (the first call, a larger shape). Launches on one stream never
    overlap, and the kernel zeroes once the grids before it are complete: by then the previous call's dQ pass has
    read that buffer. What is known zero is each buffer's leading `zeroed` floats."""

    def __init__(self, floats: int, device: torch.device):
        self.buffers = [torch.empty(floats, dtype=torch.float32, device=device) for _ in range(2)]
        self.zeroed = [0, 0]
        self.turn = 0

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, bool]:
        """This call's accumulator, and whether the delta pass must zero it; it counts as not zero from here on."""
        n = math.prod(shape)
        known_zero = self.zeroed[self.turn] >= n
        self.zeroed[self.turn] = 0
        return self.buffers[self.turn][:n].view(shape), not known_zero

    @property
    def next(self) -> torch.Tensor:
        return self.buffers[1 - self.turn]

    def launched(self, zeroed: int) -> None:
        """The kernel that zeroes `zeroed` leading floats of the next buffer is enqueued: the turn passes."""
        self.turn = 1 - self.turn
        self.zeroed[self.turn] = zeroed


_dq_accumulators: dict[tuple[int, int], _DqAccumulators] = {}

def zero_ahead_fits(floats: int, blocks: int, max_share: int) -> bool:
    """Whether a backward grid of `blocks` can zero a next dQ accumulator of `floats` (backward_args::zero_next): each
    block's share of float4s must be at most `max_share`, the kernel's limit (its 32-bit offsets; the binding's
    attention_backward_max_zero_share). Only a huge accumulator over few blocks (many queries against a few keys)
    passes it; the delta pass then zeroes the call's own accumulator instead."""
    return -(-(floats // 4) // max(blocks, 1)) <= max_share


def _dq_accumulator(shape: tuple[int, ...], device: torch.device,
                    mode: str) -> tuple[torch.Tensor, bool, _DqAccumulators | None]:
    """(the backward's fp32 dQ accumulator of `shape`, whether the delta pass must zero it, the stream's turns or
    None where the kernel zeroes nothing ahead)."""
    if mode == "pass" or torch.cuda.is_current_stream_capturing():
        return torch.empty(shape, dtype=torch.float32, device=device), True, None
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    turns, floats = _dq_accumulators.get(key), math.prod(shape)
    if turns is None or turns.buffers[0].numel() < floats:
        turns = _dq_accumulators[key] = _DqAccumulators(floats, device)
    return *turns.take(shape), turns


def clear_dq_accumulators() -> None:
    """Frees the attention backward's per-stream dQ accumulators (two of the largest backward's B * Hq * Sq * D fp32
    each); the next backward makes new ones."""
    torch.cuda.synchronize()
    _dq_accumulators.clear()


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       grad_o: torch.Tensor, *, is_causal: bool = False, scale: float | None = None,
                       window: int | None = None, _group_split: int = 0,
                       _tail_split: bool | tuple[int, int] = True,
                       _dq_finalize: str | None = None,
                       _dq_zero: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention_forward's o, by the tk kernels, from its o and lse.

    Same arguments and layouts as attention_forward (window: the forward's); o and grad_o are (B, Hq, Sq, D), lse
    (B, Hq, Sq) float32. dk and dv have k's (B, Hkv, Sk, D) shape, summed over each key/value head's query heads. All come back in the
    input dtype. The kernels: delta = rowsum(grad_o * o); then one pass over key blocks that keeps dK and dV in
    registers and adds dQ into an fp32 buffer, which a last pass scales and rounds. That buffer is zeroed by the
    previous backward's kernel on the stream (dq_zero_mode "ahead"), else by the delta pass. Grouped K/V: a block
    walks every query head of its group and sums dK, dV in fp32, unless that grid is too small for the GPU; then
    the group is walked in parts by more blocks (`backward_group_split`) and the parts' dK, dV (input dtype) summed
    after the kernel. _group_split (tests): that many parts, 0 for the choice above.
    Without a causal mask, where the last wave of units would leave most multiprocessors idle, its units are walked in
    query ranges by several blocks and merged (`backward_tail_split`; fp32 scratch of up to a wave of units). Not
    under CUDA-graph capture. _tail_split (tests): False walks every unit whole, (split_from, parts) forces a split.
    _dq_finalize: "auto", "pass" or "overlap" (dq_finalize_mode; None: THUNDER_TK_DQ_FINALIZE). _dq_zero: "auto",
    "pass" or "ahead" (dq_zero_mode; None: THUNDER_TK_DQ_ZERO).
    """
    _check_backward_args(q, k, v, o, lse, grad_o, is_causal, scale, _group_split, _tail_split, window)
    overlap = dq_finalize_mode(_dq_finalize, bool(is_causal)) == "overlap"
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), *(torch.zeros((B, Hkv, Sk, D), dtype=q.dtype, device=q.device) for _ in "kv")
    dk = torch.empty((B, Hkv, Sk, D), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    # Overlapped, dq is taken before the kernels' own buffers: the pass writes it while the backward's last blocks
    # still run, so it must not be memory that the backward reads (a copy made for it, freed before the pass).
    dq = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device) if overlap else None
    ext, dq_accum, factor, order = _backward_into(q, k, v, o, lse, grad_o, dk, dv, is_causal, scale, _group_split,
                                                  _tail_split, window, count_dq=overlap, dq_zero=_dq_zero)
    if dq is None:
        dq = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    with _on(q.device):
        ext.attention_dq_finalize(dq_accum.data_ptr(), dq.data_ptr(), _DTYPE_CODES[q.dtype], dq.numel(), factor,
                                  _stream_handle(q.device), *order.args)
    return dq, dk, dv


class _DqOrder:
    """The backward's dQ counters for an overlapped finalize pass (backward_args::dq_done): the zeroed uint64
    tensor (kept here until the pass is launched), the elements of each counter's group of rows, and the steps each
    counter reaches. Empty (no args) for the plain pass."""

    def __init__(self, counters: torch.Tensor | None = None, group_elements: int = 0, target: int = 0):
        self.counters, self.group_elements, self.target = counters, group_elements, target

    @property
    def args(self) -> tuple:
        return () if self.counters is None else (self.counters.data_ptr(), self.group_elements, self.target)


def _check_backward_args(q, k, v, o, lse, grad_o, is_causal, scale, group_split, tail_split, window=None) -> None:
    check_attention_args(q, k, v, is_causal, scale, window)
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    for name, t in (("o", o), ("grad_o", grad_o)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be a {q.dtype} tensor of q's shape {tuple(q.shape)} on {q.device}")
    if not isinstance(lse, torch.Tensor) or lse.shape != (B, Hq, Sq) or lse.dtype != torch.float32 \
            or lse.device != q.device:
        raise ValueError(f"lse must be a float32 tensor of shape {(B, Hq, Sq)} on {q.device}")
    if not isinstance(group_split, int) or group_split < 0 or group_split and (Hq // Hkv) % group_split:
        raise ValueError(f"_group_split must be 0 or a divisor of {Hq // Hkv} (query heads per key/value head), "
                         f"not {group_split!r}")
    if not isinstance(tail_split, bool) and not (isinstance(tail_split, tuple) and len(tail_split) == 2
                                                 and all(isinstance(x, int) for x in tail_split)):
        raise ValueError(f"_tail_split must be True, False or (split_from, parts), not {tail_split!r}")


def _backward_into(q, k, v, o, lse, grad_o, dk, dv, is_causal, scale, group_split, tail_split, window=None,
                   count_dq=False, dq_zero=None):
    """The backward kernels on checked, non-empty arguments: dk and dv (B, Hkv, Sk, D, any 16-byte strides TMA can
    store through) written, and (extension, the fp32 dQ accumulator, the factor that scales it into dq, a _DqOrder:
    with `count_dq` the counters an overlapped finalize pass waits on, where it can follow the kernel at once).
    `dq_zero`: dq_zero_mode's argument. The accumulator must be read before the next backward on the stream."""
    ext = _require_kernels(q.device)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    sms = _extension.multiprocessor_count(q.device.index)
    kernel_window = _kernel_window(window, Sk)
    split = group_split or backward_group_split(B, Hq, Hkv, Sq, Sk, D, bool(is_causal), sms, kernel_window)
    units = B * Hkv * split * -(-Sk // _bwd_keys(D))
    # "off" (THUNDER_TK_ATTN_BWD_TAIL_SPLIT): every unit whole, to measure the split against the overlapped dQ pass,
    # which uses the multiprocessors an unsplit last wave leaves idle.
    if tail_split is True and env_settings.ATTN_BWD_TAIL_SPLIT.read() == "off":
        tail_split = False
    if tail_split is True:
        # D = 256 walks every unit whole (its kernel has no merge of parts).
        split_from, parts = ((units, 0) if torch.cuda.is_current_stream_capturing() or D == 256 else
                             backward_tail_split(units, (Hq // Hkv // split) * -(-Sq // _BWD_QUERIES),
                                                 bool(is_causal), sms))
    elif tail_split is False:
        split_from, parts = units, 0
    else:
        split_from, parts = tail_split
    if 2 * (units - split_from) > _SPLIT_COUNT_SLOT and parts:
        raise ValueError(f"_tail_split: at most {_SPLIT_COUNT_SLOT // 2} split units, not {units - split_from}")
    # Parts of each group go to buffers of their own and are summed into dk, dv after the kernel.
    dk_parts, dv_parts = (dk, dv) if split == 1 else \
        (torch.empty((B, Hkv * split, Sk, D), dtype=q.dtype, device=q.device) for _ in "kv")
    q, scale, sign = _kernel_scale(q, scale)
    q, k, v, grad_o = _tma_readable(q), _tma_readable(k), _tma_readable(v), _tma_readable(grad_o)
    lse = _rows_tma_readable(lse)
    zero_mode = dq_zero_mode(dq_zero)
    blocks = split_from + (units - split_from) * parts if parts else units
    if zero_mode == "ahead" and not zero_ahead_fits(B * Hq * Sq * D, blocks, ext.attention_backward_max_zero_share()):
        zero_mode = "pass"
    dq_accum, zero_in_pass, turns = _dq_accumulator((B, Hq, Sq, D), q.device, zero_mode)
    # Counted only where the finalize pass follows the kernel directly (the parts' sums would come between).
    count_dq = count_dq and split == 1
    # Zeroed before the delta pass, so that the delta pass, the kernel and the finalize launch back to back.
    counters = torch.zeros(B * Hkv * split, dtype=torch.int64, device=q.device) if count_dq else None  # read as uint64
    delta = attention_bwd_delta(o, grad_o, out=_row_vectors((B, Hq, Sq), q.device),
                                zero=dq_accum if zero_in_pass else None)
    scratch = (torch.empty((units - split_from) * parts * 2 * _BWD_KEYS * D, dtype=torch.float32, device=q.device)
               if parts else None)
    with _on(q.device):
        target = ext.attention_backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), grad_o.data_ptr(), lse.data_ptr(),
                               delta.data_ptr(), dq_accum.data_ptr(), dk_parts.data_ptr(), dv_parts.data_ptr(),
                               _DTYPE_CODES[q.dtype], B, Hq, Hkv, Sq, Sk, D, list(q.stride()[:3]),
                               list(k.stride()[:3]), list(v.stride()[:3]), list(grad_o.stride()[:3]),
                               list(dk_parts.stride()[:3]), list(dv_parts.stride()[:3]), list(lse.stride()[:2]),
                               list(delta.stride()[:2]), scale, bool(is_causal), _stream_handle(q.device), split,
                               split_from, parts, scratch.data_ptr() if parts else 0,
                               _zeroed_slot(q.device, "attention_bwd_split", _SPLIT_COUNT_SLOT, 64) if parts else 0,
                               kernel_window, counters.data_ptr() if count_dq else 0,
                               zero_next=turns.next.data_ptr() if turns else 0,
                               zero_next_count=dq_accum.numel() if turns else 0)
    if turns:
        turns.launched(dq_accum.numel())
    if split > 1:  # the parts of each group, summed (torch accumulates 16-bit sums in fp32; out= may be strided)
        for out, part in ((dk, dk_parts), (dv, dv_parts)):
            torch.sum(part.view(B, Hkv, split, Sk, D), 2, out=out)
    order = _DqOrder(counters, (Hq // Hkv) * Sq * D, target) if count_dq else _DqOrder()
    return ext, dq_accum, sign * scale, order


# ------------------------------------------------------------------------------------------------
# The attention backward straight into the gradient of a fused qkv projection, with the rotary embedding's backward

def qkv_head_views(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int):
    """(q, k, v) as (B, H, S, D) views of a fused projection's (B, S, (q_heads + 2 kv_heads) head_dim) output (or
    gradient), split in that column order as LitGPT splits it."""
    bounds = ((0, q_heads), (q_heads, q_heads + kv_heads), (q_heads + kv_heads, q_heads + 2 * kv_heads))
    return tuple(qkv[..., a * head_dim: b * head_dim].unflatten(-1, (b - a, head_dim)).transpose(1, 2)
                 for a, b in bounds)


def rope_tables(rows: int, n: int, dtype: torch.dtype, device, base: float = 10000.0):
    """LitGPT's cos and sin caches for a rotation over n columns: (rows, n), the n / 2 frequencies' angles repeated,
    computed in float64 and rounded to `dtype` (tests' and benchmarks' tables)."""
    inv = 1.0 / base ** (torch.arange(0, n, 2, device=device, dtype=torch.float64) / max(n, 1))
    angles = torch.outer(torch.arange(rows, device=device, dtype=torch.float64), inv).repeat(1, 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotate-half rotary embedding of (B, H, S, D) x over its first n = cos.shape[1] columns, in x's dtype,
    computed in float32: y = x cos + rotate_half(x) sin with rotate_half(x) = (-x[n/2:n], x[:n/2]), position s
    using row s of the (>= S, n) cos and sin; columns from n on unchanged."""
    S, n = x.shape[2], cos.shape[1]
    c, s = cos[:S].float(), sin[:S].float()
    xf = x.float()
    x1, x2 = xf[..., : n // 2], xf[..., n // 2: n]
    roped = xf[..., :n] * c + torch.cat((-x2, x1), -1) * s
    return torch.cat((roped, xf[..., n:]), -1).to(x.dtype)


def qkv_grad_reference(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, *, dtype: torch.dtype | None = torch.float64) -> torch.Tensor:
    """The gradient of qkv (B, S, (Hq + 2 Hkv) D) for q, k, v split from it in that column order (heads of D
    columns), q and k then roped by rope_reference: dq and dk rotated back, dv as it is. Computed in `dtype` (None:
    the inputs' own, as a model's traced ops compute it)."""
    S, n = dq.shape[2], cos.shape[1]
    c, s = cos[:S].to(dtype or cos.dtype), sin[:S].to(dtype or sin.dtype)

    def back(g):
        g = g.to(dtype or g.dtype)
        g1, g2 = g[..., : n // 2], g[..., n // 2: n]
        c1, c2, s1, s2 = c[:, : n // 2], c[:, n // 2:], s[:, : n // 2], s[:, n // 2:]
        return torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1, g[..., n:]), -1)

    B = dq.shape[0]
    return torch.cat([t.transpose(1, 2).reshape(B, S, -1) for t in (back(dq), back(dk), dv.to(dtype or dv.dtype))],
                     -1)


def qkv_grad_unsupported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why attention_backward_qkv cannot take these (metadata only), or None."""
    if q.shape[2] != k.shape[2]:
        return f"the query and key lengths differ ({q.shape[2]} and {k.shape[2]}): q, k and v are not one projection's"
    if cos.ndim != 2 or sin.shape != cos.shape:
        return f"cos and sin must be 2-D and alike; got {tuple(cos.shape)} and {tuple(sin.shape)}"
    n = cos.shape[1]
    if n % 16 or n > q.shape[3]:
        return f"the rotary embedding's width ({n}) must be a multiple of 16 up to the head dim ({q.shape[3]})"
    if cos.shape[0] < q.shape[2]:
        return f"cos and sin have {cos.shape[0]} positions for {q.shape[2]} tokens"
    if cos.dtype != sin.dtype or cos.dtype not in (torch.float32, q.dtype):
        return f"cos and sin must both be float32 or {q.dtype}; got {cos.dtype} and {sin.dtype}"
    return None


def attention_backward_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                           grad_o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, is_causal: bool = False,
                           scale: float | None = None, window: int | None = None, _group_split: int = 0,
                           _tail_split: bool | tuple[int, int] = True) -> torch.Tensor:
    """The gradient of the fused projection output qkv (B, S, (Hq + 2 Hkv) D) from which q, k and v were split (in
    that column order, D columns a head, each transposed to (B, H, S, D)) and q and k roped as rope_reference does.

    What attention_backward computes, written where the projection's backward reads it: dk and dv go straight from
    the backward kernel into their columns of the result, then one pass scales the dQ accumulator, rotates it back
    and stores it into q's columns, and rotates dk back in place. So no rope kernels and no concatenation follow the
    attention backward. cos and sin: (>= S, n) float32 or q's dtype, n a multiple of 16 up to D (0: no rotation);
    position s uses row s. Other arguments as attention_backward.
    """
    _check_backward_args(q, k, v, o, lse, grad_o, is_causal, scale, _group_split, _tail_split, window)
    if not all(isinstance(t, torch.Tensor) and t.device == q.device for t in (cos, sin)):
        raise ValueError(f"cos and sin must be tensors on {q.device}")
    if (reason := qkv_grad_unsupported(q, k, cos, sin)) is not None:
        raise ValueError(reason)
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    qkv_grad = torch.empty((B, S, (Hq + 2 * Hkv) * D), dtype=q.dtype, device=q.device)
    if qkv_grad.numel() == 0:
        return qkv_grad
    dq, dk, dv = qkv_head_views(qkv_grad, Hq, Hkv, D)
    ext, dq_accum, factor, _ = _backward_into(q, k, v, o, lse, grad_o, dk, dv, is_causal, scale, _group_split,
                                              _tail_split, window)
    _rope_grad_pass(ext, dq_accum, factor, dq, dk, cos, sin)
    return qkv_grad


def _rope_grad_pass(ext, dq_accum: torch.Tensor, factor: float, dq: torch.Tensor, dk: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> None:
    """attention_backward_qkv's last pass: dq = factor * dq_accum (fp32, contiguous (B, Hq, S, D)) rotated back into
    `dq`, and `dk` rotated back in place (not at all where the tables are 0 wide); dq and dk (B, H, S, D) views with
    unit last stride, as qkv_head_views makes them. Checked by the caller."""
    B, Hq, S, D = dq.shape
    n = cos.shape[1]
    # The kernel reads both tables with one row stride, rows on 16 bytes; other tables are copied (S x n, small).
    if cos.stride(0) != sin.stride(0) or not all(t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
                                                 for t in (cos, sin)):
        cos, sin = cos[:S].contiguous(), sin[:S].contiguous()
    with _on(dq.device):
        ext.attention_rope_grad(dq_accum=dq_accum.data_ptr(), dq=dq.data_ptr(), dq_stride=list(dq.stride()[:3]),
                                q_heads=Hq, scale=factor, dk=dk.data_ptr() if n else 0,
                                dk_stride=list(dk.stride()[:3]), kv_heads=dk.shape[1], cos=cos.data_ptr(),
                                sin=sin.data_ptr(), angle_fp32=cos.dtype == torch.float32, angle_stride=cos.stride(0),
                                dtype=_DTYPE_CODES[dq.dtype], batch=B, seq=S, head_dim=D, rope_dims=n,
                                stream=_stream_handle(dq.device))


# ------------------------------------------------------------------------------------------------
# GEMM: C = A B (+ bias)

_GEMM_DTYPES = (torch.bfloat16, torch.float16)
# The largest M, N or K (and K + K2 of gemm_sum) that the GEMM kernels take: they number tiles and TMA coordinates
# in 32-bit ints with room to spare (csrc/kernels/gemm/gemm.cu, gemm_unsupported). Element offsets are 64-bit, so
# outputs and operands past 2^31 elements are fine.
GEMM_MAX_DIM = 2**30 - 1


def gemm_dims_unsupported(**dims: int) -> str | None:
    """Why the GEMM kernels cannot take these sizes (named as given, e.g. M=..., K=...), or None."""
    over = [f"{name}={size}" for name, size in dims.items() if size > GEMM_MAX_DIM]
    return f"{', '.join(over)} past the GEMM kernels' largest dimension (2^30 - 1)" if over else None


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
    if reason := gemm_dims_unsupported(M=a.shape[0], N=b.shape[1], K=a.shape[1]):
        raise ValueError(f"gemm: {reason}")  # before the output is allocated
    if a.device != b.device or a.device.type != "cuda":
        raise ValueError(f"gemm runs on CUDA tensors on one device; got {a.device} and {b.device}")
    if a.shape[1] % 8:
        raise ValueError(f"gemm needs K a multiple of 8; K={a.shape[1]}")
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != b.shape[1] or bias.dtype != a.dtype
                             or bias.device != a.device):
        raise ValueError(f"bias must be a 1-D {a.dtype} tensor of {b.shape[1]} elements on {a.device}")


# Tile schedule of the GEMM: "static" (block i takes tiles i, i + grid, ...) or "dynamic" (blocks take tiles from
# a counter as they get to them: blocks that start late, on SMs another kernel held, take fewer).
GEMM_SCHEDULE_ENV = env_settings.GEMM_SCHEDULE.name
# Counters a launch leaves zeroed (dynamic-schedule tickets, the attention forward's split-tile counts): per device
# and kind a ring of zeroed int32 slots, one per launch (a launch re-zeroes its own). A slot comes round again
# after `slots` launches, far beyond any queue's depth.
_zeroed_rings: dict[tuple[str, int], torch.Tensor] = {}
_zeroed_next: dict[tuple[str, int], int] = {}


def _zeroed_slot(device: torch.device, kind: str, slot_ints: int, slots: int) -> int:
    """The address of the next slot of `slot_ints` zeroed int32 (a multiple of 32) in the ring of `kind`."""
    key = (kind, device.index)
    ring = _zeroed_rings.get(key)
    if ring is None:
        ring = torch.zeros(slots * slot_ints, dtype=torch.int32, device=device)
        torch.cuda.current_stream(device).synchronize()  # once per device: launches on any stream see zeros
        _zeroed_rings[key] = ring
    i = _zeroed_next.get(key, 0)
    _zeroed_next[key] = (i + 1) % slots
    return ring.data_ptr() + 4 * slot_ints * i


def _launch_tickets(device: torch.device, schedule: str, what: str) -> int:
    """The counter address for one launch of a kernel with the dynamic schedule, or 0 for the static one."""
    if schedule not in ("static", "dynamic"):
        raise ValueError(f"{what} schedule must be 'static' or 'dynamic'; got {schedule!r}")
    # Under CUDA-graph capture a launch would keep its counter for every replay, however far apart: static.
    if schedule == "static" or torch.cuda.is_current_stream_capturing():
        return 0
    return _zeroed_slot(device, "tickets", 32, 4096)


# Counters of a launch's split work (the attention forward's split tiles, the backward's split units): fewer than a
# wave of them (< 2^10 multiprocessors) times two warpgroups.
_SPLIT_COUNT_SLOT = 4096


def _gemm_tickets(device: torch.device, schedule: str | None) -> int:
    return _launch_tickets(device, env_settings.GEMM_SCHEDULE.read(schedule), "gemm")


# The GEMM's stream-K workspace (on request, the grid's last wave is cut into k-block ranges: blocks leave fp32
# partial sums and raise a flag for the block that finishes the tile). One per device and
# stream, as torch keeps cuBLAS's: launches on one stream never overlap, so they share it; the flags start zeroed and
# every launch leaves them zeroed. A launch captured into a CUDA graph gets its own from the graph's pool, with the
# flags' zeroing captured before it.
_stream_k_workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _stream_k_workspace(device: torch.device, ext) -> tuple[int, int]:
    """(partials, flags) addresses of the stream-K workspace for a launch on the current stream."""
    capturing = torch.cuda.is_current_stream_capturing()
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    workspace = None if capturing else _stream_k_workspaces.get(key)
    if workspace is None:
        floats, flags = ext.gemm_stream_k_workspace()
        # Both on the launch's stream, so the zeroing is ordered before the launch.
        workspace = (torch.empty(floats, dtype=torch.float32, device=device),
                     torch.zeros(flags, dtype=torch.int32, device=device))
        if not capturing:
            _stream_k_workspaces[key] = workspace
    return workspace[0].data_ptr(), workspace[1].data_ptr()


def clear_stream_k_workspaces() -> None:
    """Frees the GEMM's per-stream stream-K workspaces (about 17 MB each on an H100); the next launch makes one."""
    torch.cuda.synchronize()
    _stream_k_workspaces.clear()


SKINNY_MAX_M = 64  # rows up to which the GEMM takes its kernel for few rows (csrc/kernels/gemm/skinny.cu)


def gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
         out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, _group_rows: int = 0, _cluster: int = 0,
         _schedule: str | None = None, _tile_n: int = 0, _pingpong: int = 0, _epilogue: int = 0,
         _stream_k: int = 0, _skinny: int = 0, _second: tuple[torch.Tensor, torch.Tensor] | None = None
         ) -> torch.Tensor:
    """a (M, K) @ b (K, N) (+ bias (N,)) by the tk kernel, bf16/fp16 with fp32 accumulation.

    Operands are read in place when one of their strides is 1 (either major) and the other a multiple of 8;
    others are copied first. `out_dtype`: the result's dtype, the operands' (default) or torch.float32 with bf16
    operands (rounded once from the fp32 accumulators: bf16-mixed training's weight gradients, which would otherwise
    be rounded to bf16 and widened again; the knobs `_cluster=2`, `_pingpong=1`, `_epilogue=1` and `_skinny=1` do
    not apply there). `out`, if given, is an (M, N) tensor of that dtype with unit column stride. The underscored
    arguments are tuning knobs for tests and benchmarks (`_tile_n`: output tile width 128 or 256, 0 automatic;
    `_pingpong`: 1 the consumer warpgroups take 128 x 128 tiles in turns, -1 they share each tile, 0 automatic;
    `_epilogue`: 1 store warps write the output tiles while the consumers go on, 2 the consumers do, 3 the consumers
    from registers with no staging (not SwiGLU's launches), 0 automatic;
    `_stream_k`: 1 the persistent grid's last wave cut into k-block ranges (static schedule only), 0 or -1 whole
    tiles only: no automatic rule measured faster; `_skinny`: the kernel for at most SKINNY_MAX_M rows with `a`
    K-major, which spreads the product over every SM by splitting K: 0 where it applies, 1 forced, -1 never).
    `_second`: (a2, b2), a product added in the same launch (gemm_sum).
    """
    check_gemm_args(a, b, bias)
    if _second is not None:
        check_gemm_sum_args(a, b, *_second)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in (a.dtype, torch.float32) or (out_dtype == torch.float32 and a.dtype != torch.bfloat16):
        raise ValueError(f"gemm writes its result in the operands' dtype, or in float32 with bfloat16 operands; "
                         f"got out_dtype {out_dtype} with {a.dtype} operands")
    wide = out_dtype != a.dtype
    ext = _require_kernels(a.device)
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    elif out.shape != (M, N) or out.dtype != out_dtype or out.device != a.device or (N > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be a {out_dtype} ({M}, {N}) tensor on {a.device} with unit column stride")
    if M == 0 or N == 0:
        return out
    if _second is not None and (K == 0 or _second[0].shape[1] == 0):  # one product is empty: the other alone
        knobs = dict(_group_rows=_group_rows, _cluster=_cluster, _schedule=_schedule, _tile_n=_tile_n,
                     _pingpong=_pingpong, _epilogue=_epilogue, _stream_k=_stream_k, _skinny=_skinny)
        return gemm(*(_second if K == 0 else (a, b)), bias, out=out, out_dtype=out_dtype, **knobs)
    if K == 0:
        return out.copy_(bias.expand(M, N) if bias is not None else torch.zeros((), dtype=a.dtype, device=a.device))
    sum_args = {}
    if _second is None:
        (a, a_layout), (b, b_layout) = _as_read(a, 1), _as_read(b, 0)
    else:
        a2, b2 = _second
        a, a_layout, a2, a2_layout = _sum_operands(a, a2, 1)
        b, b_layout, b2, b2_layout = _sum_operands(b, b2, 0)
        sum_args = dict(sum_a=a2.data_ptr(), sum_b=b2.data_ptr(), sum_K=a2.shape[1], sum_a_stride_m=a2_layout[0],
                        sum_a_stride_k=a2_layout[1], sum_b_stride_k=b2_layout[1], sum_b_stride_n=b2_layout[0])
    if _skinny == 0 and (_second is not None or wide):  # the skinny kernel takes one product, in the operands' dtype
        _skinny = -1
    if bias is not None:
        bias = bias.contiguous()
    (a_sm, a_sk), (b_sn, b_sk) = a_layout, b_layout
    with _on(a.device):
        tickets = _gemm_tickets(a.device, _schedule)
        # The split-K workspace serves the stream-K tail and the skinny kernel's split of K alike.
        skinny = _skinny != -1 and M <= SKINNY_MAX_M and a_sk == 1
        wants_workspace = (_stream_k == 1 and tickets == 0) or skinny
        partials, flags = _stream_k_workspace(a.device, ext) if wants_workspace else (0, 0)
        ext.gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), 0 if bias is None else bias.data_ptr(),
                 _DTYPE_CODES[a.dtype], M, N, K, a_sm, a_sk, b_sk, b_sn, out.stride(0) if M > 1 else N,
                 _stream_handle(a.device), _group_rows, _cluster, tickets, _tile_n, _pingpong, _epilogue,
                 _stream_k, partials, flags, _skinny, **sum_args, c_fp32=wide)
    return out


def _as_read(t: torch.Tensor, k_dim: int, k_major: bool = False) -> tuple[torch.Tensor, tuple[int, int]]:
    """t (A (M, K) with k_dim 1, or B (K, N) with k_dim 0) and its (stride along the other dim, stride along K) as
    the GEMM kernels read it: in place where _gemm_layout allows (`k_major`: only K-major), else copied to fresh
    K-major storage with leading stride K."""
    layout = _gemm_layout(t, k_dim)
    if layout is not None and (layout[1] == 1 or not k_major):
        return t, layout
    return (_k_major_rows(t) if k_dim == 1 else _k_major_rows(t.t()).t()), (t.shape[k_dim], 1)


def _sum_operands(t: torch.Tensor, t2: torch.Tensor, k_dim: int):
    """(t, layout, t2, layout2): the two products' A operands (k_dim 1) or B operands (k_dim 0) as one kernel reads
    both, with the same major: each in place where _gemm_layout allows and the majors agree, else both K-major
    (copied where they are not so already)."""
    (t, layout), (t2, layout2) = _as_read(t, k_dim), _as_read(t2, k_dim)
    if (layout[1] == 1) != (layout2[1] == 1):
        (t, layout), (t2, layout2) = _as_read(t, k_dim, k_major=True), _as_read(t2, k_dim, k_major=True)
    return t, layout, t2, layout2


def check_gemm_sum_args(a: torch.Tensor, b: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor) -> None:
    """What gemm_sum accepts besides gemm's a and b (metadata only): a2 (M, K2) and b2 (K2, N) as gemm's operands,
    with a's rows, b's columns, dtype and device."""
    if not isinstance(a2, torch.Tensor) or not isinstance(b2, torch.Tensor):
        raise TypeError("gemm_sum: a2 and b2 must be tensors")
    check_gemm_args(a2, b2, None)
    if a2.shape[0] != a.shape[0] or b2.shape[1] != b.shape[1]:
        raise ValueError(f"gemm_sum: the products must have one shape; got ({a.shape[0]}, {b.shape[1]}) and "
                         f"({a2.shape[0]}, {b2.shape[1]})")
    if a2.dtype != a.dtype or a2.device != a.device:
        raise ValueError(f"gemm_sum: a2 and b2 must be {a.dtype} tensors on {a.device}; got {a2.dtype} on {a2.device}")
    if reason := gemm_dims_unsupported(**{"K + K2": a.shape[1] + a2.shape[1]}):
        raise ValueError(f"gemm_sum: {reason}")


def gemm_sum(a: torch.Tensor, b: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor, bias: torch.Tensor | None = None,
             *, out: torch.Tensor | None = None, **knobs) -> torch.Tensor:
    """a (M, K) @ b (K, N) + a2 (M, K2) @ b2 (K2, N) (+ bias (N,)) by one tk launch: both products' k-blocks go
    through the same fp32 accumulators, rounded once, so neither product is written or read back on its own (e.g.
    the input gradient of LLaMA's MLP, dh1 W1 + dh2 W2). Operands as gemm's (read in place where TMA can; where the
    two products' layouts differ, both are read K-major, copied as needed). `out` and the underscored knobs as
    gemm's (the skinny kernel takes one product only)."""
    return gemm(a, b, bias, out=out, _second=(a2, b2), **knobs)


# The embedding's weight gradient

EMBEDDING_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def embedding_backward_reference(grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                                 padding_idx: int = -1) -> torch.Tensor:
    """The (num_weights, D) weight gradient of an embedding lookup in float64: row v the sum of grad's rows whose
    index is v; the padding_idx row (negative: none) zero."""
    D = grad.shape[-1]
    out = torch.zeros(num_weights, D, dtype=torch.float64, device=grad.device)
    ids = indices.reshape(-1).long()
    keep = (ids >= 0) & (ids < num_weights) & (ids != padding_idx)
    out.index_add_(0, ids[keep], grad.reshape(-1, D).double()[keep])
    return out


def embedding_backward_unsupported(grad, indices, num_weights: int, padding_idx: int = -1,
                                   scale_grad_by_freq: bool = False, sparse: bool = False) -> str | None:
    """Why embedding_backward cannot take these (metadata only: tensors, or claim_rules.TensorMetadata), or None."""
    if scale_grad_by_freq:
        return "scale_grad_by_freq is not supported"
    if sparse:
        return "sparse gradients are not supported"
    if grad.ndim != indices.ndim + 1 or tuple(grad.shape[:-1]) != tuple(indices.shape):
        return f"grad {tuple(grad.shape)} is not one row per index of {tuple(indices.shape)}"
    if grad.dtype not in EMBEDDING_DTYPES:
        return f"grad dtype {grad.dtype} not in {{bfloat16, float16, float32}}"
    if indices.dtype not in (torch.int64, torch.int32):
        return f"indices must be int64 or int32, not {indices.dtype}"
    if num_weights < 0:
        return f"num_weights must not be negative ({num_weights})"
    return None


def embedding_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int = -1
                       ) -> torch.Tensor:
    """The dense (num_weights, D) weight gradient of `weight[indices]` for the incoming gradient grad (indices.shape
    + (D,)): row v the sum, in fp32 and in token order (deterministic), of the rows of grad whose index is v,
    rounded once; the padding_idx row (negative: none) and rows no index names are zero; indices outside
    [0, num_weights) add nothing. One sort of the ids (no host synchronisation), then one pass that writes the
    whole gradient."""
    if not isinstance(grad, torch.Tensor) or not isinstance(indices, torch.Tensor):
        raise TypeError("embedding_backward expects tensors (grad, indices)")
    if (reason := embedding_backward_unsupported(grad, indices, num_weights, padding_idx)) is not None:
        raise ValueError(f"embedding_backward: {reason}")
    if indices.device != grad.device:
        raise ValueError(f"embedding_backward: indices on {indices.device}, grad on {grad.device}")
    ext = _require_kernels(grad.device)
    D = grad.shape[-1]
    out = torch.empty(num_weights, D, dtype=grad.dtype, device=grad.device)
    if out.numel() == 0:
        return out
    rows = grad.reshape(-1, D)
    if D > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    ids = indices.reshape(-1).long()
    sorted_ids, order = torch.sort(ids, stable=True)
    with _on(grad.device):
        ext.embedding_backward(rows.data_ptr(), rows.stride(0) if rows.shape[0] > 1 else D, sorted_ids.data_ptr(),
                               order.data_ptr(), out.data_ptr(), ids.numel(), num_weights, D,
                               padding_idx if padding_idx >= 0 else -1, _DTYPE_CODES[grad.dtype],
                               _stream_handle(grad.device))
    return out


# RMSNorm (LLaMA's, as LitGPT computes it: in fp32, the weight applied after the scaling, rounded once)

RMS_NORM_DTYPES = (torch.bfloat16, torch.float16)
RMS_NORM_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RMS_NORM_MAX_SIZE = 16384  # a row's elements, held in one group's registers


def rms_norm_unsupported(x, weight, residual=None) -> str | None:
    """Why rms_norm / rms_norm_backward cannot take these (metadata only: tensors or claim_rules.TensorMetadata;
    for the backward, x is the norm's input), or None."""
    if x.ndim < 1:
        return "the input must have at least one dimension"
    n = x.shape[-1]
    if x.dtype not in RMS_NORM_DTYPES:
        return f"input dtype {x.dtype} not in {{bfloat16, float16}}"
    if weight is None:
        return "RMSNorm without a weight is not supported"
    if weight.ndim != 1 or weight.shape[0] != n:
        return f"the weight {tuple(weight.shape)} is not one value per element of the last dimension ({n})"
    if weight.dtype not in RMS_NORM_WEIGHT_DTYPES:
        return f"weight dtype {weight.dtype} not in {{bfloat16, float16, float32}}"
    if n == 0 or n % 8 != 0:
        return f"the normalized size {n} is not a positive multiple of 8"
    if n > RMS_NORM_MAX_SIZE:
        return f"the normalized size {n} is above {RMS_NORM_MAX_SIZE}"
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype):
        return f"the residual {tuple(residual.shape)} {residual.dtype} is not shaped like the input"
    return None


def _norm_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as (rows, n) rows the norm kernels read in place: as the GEMMs read a K-major operand (_k_major_rows), and
    rows that do not overlap (a row stride of at least n); a contiguous copy otherwise."""
    rows = _k_major_rows(t.reshape(-1, n))
    return rows if rows.shape[0] <= 1 or rows.stride(0) >= n else rows.clone(memory_format=torch.contiguous_format)


def _check_norm_call(name: str, x, weight, residual, *others) -> None:
    if (reason := rms_norm_unsupported(x, weight, residual)) is not None:
        raise ValueError(f"{name}: {reason}")
    for t in (weight, residual, *others):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: tensors on {t.device} and {x.device}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """(y, rstd, s) in float64 but for s, the input (x + residual rounded to x's dtype, or x): rstd (..., 1)."""
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    s64 = s.double()
    rstd = torch.rsqrt(s64.square().mean(-1, keepdim=True) + eps)
    return s64 * rstd * weight.double(), rstd, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """LitGPT's RMSNorm of x (..., n): (y, rstd), or with `residual` (y, rstd, s) where s = x + residual (rounded
    to x's dtype) is the normalized input. rstd = 1 / sqrt(mean(s^2) + eps) in float32, shaped (..., 1);
    y = s * rstd * weight in x's dtype. One pass over the rows, fp32 arithmetic."""
    _check_norm_call("rms_norm", x, weight, residual)
    ext = _require_kernels(x.device)
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rows = x.numel() // n
    if rows:
        xr = _norm_rows(x, n)
        rr = _norm_rows(residual, n) if residual is not None else None
        yr, sr = y.view(-1, n), (s.view(-1, n) if s is not None else None)
        w = weight.contiguous()
        with _on(x.device):
            ext.rms_norm_forward(xr.data_ptr(), xr.stride(0), rr.data_ptr() if rr is not None else 0,
                                 rr.stride(0) if rr is not None else 0, sr.data_ptr() if sr is not None else 0,
                                 sr.stride(0) if sr is not None else 0, w.data_ptr(), yr.data_ptr(), yr.stride(0),
                                 rstd.data_ptr(), 1, rows, n, float(eps), _DTYPE_CODES[x.dtype],
                                 _DTYPE_CODES[weight.dtype], _stream_handle(x.device))
    return (y, rstd) if residual is None else (y, rstd, s)


def rms_norm_backward_reference(grad: torch.Tensor, s: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                                residual_grad: torch.Tensor | None = None):
    """(dx, dw) in float64 of y = s * rstd * weight with rstd = 1 / sqrt(mean(s^2) + eps) a function of s, for the
    incoming gradient `grad`; residual_grad (the gradient reaching s by another path) added to dx."""
    n = s.shape[-1]
    s64, g64, r = s.double(), grad.double(), rstd.double().reshape(*s.shape[:-1], 1)
    gw = g64 * weight.double()
    dx = r * gw - r.pow(3) * s64 * (gw * s64).sum(-1, keepdim=True) / n
    if residual_grad is not None:
        dx = dx + residual_grad.double()
    dw = (g64 * s64 * r).reshape(-1, n).sum(0)
    return dx, dw


def rms_norm_backward(grad: torch.Tensor, s: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                      residual_grad: torch.Tensor | None = None):
    """RMSNorm's (dx, dw) for y = s * rstd * weight (s the norm's input, rstd the forward's, one per row in
    float32): dx in s's dtype, residual_grad (another path's gradient of s) added before the one rounding; dw in
    the weight's dtype, summed in fp32 in a fixed order (repeated runs give the same bits)."""
    _check_norm_call("rms_norm_backward", s, weight, residual_grad, grad, rstd)
    n = s.shape[-1]
    if tuple(grad.shape) != tuple(s.shape) or grad.dtype != s.dtype:
        raise ValueError(f"rms_norm_backward: grad {tuple(grad.shape)} {grad.dtype} is not shaped like the input "
                         f"{tuple(s.shape)} {s.dtype}")
    rows = s.numel() // n
    if rstd.dtype != torch.float32 or rstd.numel() != rows:
        raise ValueError(f"rms_norm_backward: rstd must be float32 with one value per row ({rows}), got "
                         f"{tuple(rstd.shape)} {rstd.dtype}")
    ext = _require_kernels(s.device)
    dx = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    dw = torch.empty(n, dtype=weight.dtype, device=s.device)
    gr, sr = (_norm_rows(grad, n), _norm_rows(s, n)) if rows else (dx.view(-1, n), dx.view(-1, n))
    rr = _norm_rows(residual_grad, n) if residual_grad is not None and rows else None
    rs = rstd.reshape(-1)
    w = weight.contiguous()
    dt = _DTYPE_CODES[s.dtype]
    with _on(s.device):
        parts = ext.rms_norm_backward_partial_rows(rows, n, dt)
        partial = torch.empty(max(parts, 1), n, dtype=torch.float32, device=s.device)
        ext.rms_norm_backward(gr.data_ptr(), gr.stride(0), sr.data_ptr(), sr.stride(0), rs.data_ptr(),
                              rs.stride(0) if rows > 1 else 1, w.data_ptr(), rr.data_ptr() if rr is not None else 0,
                              rr.stride(0) if rr is not None else 0, dx.view(-1, n).data_ptr(), n, dw.data_ptr(),
                              partial.data_ptr(), partial.shape[0], rows, n, dt, _DTYPE_CODES[weight.dtype],
                              _stream_handle(s.device))
    return dx, dw


# The fused qkv projection with the rotary embedding of q and k in its epilogue

ROPE_HEAD_DIMS = (64, 128, 256)


def linear_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
                          kv_heads: int, head_dim: int):
    """(q, k, v) as LitGPT makes them from x (B, S, K) and the fused projection's weight: qkv = x weight^T split
    by qkv_head_views, q and k roped by rope_reference, all in float64 (a reference for linear_rope)."""
    qkv = x.double() @ weight.double().t()
    q, k, v = qkv_head_views(qkv, q_heads, kv_heads, head_dim)
    return rope_reference(q, cos.double(), sin.double()), rope_reference(k, cos.double(), sin.double()), v


def linear_rope_unsupported(x, weight, cos, sin, q_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why linear_rope cannot take these (metadata only: tensors, or claim_rules.TensorMetadata), or None."""
    if x.ndim != 3 or weight.ndim != 2:
        return f"x must be (B, S, K) and the weight (N, K); got {x.ndim}-D and {weight.ndim}-D"
    if head_dim not in ROPE_HEAD_DIMS:
        return f"the rotary epilogue takes heads of {', '.join(map(str, ROPE_HEAD_DIMS))} columns, not {head_dim}"
    if weight.shape[0] != (q_heads + 2 * kv_heads) * head_dim or weight.shape[1] != x.shape[2]:
        return (f"a ({(q_heads + 2 * kv_heads) * head_dim}, {x.shape[2]}) weight expected for {q_heads} + 2 x "
                f"{kv_heads} heads of {head_dim}; got {tuple(weight.shape)}")
    if cos.ndim != 2 or tuple(sin.shape) != tuple(cos.shape):
        return f"cos and sin must be 2-D and alike; got {tuple(cos.shape)} and {tuple(sin.shape)}"
    n = cos.shape[1]
    if n < 16 or n > head_dim or n & (n - 1):
        return f"the rotary epilogue turns a power of two of columns from 16 to the head dim ({head_dim}); got {n}"
    if cos.shape[0] < x.shape[1]:
        return f"cos and sin have {cos.shape[0]} positions for {x.shape[1]} tokens"
    if x.dtype != weight.dtype or x.dtype not in _GEMM_DTYPES:
        return f"x and the weight must share one 16-bit dtype; got {x.dtype} and {weight.dtype}"
    tables = (x.dtype, torch.float32) if x.dtype == torch.bfloat16 else (x.dtype,)  # fp32 with bf16: bf16-mixed's
    if cos.dtype != sin.dtype or cos.dtype not in tables:
        return (f"cos and sin must both be {' or '.join(map(str, tables))} with {x.dtype} x; got {cos.dtype} and "
                f"{sin.dtype}")
    if x.shape[2] % 8:
        return f"K ({x.shape[2]}) must be a multiple of 8"
    return gemm_dims_unsupported(M=x.shape[0] * x.shape[1], N=weight.shape[0], K=x.shape[2])


def linear_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
                kv_heads: int, head_dim: int, *, _tile_n: int = 0, _epilogue: int = 0):
    """q, k and v of an attention layer from its fused qkv projection in one GEMM: qkv = x weight^T (x (B, S, K),
    weight ((q_heads + 2 kv_heads) head_dim, K), no bias) with LitGPT's rotate-half rotary embedding (rope_reference:
    the first n = cos.shape[1] columns of each head, token s at row s of cos and sin) applied to q's and k's heads
    in the epilogue, from the fp32 accumulators, rounded once. Returns (q, k, v) as (B, H, S, head_dim) views of
    the one (B, S, N) output (qkv_head_views), which tk's attention reads in place. head_dim 64, 128 or 256; n a
    power of two from 16 to head_dim; cos and sin (>= S, n) in x's dtype, or float32 with bf16 x (bf16-mixed
    training's tables, read as they are). `_tile_n` and `_epilogue`: gemm's tuning knobs, for tests."""
    for name, t in (("x", x), ("weight", weight), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_rope: {name} must be a tensor")
    if (reason := linear_rope_unsupported(x, weight, cos, sin, q_heads, kv_heads, head_dim)) is not None:
        raise ValueError(f"linear_rope: {reason}")
    if not all(t.device == x.device for t in (weight, cos, sin)):
        raise ValueError(f"linear_rope: every tensor must be on {x.device}")
    ext = _require_kernels(x.device)
    B, S, K = x.shape
    N = weight.shape[0]
    qkv = torch.empty((B, S, N), dtype=x.dtype, device=x.device)
    if qkv.numel() == 0:
        return qkv_head_views(qkv, q_heads, kv_heads, head_dim)
    if K == 0:
        return qkv_head_views(qkv.zero_(), q_heads, kv_heads, head_dim)
    a = _k_major_rows(x.reshape(B * S, K))
    w = _k_major_rows(weight)
    # One row stride for both tables, rows of whole pairs aligned to a pair's bytes (the kernel loads a pair of columns
    # at a time); other tables are copied (S x n, small).
    n, fp32_tables = cos.shape[1], cos.dtype == torch.float32
    pair_bytes = 2 * cos.element_size()
    if cos.stride(0) != sin.stride(0) or cos.shape[0] == 1 or not all(
            t.stride(1) == 1 and t.stride(0) >= n and t.stride(0) % 2 == 0 and t.data_ptr() % pair_bytes == 0
            for t in (cos, sin)):
        cos, sin = cos[:S].contiguous(), sin[:S].contiguous()
    with _on(x.device):
        ext.gemm_rope(a.data_ptr(), w.data_ptr(), qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      _DTYPE_CODES[x.dtype], B * S, N, K, a.stride(0) if B * S > 1 else K,
                      w.stride(0) if N > 1 else K, N, cos.stride(0), S, (q_heads + kv_heads) * head_dim, head_dim, n,
                      fp32_tables, _stream_handle(x.device), _tile_n, _epilogue)
    return qkv_head_views(qkv, q_heads, kv_heads, head_dim)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T (+ bias): `torch.nn.functional.linear` on the tk GEMM."""
    if weight.ndim != 2:
        raise ValueError(f"linear expects a 2-D weight; got {weight.ndim}-D")
    lead = x.shape[:-1]
    y = gemm(x.reshape(math.prod(lead), x.shape[-1]), weight.t(), bias)  # not (-1, K): torch refuses it at K = 0
    return y.reshape(*lead, weight.shape[0])


def _k_major_rows(t: torch.Tensor) -> torch.Tensor:
    """t (rows, K) as the kernels read it K-major: unit stride along K, a row stride that is a multiple of 8 and a
    16-byte aligned start; copied to fresh row-major storage where it is not (a clone: t.contiguous() is t itself
    where t is contiguous but starts off a 16-byte boundary)."""
    rows = t.shape[0]
    if t.data_ptr() % 16 == 0 and (t.shape[1] <= 1 or t.stride(1) == 1) and (rows <= 1 or t.stride(0) % 8 == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def check_swiglu_args(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """What swiglu_linear accepts, from metadata alone: x (..., K) and two (N, K) weights of one shape, one 16-bit
    dtype, one CUDA device, K and N multiples of 8 (any strides: the wrapper copies what TMA cannot read)."""
    for name, w in (("w1", w1), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.ndim != 2:
            raise ValueError(f"swiglu_linear: {name} must be a 2-D (N, K) weight")
    if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[-1] != w1.shape[1] or w1.shape != w2.shape:
        raise ValueError(f"swiglu_linear: x (..., K) and two (N, K) weights of one shape expected; got "
                         f"{tuple(getattr(x, 'shape', ()))}, {tuple(w1.shape)}, {tuple(w2.shape)}")
    if x.dtype not in _GEMM_DTYPES or w1.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"swiglu_linear: bfloat16 or float16 operands of one dtype; got {x.dtype}, {w1.dtype}, "
                         f"{w2.dtype}")
    if reason := gemm_dims_unsupported(M=math.prod(x.shape[:-1]), N=w1.shape[0], K=w1.shape[1]):
        raise ValueError(f"swiglu_linear: {reason}")
    if x.device.type != "cuda" or w1.device != x.device or w2.device != x.device:
        raise ValueError(f"swiglu_linear runs on CUDA tensors on one device; got {x.device}, {w1.device}, "
                         f"{w2.device}")
    N, K = w1.shape
    if K % 8 or N % 8:
        raise ValueError(f"swiglu_linear: K ({K}) and N ({N}) must be multiples of 8")


def swiglu_linear(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, _schedule: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(g, h1, h2) with h1 = x W1^T, h2 = x W2^T and g = silu(h1) * h2, by one tk launch: LLaMA's SwiGLU MLP up to
    its output projection. x (..., K); w1, w2 (N, K); each result (..., N) in x's dtype, rounded as PyTorch rounds
    the unfused ops (h1 and h2 from fp32 accumulators, silu(h1) before the product). K and N multiples of 8.
    `_schedule` as gemm's (tests)."""
    check_swiglu_args(x, w1, w2)
    N, K = w1.shape
    ext = _require_kernels(x.device)
    lead = x.shape[:-1]
    M = math.prod(lead)
    h1, h2, g = (torch.empty((*lead, N), dtype=x.dtype, device=x.device) for _ in range(3))
    if M == 0 or N == 0:
        return g, h1, h2
    if K == 0:
        return g.zero_(), h1.zero_(), h2.zero_()
    a = _k_major_rows(x.reshape(M, K))
    w1, w2 = _k_major_rows(w1), _k_major_rows(w2)
    if N > 1 and w1.stride(0) != w2.stride(0):  # one map layout for both weights
        w1, w2 = w1.contiguous(), w2.contiguous()
    with _on(x.device):
        ext.gemm_swiglu(a.data_ptr(), w1.data_ptr(), w2.data_ptr(), h1.data_ptr(), h2.data_ptr(), g.data_ptr(),
                        _DTYPE_CODES[x.dtype], M, N, K, a.stride(0) if M > 1 else K, w1.stride(0) if N > 1 else K,
                        N, _stream_handle(x.device), _gemm_tickets(x.device, _schedule))
    return g, h1, h2


def check_swiglu_grad_args(a: torch.Tensor, b: torch.Tensor, h1: torch.Tensor, h2: torch.Tensor) -> None:
    """What matmul_swiglu_grad accepts, from metadata alone: a GEMM's a (M, K) and b (K, N) (check_gemm_args), h1
    and h2 of a's dtype and device, one shape (..., N) with M rows in all, N a multiple of 8."""
    check_gemm_args(a, b, None)
    M, N = a.shape[0], b.shape[1]
    for name, h in (("h1", h1), ("h2", h2)):
        if not isinstance(h, torch.Tensor) or h.dtype != a.dtype or h.device != a.device:
            raise ValueError(f"matmul_swiglu_grad: {name} must be a {a.dtype} tensor on {a.device}")
    if h1.shape != h2.shape or h1.ndim < 1 or h1.shape[-1] != N or math.prod(h1.shape[:-1]) != M:
        raise ValueError(f"matmul_swiglu_grad: h1 and h2 must be (..., {N}) with {M} rows; got {tuple(h1.shape)}, "
                         f"{tuple(h2.shape)}")
    if N % 8:
        raise ValueError(f"matmul_swiglu_grad: N ({N}) must be a multiple of 8")


def matmul_swiglu_grad(a: torch.Tensor, b: torch.Tensor, h1: torch.Tensor, h2: torch.Tensor, *, _pingpong: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh1, dh2): SwiGLU's backward through its output projection by one tk launch. With dg = a @ b, the gradient
    of g = silu(h1) * h2 (never written), dh1 = dg * h2 * silu'(h1) and dh2 = dg * silu(h1), each computed in fp32
    from dg's fp32 accumulators (unrounded) and the 16-bit h1 and h2, and rounded once. a (M, K) (rows of the
    incoming gradient), b (K, N) (the output projection's weight); h1, h2 (..., N) with M rows in all; results in
    h1's shape and dtype. N a multiple of 8. `_pingpong` (experiments): 0 or 1 the consumer warpgroups take whole
    128 x 128 tiles in turns, so one's elementwise epilogue runs under the other's products; -1 they share each
    tile."""
    check_swiglu_grad_args(a, b, h1, h2)
    M, K = a.shape
    N = b.shape[1]
    ext = _require_kernels(a.device)
    dh1, dh2 = (torch.empty_like(h, memory_format=torch.contiguous_format) for h in (h1, h2))
    if M == 0 or N == 0:
        return dh1, dh2
    if K == 0:  # dg = 0
        return dh1.zero_(), dh2.zero_()
    a = _k_major_rows(a)
    b, (b_sn, b_sk) = _as_read(b, 0)
    # One row stride for h1, h2 and the outputs (N: contiguous rows); the forward's products are already so.
    h1, h2 = (h.reshape(M, N) for h in (h1, h2))
    h1, h2 = (h if h.is_contiguous() and h.data_ptr() % 16 == 0 else h.clone(memory_format=torch.contiguous_format)
              for h in (h1, h2))
    with _on(a.device):
        ext.gemm_swiglu_grad(a.data_ptr(), b.data_ptr(), h1.data_ptr(), h2.data_ptr(), dh1.data_ptr(),
                             dh2.data_ptr(), _DTYPE_CODES[a.dtype], M, N, K, a.stride(0) if M > 1 else K, b_sk, b_sn,
                             N, _stream_handle(a.device), _pingpong)
    return dh1, dh2


# ------------------------------------------------------------------------------------------------
# Cross-entropy over the classes of (rows, classes) logits, fused: fp32 math on 16-bit logits without an fp32 copy.

CROSS_ENTROPY_REDUCTIONS = ("mean", "sum", "none")


def check_cross_entropy_args(logits: torch.Tensor, target: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError("cross_entropy expects tensors (logits, target)")
    if logits.ndim != 2:
        raise ValueError(f"cross_entropy expects (rows, classes) logits; got {logits.ndim}-D")
    if target.ndim != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(f"target must be 1-D with {logits.shape[0]} class indices; got shape {tuple(target.shape)}")
    if logits.dtype not in _DTYPE_CODES:
        raise ValueError(f"cross_entropy supports bfloat16, float16 and float32 logits, not {logits.dtype}")
    if target.dtype != torch.int64:
        raise ValueError(f"target must hold int64 class indices; got {target.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("cross_entropy needs at least one class")
    if logits.device.type != "cuda" or target.device != logits.device:
        raise ValueError(f"cross_entropy runs on CUDA tensors on one device; got {logits.device} and {target.device}")


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference of cross_entropy_forward on any device: per row (lse - logits[target], lse), the loss 0
    where target == ignore_index and NaN where a target is outside [0, classes)."""
    x = logits.double()
    classes = x.shape[1]
    lse = torch.logsumexp(x, dim=1)
    valid = (target >= 0) & (target < classes)
    picked = x.gather(1, target.clamp(0, classes - 1).unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - picked, torch.full_like(lse, float("nan")))
    return torch.where(target == ignore_index, torch.zeros_like(loss), loss), lse


def _cross_entropy_operands(logits: torch.Tensor, target: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The logits with unit class stride (copied if not), contiguous targets and the logits' row stride as the
    kernels take it (a single row's is its width)."""
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    return logits, target.contiguous(), logits.stride(0) if logits.shape[0] > 1 else logits.shape[1]


def cross_entropy_forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (lse - logits[target], lse), fp32 (rows,), by the tk kernel; loss 0 where target == ignore_index and
    NaN where a target is outside [0, classes) (PyTorch would assert on the device)."""
    check_cross_entropy_args(logits, target)
    ext = _require_kernels(logits.device)
    logits, target, row_stride = _cross_entropy_operands(logits, target)
    rows, classes = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    with _on(logits.device):
        ext.cross_entropy_forward(logits.data_ptr(), target.data_ptr(), loss.data_ptr(), lse.data_ptr(),
                                  _DTYPE_CODES[logits.dtype], rows, classes, row_stride, int(ignore_index),
                                  _stream_handle(logits.device))
    return loss, lse


def cross_entropy_backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor,
                           ignore_index: int = -100) -> torch.Tensor:
    """d loss / d logits = grad_loss[r] * (softmax(logits[r]) - onehot(target[r])), in the logits' dtype; zero rows
    where target == ignore_index. `grad_loss` is fp32 (rows,), any stride (an expanded scalar has stride 0)."""
    check_cross_entropy_args(logits, target)
    rows = logits.shape[0]
    for name, t in (("lse", lse), ("grad_loss", grad_loss)):
        if t.dtype != torch.float32 or tuple(t.shape) != (rows,) or t.device != logits.device:
            raise ValueError(f"{name} must be float32 of shape ({rows},) on {logits.device}; "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    ext = _require_kernels(logits.device)
    logits, target, row_stride = _cross_entropy_operands(logits, target)
    lse = lse.contiguous()
    classes = logits.shape[1]
    grad = torch.empty((rows, classes), dtype=logits.dtype, device=logits.device)
    with _on(logits.device):
        ext.cross_entropy_backward(logits.data_ptr(), target.data_ptr(), lse.data_ptr(), grad_loss.data_ptr(),
                                   grad_loss.stride(0) if rows > 1 else 0, grad.data_ptr(), classes,
                                   _DTYPE_CODES[logits.dtype], rows, classes, row_stride, int(ignore_index),
                                   _stream_handle(logits.device))
    return grad


def cross_entropy_forward_grad_unsupported(logits: torch.Tensor) -> str | None:
    """Why `cross_entropy_forward_grad` would take two kernels for these logits (None: one), at any part size."""
    per_vector = 16 // logits.element_size()
    rows, classes = logits.shape
    if classes % per_vector or (rows > 1 and logits.stride(0) % per_vector) or logits.data_ptr() % 16:
        return "rows not whole 16-byte vectors on 16-byte boundaries"
    if classes > 1 and logits.stride(1) != 1:
        return "classes not contiguous"
    ext = _extension.extension()
    if ext is None:
        return "the tk kernels are not built"
    if classes > ext.cross_entropy_forward_grad_max_classes(_DTYPE_CODES[logits.dtype]):
        return "a row too long to keep on chip"
    return None


def cross_entropy_forward_grad(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, *,
                               overwrite: bool = False,
                               _part_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss rows, lse, grad) with grad = softmax(logits) - onehot(target) unscaled (zero rows where target ==
    ignore_index), from one read of the logits: each row stays on chip between its two passes. The incoming
    gradient g scales the rows of what reads grad (g * (grad W), grad^T (g * X)). Logits it cannot keep on chip
    (`cross_entropy_forward_grad_unsupported`) take the forward and backward kernels.

    overwrite=True writes grad over the logits and returns the logits tensor as grad, for callers that know nothing
    else reads the logits afterwards (saves a logits-sized buffer). The logits' rows must not overlap; logits the
    kernel cannot read in place (e.g. a transposed view) get the gradient copied over them.

    _part_bytes (benchmarks and tests): the most bytes of a row one block of the cluster holds, > 0 (past 200 KB,
    200 KB); each row takes the fewest parts (up to 8) within it, one block where the row fits one part. None: the
    kernel's default, 64 KB."""
    if _part_bytes is not None and _part_bytes <= 0:  # checked here too: the fallback below would not say it
        raise ValueError(f"cross_entropy_forward_grad: _part_bytes must be > 0 (None: the kernel's default), "
                         f"got {_part_bytes}")
    check_cross_entropy_args(logits, target)
    rows, classes = logits.shape
    if overwrite and rows > 1 and classes > 1 and logits.stride(1) == 1 and logits.stride(0) < classes:
        raise ValueError(f"cross_entropy_forward_grad(overwrite=True): the logits' rows overlap (row stride "
                         f"{logits.stride(0)} < {classes} classes)")
    if rows == 0 or cross_entropy_forward_grad_unsupported(logits) is not None:
        loss, lse = cross_entropy_forward(logits, target, ignore_index)
        ones = torch.ones((), dtype=torch.float32, device=logits.device).expand(rows)
        grad = cross_entropy_backward(logits, target, lse, ones, ignore_index)
        return loss, lse, logits.copy_(grad) if overwrite else grad
    ext = _require_kernels(logits.device)
    logits, target, row_stride = _cross_entropy_operands(logits, target)  # unit class stride already (checked)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    grad = logits if overwrite else torch.empty((rows, classes), dtype=logits.dtype, device=logits.device)
    part_bytes = () if _part_bytes is None else (int(_part_bytes),)  # left out: the binding's default
    with _on(logits.device):
        ext.cross_entropy_forward_grad(logits.data_ptr(), target.data_ptr(), loss.data_ptr(), lse.data_ptr(),
                                       grad.data_ptr(), row_stride if overwrite else classes,
                                       _DTYPE_CODES[logits.dtype], rows, classes, row_stride, int(ignore_index),
                                       _stream_handle(logits.device), *part_bytes)
    return loss, lse, grad


def scale_rows(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """t (rows, n) with row r times g[r] (any stride), computed in fp32, in t's dtype.

    One elementwise kernel reads t in its own dtype and g in fp32 and computes in fp32 (PyTorch's mixed-dtype
    arithmetic): no fp32 copy of t, which where the scaling is not folded into a GEMM is the whole logits-sized
    gradient (the copy and the multiply were two kernels, 0.27 ms of a 16-layer Llama-3.2-1B step)."""
    if t.ndim != 2 or g.ndim != 1 or g.shape[0] != t.shape[0]:
        raise ValueError(f"scale_rows takes (rows, n) and (rows,); got {tuple(t.shape)} and {tuple(g.shape)}")
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return torch.mul(t, g.float().unsqueeze(1), out=out)  # g is a vector: converting it costs nothing


def reduce_cross_entropy(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                         dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's reductions of the per-row losses: mean over the rows not ignored, sum, or none; in `dtype`."""
    if reduction == "none":
        return rows.to(dtype)
    if reduction == "sum":
        return rows.sum().to(dtype)
    if reduction == "mean":
        return (rows.sum() / (target != ignore_index).sum()).to(dtype)
    raise ValueError(f"reduction must be one of {CROSS_ENTROPY_REDUCTIONS}; got {reduction!r}")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """`torch.nn.functional.cross_entropy(logits, target)` (2-D logits, class indices) forward only, by the tk kernel;
    the loss in the logits' dtype, computed in fp32."""
    if reduction not in CROSS_ENTROPY_REDUCTIONS:
        raise ValueError(f"reduction must be one of {CROSS_ENTROPY_REDUCTIONS}; got {reduction!r}")
    rows, _ = cross_entropy_forward(logits, target, ignore_index)
    return reduce_cross_entropy(rows, target, ignore_index, reduction, logits.dtype)


# AdamW's update (thunder_tk.optim.AdamW is the optimizer around it)

ADAMW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def adamw_unsupported(param, grad, exp_avg, exp_avg_sq) -> str | None:
    """Why adamw_step cannot update this parameter with these tensors (metadata only), or None: the kernel reads
    the four as flat arrays of one dtype, so they must be plain dense contiguous tensors, alike and on one CUDA
    device."""
    if param.dtype not in ADAMW_DTYPES:
        return f"dtype {param.dtype} not in {{bfloat16, float16, float32}}"
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.layout != torch.strided:
            return f"{name} is {t.layout}, not dense"
        if t.dtype != param.dtype:
            return f"{name} is {t.dtype}, the parameter {param.dtype}"
        if tuple(t.shape) != tuple(param.shape):
            return f"{name} {tuple(t.shape)} is not shaped like the parameter {tuple(param.shape)}"
        if t.device != param.device:
            return f"{name} is on {t.device}, the parameter on {param.device}"
    if param.device.type != "cuda":
        return f"the parameter is on {param.device}, not a CUDA device"
    four = (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))
    for name, t in four:
        if not t.is_contiguous():
            return f"{name} is not contiguous (strides {tuple(t.stride())})"
    for name, t in four:
        if type(t) not in _PLAIN_TENSORS:  # e.g. FSDP2's DTensor: no flat local storage
            return f"{name} is a {type(t).__name__}, not a plain tensor"
    return None


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, step: int | float, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, maximize: bool = False, grad_sq_norm: torch.Tensor | None = None,
               max_norm: float | None = None) -> None:
    """One AdamW update in place over lists of parameters, their gradients and moment buffers (entry i of each list
    belongs together), all of one dtype on one device: what torch.optim.AdamW(fused=True) computes in torch 2.11,
    operation for operation in fp32 (decoupled weight decay, no AMSGrad), with `step` the count after this step's
    increment (1 on the first). One pass over the tensors, 256 of them a launch, enqueued on the device's current
    stream.

    With `grad_sq_norm` (a one-element float32 tensor on the device: the squared global norm, e.g. sq_norm's over
    every gradient) and `max_norm`, the update reads each gradient clipped as torch.nn.utils.clip_grad_norm_(...,
    max_norm) leaves it for that norm: multiplied by min(1, max_norm / (norm + 1e-6)) in its dtype. The gradients
    are not written. The norm is read on the device: nothing waits for it."""
    if not step >= 1:
        raise ValueError(f"adamw_step: step must be at least 1 (counted before the update); got {step}")
    lists = (list(params), list(grads), list(exp_avgs), list(exp_avg_sqs))
    if (why := _clip_unsupported(grad_sq_norm, max_norm, lists[0][0].device if lists[0] else None)) is not None:
        raise ValueError(f"adamw_step: {why}")
    if len({len(x) for x in lists}) != 1:
        raise ValueError("adamw_step: params, grads, exp_avgs and exp_avg_sqs differ in length "
                         f"({', '.join(str(len(x)) for x in lists)})")
    if not lists[0]:
        return
    if not adamw_lists_alike(*lists):  # the usual case passes in bulk; otherwise name the first entry at fault
        device, dtype = lists[0][0].device, lists[0][0].dtype
        for i, (p, g, m, v) in enumerate(zip(*lists)):
            if (reason := adamw_unsupported(p, g, m, v)) is not None:
                raise ValueError(f"adamw_step: entry {i}: {reason}")
            if p.device != device or p.dtype != dtype:
                raise ValueError(f"adamw_step: entry {i} is {p.dtype} on {p.device}, entry 0 {dtype} on {device}")
    _adamw_launch(_require_kernels(lists[0][0].device), *lists, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, maximize=maximize, grad_sq_norm=grad_sq_norm, max_norm=max_norm)


def _clip_unsupported(grad_sq_norm, max_norm, device) -> str | None:
    """Why adamw_step cannot clip by this squared norm and max_norm, or None (also when neither is given)."""
    if grad_sq_norm is None and max_norm is None:
        return None
    if grad_sq_norm is None or max_norm is None:
        return "grad_sq_norm and max_norm go together"
    if (why := max_norm_unsupported(max_norm)) is not None:
        return why
    if not isinstance(grad_sq_norm, torch.Tensor) or grad_sq_norm.dtype != torch.float32 or grad_sq_norm.numel() != 1:
        return "grad_sq_norm must be a one-element float32 tensor"
    if device is not None and grad_sq_norm.device != device:
        return f"grad_sq_norm is on {grad_sq_norm.device}, the parameters on {device}"
    return None


def max_norm_unsupported(max_norm) -> str | None:
    """Why `max_norm` cannot bound a gradient norm (clipping), or None: a positive number."""
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
        return f"max_norm must be a positive number; got {max_norm!r}"
    return None


_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_dtype_of, _layout_of, _is_cuda = (operator.attrgetter(a) for a in ("dtype", "layout", "is_cuda"))


def _on_one_gpu(tensors) -> bool:
    """Whether every tensor (a non-empty list) is on one CUDA device, in bulk: `is_cuda` and `get_device` are plain
    values, where `Tensor.device` builds an object per tensor (about 90 ns against 35)."""
    return all(map(_is_cuda, tensors)) and len(set(map(torch.Tensor.get_device, tensors))) == 1


def _flat_on_one_gpu(tensors) -> bool:
    """Whether every tensor (a non-empty list) is a plain, dense, contiguous tensor, all on one CUDA device, in
    bulk: what the multi-tensor kernels (AdamW, sq_norm) need to read each as a flat array."""
    return (set(map(type, tensors)) <= _PLAIN_TENSORS and set(map(_layout_of, tensors)) == {torch.strided}
            and _on_one_gpu(tensors) and all(map(torch.Tensor.is_contiguous, tensors)))


def adamw_lists_alike(params, grads, exp_avgs, exp_avg_sqs) -> bool:
    """Whether every entry passes adamw_unsupported and all share entry 0's dtype and device, checked in bulk
    (C-level maps over the lists: about a microsecond a parameter, where the entry-by-entry checks take several;
    thunder_tk.optim.AdamW runs this every step). False says nothing about which entry fails."""
    everything = [*params, *grads, *exp_avgs, *exp_avg_sqs]
    if not everything:
        return True
    first = params[0]
    if first.dtype not in ADAMW_DTYPES or first.device.type != "cuda":
        return False
    size = torch.Tensor.size  # compared pair by pair: lists of sizes kept alive cost several times more
    return (set(map(_dtype_of, everything)) == {first.dtype} and _flat_on_one_gpu(everything)
            and all(all(map(operator.eq, map(size, params), map(size, other)))
                    for other in (grads, exp_avgs, exp_avg_sqs)))


def _adamw_launch(ext, params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay,
                  maximize, grad_sq_norm=None, max_norm=None) -> None:
    """adamw_step's launch, for callers that checked the entries already (thunder_tk.optim.AdamW, every step)."""
    ptrs = torch.Tensor.data_ptr
    _adamw_launch_ptrs(ext, params[0].device, params[0].dtype, list(map(ptrs, params)), list(map(ptrs, grads)),
                       list(map(ptrs, exp_avgs)), list(map(ptrs, exp_avg_sqs)), list(map(torch.Tensor.numel, params)),
                       step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                       maximize=maximize, grad_sq_norm=grad_sq_norm, max_norm=max_norm)


def _adamw_launch_ptrs(ext, device: torch.device, dtype: torch.dtype, params, grads, exp_avgs, exp_avg_sqs, numels,
                       *, step, lr, beta1, beta2, eps, weight_decay, maximize, grad_sq_norm=None,
                       max_norm=None) -> None:
    """_adamw_launch from the tensors' addresses and element counts (lists of ints): what thunder_tk.optim.AdamW's
    kept plan hands over, reading only the gradients' addresses afresh."""
    with _on(device):
        ext.adamw(params, grads, exp_avgs, exp_avg_sqs, numels, _DTYPE_CODES[dtype], float(lr), float(beta1),
                  float(beta2), float(eps), float(weight_decay), float(step), bool(maximize),
                  0 if grad_sq_norm is None else grad_sq_norm.data_ptr(), 0.0 if max_norm is None else float(max_norm),
                  _stream_handle(device))


# The squared global norm of many tensors (clipping by norm; thunder_tk.optim.AdamW.clip_grad_norm_)

def sq_norm_unsupported(t) -> str | None:
    """Why sq_norm cannot read this tensor (metadata only), or None: the kernel reads it as a flat array."""
    if type(t) not in _PLAIN_TENSORS:
        return f"a {type(t).__name__}, not a plain tensor"
    if t.layout != torch.strided:
        return f"{t.layout}, not dense"
    if t.dtype not in ADAMW_DTYPES:
        return f"dtype {t.dtype} not in {{bfloat16, float16, float32}}"
    if t.device.type != "cuda":
        return f"on {t.device}, not a CUDA device"
    if not t.is_contiguous():
        return f"not contiguous (strides {tuple(t.stride())})"
    return None


def sq_norm_list_alike(tensors) -> bool:
    """Whether every tensor passes sq_norm_unsupported and all are on one device, checked in bulk."""
    if not tensors:
        return True
    return set(map(_dtype_of, tensors)) <= set(ADAMW_DTYPES) and _flat_on_one_gpu(tensors)


def sq_norm(tensors, *, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """The sum of squares of every element of `tensors`, in fp32, as a 0-d tensor on their device: the square of
    their global L2 norm (what clipping by norm needs; squares of shards add up across ranks). The tensors are dense
    and contiguous, bfloat16, float16 or float32 (mixed), on one CUDA device. The same bits on every call on one
    GPU (no atomics). `out` (a one-element float32 tensor on the device) receives the sum, or adds it to its value
    where `accumulate`. Enqueued on the device's current stream: nothing waits."""
    tensors = list(tensors)
    if not sq_norm_list_alike(tensors):
        for i, t in enumerate(tensors):
            if (reason := sq_norm_unsupported(t)) is not None:
                raise ValueError(f"sq_norm: entry {i} is {reason}")
            if t.device != tensors[0].device:
                raise ValueError(f"sq_norm: entry {i} is on {t.device}, entry 0 on {tensors[0].device}")
    if out is None:
        if not tensors:
            raise ValueError("sq_norm: no tensors and no `out` to say which device the sum belongs on")
        out = torch.empty((), dtype=torch.float32, device=tensors[0].device)  # written, not added to
        accumulate = False
    elif out.dtype != torch.float32 or out.numel() != 1 or (tensors and out.device != tensors[0].device):
        raise ValueError("sq_norm: out must be a one-element float32 tensor on the tensors' device")
    if not tensors:
        if not accumulate:
            out.zero_()
        return out
    _sq_norm_launch(_require_kernels(out.device), tensors, out, accumulate)
    return out


def _sq_norm_launch(ext, tensors, out: torch.Tensor, accumulate: bool) -> None:
    """sq_norm's launches for checked tensors: one per dtype, each adding to what the one before wrote."""
    if len(set(map(_dtype_of, tensors))) == 1:
        by_dtype = {tensors[0].dtype: tensors}  # the usual case, without a loop over the tensors
    else:
        by_dtype = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
    device = out.device
    with _on(device):
        stream = _stream_handle(device)
        for dtype, group in by_dtype.items():
            size = ext.sq_norm_workspace(len(group))
            workspace = torch.empty(size, dtype=torch.float32, device=device)
            ext.sq_norm(list(map(torch.Tensor.data_ptr, group)), list(map(torch.Tensor.numel, group)),
                        _DTYPE_CODES[dtype], workspace.data_ptr(), size, out.data_ptr(), accumulate, stream)
            accumulate = True
