"""Settings that tk reads from the environment (THUNDER_TK_*) as one word out of a fixed set, all listed here with
their meaning, so that `thunder-tk info` can show what is in effect. Each is checked as it is read: a misspelt value
is an error that names the variable and its choices, never a silent default. (The collectives' numeric settings,
THUNDER_TK_COLLECTIVE_*, are collectives.ChannelConfig's; THUNDER_TK_DISABLE is claim_rules'.)"""

from __future__ import annotations

import os
from dataclasses import dataclass


def env_word(name: str, default: str) -> str:
    """A lower-case word from the environment; unset or blank gives `default`."""
    return os.environ.get(name, "").strip().lower() or default


def env_choice(name: str, choices: tuple[str, ...], default: str, requested: str | None = None) -> str:
    """`requested` where given, else the variable `name` (env_word), checked against `choices`; the error names the
    variable whichever way the value came."""
    value = requested if requested is not None else env_word(name, default)
    if value not in choices:
        listed = " or ".join(choices) if len(choices) == 2 else "one of " + ", ".join(choices)
        raise ValueError(f"{name}={value!r}: expected {listed}")
    return value


@dataclass(frozen=True)
class Setting:
    name: str
    choices: tuple[str, ...]
    default: str
    meaning: str

    def read(self, requested: str | None = None) -> str:
        """The value in effect (read on every call): `requested`, else the environment's, else the default."""
        return env_choice(self.name, self.choices, self.default, requested)

    def describe(self) -> str:
        """One line for `thunder-tk info`: the value in effect and where it came from, or why it is invalid."""
        raw = os.environ.get(self.name, "").strip()
        try:
            value = self.read()
        except ValueError as e:
            return f"{self.name}: invalid ({e})"
        origin = "set" if raw else "default"
        return f"{self.name}={value} ({origin}; {' | '.join(self.choices)}): {self.meaning}"


DQ_FINALIZE = Setting("THUNDER_TK_DQ_FINALIZE", ("auto", "pass", "overlap"), "auto",
                      "the attention backward rounds dQ after its kernel (pass) or beside the kernel's last wave "
                      "(overlap); auto overlaps without a causal mask")
DQ_ZERO = Setting("THUNDER_TK_DQ_ZERO", ("auto", "pass", "ahead"), "auto",
                  "the attention backward's fp32 dQ accumulator is zeroed by its delta pass (pass) or by the previous "
                  "backward's kernel on the stream (ahead, two accumulators a stream); auto is ahead")
ATTN_DELTA_ROWS = Setting("THUNDER_TK_ATTN_DELTA_ROWS", ("auto", "1", "2", "4"), "auto",
                          "rows each lane group of the attention backward's delta pass (rowsum(dO O)) sums a step: "
                          "more loads in flight a thread, more registers, fewer blocks a multiprocessor; auto is 1")
ATTN_BWD_TAIL_SPLIT = Setting("THUNDER_TK_ATTN_BWD_TAIL_SPLIT", ("auto", "off"), "auto",
                              "the attention backward walks its last wave's units in query ranges where that fills "
                              "the GPU (auto), or every unit whole (off, for measurement)")
GEMM_SCHEDULE = Setting("THUNDER_TK_GEMM_SCHEDULE", ("static", "dynamic"), "static",
                        "tk's GEMMs hand out tiles by block index (static) or from a counter as blocks get to them "
                        "(dynamic: blocks that start late, on SMs another kernel held, take fewer)")
COLLECTIVE_KEEP = Setting("THUNDER_TK_COLLECTIVE_KEEP", ("wait", "record"), "wait",
                          "an asynchronous tk collective keeps its tensors until its wait() (wait), or lets the "
                          "caching allocator track them by stream (record)")
GEMM_FP32_OUT = Setting("THUNDER_TK_GEMM_FP32_OUT", ("0", "1"), "0",
                        "under bf16-mixed, GEMMs whose bf16 result is only cast to fp32 write fp32 directly (1) or "
                        "stay bf16 (0)")
CPU_AFFINITY = Setting("THUNDER_TK_CPU_AFFINITY", ("none", "exclusive"), "none",
                       "thunder-tk pretrain: each rank on its own share of the CPUs near its GPU (exclusive)")

SETTINGS = (DQ_FINALIZE, DQ_ZERO, ATTN_DELTA_ROWS, ATTN_BWD_TAIL_SPLIT, GEMM_SCHEDULE, COLLECTIVE_KEEP, GEMM_FP32_OUT,
            CPU_AFFINITY)
