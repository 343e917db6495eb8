"""Representative launches of every kernel, for compute-sanitizer (memcheck, racecheck)."""

import torch

from thunder_tk import ops

for shape, dtype in [((2, 3, 17, 128), torch.bfloat16), ((1, 2, 9, 257), torch.float16), ((3, 1, 65, 8), torch.float32),
                     ((1, 4, 1000, 64), torch.bfloat16)]:
    o = torch.randn(shape, device="cuda", dtype=dtype)
    g = torch.randn_like(o)
    ops.attention_bwd_delta(o, g)
flat = torch.randn(1 + 2 * 3 * 11 * 64, device="cuda", dtype=torch.bfloat16)
o = flat[1:].view(2, 3, 11, 64)
ops.attention_bwd_delta(o, o)
torch.cuda.synchronize()
print("sanitize targets ran")

# GEMM: every operand major, tails in M/N/K, bias.
from thunder_tk import ops as _ops  # noqa: E402

for M, N, K in [(129, 257, 72), (64, 300, 128)]:
    for a in (torch.randn(M, K, device="cuda", dtype=torch.bfloat16), torch.randn(K, M, device="cuda", dtype=torch.bfloat16).t()):
        for b in (torch.randn(K, N, device="cuda", dtype=torch.bfloat16), torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()):
            _ops.gemm(a, b, torch.randn(N, device="cuda", dtype=torch.bfloat16))
            _ops.gemm(a, b, _schedule="dynamic")
            _ops.gemm(a, b, _cluster=2)
torch.cuda.synchronize()
print("gemm sanitize targets ran")
