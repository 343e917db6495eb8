"""Runs attention forward (and backward) cases each in a child process with a time limit, so that a kernel hang is
reported per shape instead of stopping the run: `python scripts/attention_hang_probe.py [--backward]`."""
import subprocess
import sys

CASES = [  # (B, Hq, Hkv, Sq, Sk, D, causal, max_blocks)
    (1, 1, 1, 256, 256, 64, False, 1),
    (1, 1, 1, 256, 256, 128, False, 1),
    (1, 1, 1, 384, 384, 128, True, 1),
    (1, 2, 1, 1000, 1000, 64, False, 3),
    (2, 4, 2, 300, 300, 128, True, 5),
    (1, 1, 1, 128, 128, 64, False, 0),
    (2, 16, 2, 1000, 1000, 64, False, 0),
    (1, 8, 1, 1000, 1000, 128, True, 0),
    (16, 16, 16, 128, 128, 128, True, 0),
]

CHILD = r"""
import sys, torch
from thunder_tk import ops
B, Hq, Hkv, Sq, Sk, D, causal, mb, bwd = (int(x) for x in sys.argv[1:])
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g)
v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g)
o, lse = ops.attention_forward(q, k, v, is_causal=bool(causal), _max_blocks=mb)
torch.cuda.synchronize()
ro, rl = ops.attention_forward_reference(q, k, v, is_causal=bool(causal))
err = ((o.double() - ro).norm() / ro.norm()).item()
msg = f"fwd rel err {err:.2e}"
if bwd:
    go = torch.randn_like(o)
    dq, dk, dv = ops.attention_backward(q, k, v, o, lse, go, is_causal=bool(causal))
    torch.cuda.synchronize()
    refs = ops.attention_backward_reference(q, k, v, o, lse, go, is_causal=bool(causal))
    errs = [((a.double() - r).norm() / r.norm()).item() for a, r in zip((dq, dk, dv), refs)]
    msg += " bwd " + " ".join(f"{e:.2e}" for e in errs)
print(msg)
"""


def main():
    bwd = "--backward" in sys.argv
    bad = 0
    for case in CASES:
        args = [str(int(x)) for x in case] + [str(int(bwd))]
        try:
            r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=25)
            lines = (r.stdout.strip() or r.stderr.strip()).splitlines()
            out = lines[-1] if lines else ""  # the errors, or a failure's last line
            status = "ok" if r.returncode == 0 else f"rc={r.returncode}"
        except subprocess.TimeoutExpired:
            status, out = "HANG", ""
        bad += status != "ok"
        print(f"{status:6} {case} {out}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
