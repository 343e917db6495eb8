"""`thunder-tk pretrain`: LitGPT models trained through Thunder with tk's executors, on a laptop CPU, one GPU
or many (torchrun + Thunder FSDP).

    thunder-tk pretrain --config litgpt_configs/tiny.yaml --train.max_steps 20
    torchrun --nproc_per_node 8 -m thunder_tk.cli pretrain --config litgpt_configs/llama-2-7b.yaml
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from thunder_tk.env_settings import CPU_AFFINITY
from thunder_tk.litgpt_checkpoint import (atomic_write, checkpoint_model_config, full_state_dict, load_initial_weights,
                                          resolve_dir, write_litgpt_checkpoint)
from thunder_tk.litgpt_models import (ConfigError, _litgpt, config_of, init_like_litgpt_pretrain, jit_unsupported,
                                      vectorize_window_masks)
from thunder_tk.pretrain_config import PretrainConfig, precision_of, world_size_of
from thunder_tk.step_profile import StepProfiler

# Dense bf16 tensor-core peaks by device name, for MFU. Unknown devices report no MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H20": 148e12, "A100": 312e12}


class LossModule(torch.nn.Module):
    """The model and its loss as one module, so Thunder traces the cross-entropy too."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        logits = self.model(idx)
        # The logits stay in the model's dtype: an fp32 copy of them (tokens x vocabulary, 4 GiB at 8192 tokens and
        # a 128k vocabulary) would be the step's largest tensor, and tk's cross-entropy computes in fp32 anyway.
        # Per-token losses in that dtype, averaged in fp32, keep the reported loss to ~1e-4 (a bf16 mean would
        # round it to 1/16 near 10).
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        return per_token.float().mean()


def autocast_for(autocast_dtype: str | None, device_type: str):
    """The context a precision's forward runs in (precision_of's autocast dtype): torch.autocast to it, which Thunder
    traces as casts, or nothing."""
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, autocast_dtype))


@contextlib.contextmanager
def tracing_without_cyclic_gc(active: bool = True):
    """Around the calls in which Thunder traces a model (its first calls). Thunder's interpreter can fail with
    "dictionary changed size during iteration" when the cyclic garbage collector frees a module in the middle of a
    trace and dynamo's registry of modules (a weak dict the interpreter walks) shrinks (lightning-thunder#2095;
    seen once in our CI). Collect first, then keep the cyclic collector off until the trace is done."""
    if not active:
        yield
        return
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class HostPhases:
    """Host seconds per phase of one step (data, forward, backward, clipping, optimizer), summed over its micro
    batches: where a step that stalls on the host spent the time (`host_phases` in the metrics)."""

    NAMES = ("batch", "forward", "backward", "clip", "optimizer")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.NAMES, 0.0)

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self.seconds.items()}


class AllocatorCounters:
    """The CUDA caching allocator's retries (a failed cudaMalloc: cached blocks freed, with a device-wide
    synchronisation) and its cudaMalloc/cudaFree calls since the last take; None off CUDA. Either can stall the
    host for as long as the GPU's queue takes to drain."""

    KEYS = {"alloc_retries": "num_alloc_retries", "device_allocs": "num_device_alloc",
            "device_frees": "num_device_free"}

    def __init__(self, device: torch.device):
        self.device = device if device.type == "cuda" else None
        self.last = self._read()

    def _read(self) -> dict[str, int] | None:
        if self.device is None:
            return None
        stats = torch.cuda.memory_stats(self.device)
        return {name: int(stats.get(key, 0)) for name, key in self.KEYS.items()}

    def take(self) -> dict[str, int | None]:
        now = self._read()
        if now is None:
            return dict.fromkeys(self.KEYS)
        out = {k: now[k] - self.last[k] for k in now}
        self.last = now
        return out


class OsCounters:
    """What the operating system did to this process since the last take: the main thread's CPU seconds (a step
    whose host time is long but whose CPU time is short waited: descheduled, blocked on a lock or in the kernel),
    its context switches (involuntary ones: preempted by other work), the process's page faults, and the host's
    direct memory compactions, direct reclaims and NUMA page migrations (each can hold a thread in a page fault).
    Linux only; elsewhere every value is None. Read from the main thread."""

    VMSTAT = {"compactions": ("compact_stall",), "reclaims": ("allocstall_normal", "allocstall_movable"),
              "numa_migrations": ("numa_pages_migrated",), "huge_page_faults": ("thp_fault_alloc",)}
    KEYS = ("main_thread_cpu_s", "voluntary_switches", "involuntary_switches", "minor_faults", "major_faults",
            *VMSTAT)

    def __init__(self):
        self.available = sys.platform.startswith("linux") and Path("/proc/thread-self/status").exists()
        self.last = self._read()

    def _read(self) -> dict[str, float] | None:
        if not self.available:
            return None
        try:
            out: dict[str, float] = {"main_thread_cpu_s": time.thread_time()}
            for line in Path("/proc/thread-self/status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    name, value = line.split(":")
                    out["voluntary_switches" if name.startswith("vol") else "involuntary_switches"] = int(value)
            # /proc/self/stat: the command name (field 2) may hold spaces; the fields after its ')' are fixed
            fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
            out["minor_faults"], out["major_faults"] = int(fields[7]), int(fields[9])
            vmstat = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
            for key, names in self.VMSTAT.items():
                out[key] = sum(int(vmstat.get(n, 0)) for n in names)
            return out
        except (OSError, ValueError, IndexError):
            self.available = False
            return None

    def take(self) -> dict[str, float | None]:
        """The counts since the last take (CPU seconds rounded to microseconds)."""
        now = self._read()
        if now is None:  # off Linux, or /proc stopped answering (then never again: `available`)
            return dict.fromkeys(self.KEYS)
        out = {k: now[k] - self.last[k] for k in self.KEYS}
        out["main_thread_cpu_s"] = round(out["main_thread_cpu_s"], 6)
        self.last = now
        return out


class StallTracer:
    """THUNDER_TK_STALL_TRACE=<seconds>: where a step's host work runs past that many seconds, faulthandler writes
    every thread's Python stack to out_dir/stall_traces.txt (this rank's). Its watchdog is a C thread that needs no
    GIL, so the stack shows where the main thread sat even if another thread held the interpreter."""

    def __init__(self, out_dir: Path, rank: int):
        raw = os.environ.get("THUNDER_TK_STALL_TRACE", "")
        try:
            self.seconds = float(raw) if raw else 0.0
        except ValueError:
            raise ConfigError(f"THUNDER_TK_STALL_TRACE={raw!r} is not a number of seconds") from None
        self.file, self.os, self.armed = None, None, False
        if self.seconds > 0:
            name = "stall_traces.txt" if rank == 0 else f"stall_traces.rank{rank}.txt"
            self.file = (out_dir / name).open("a")
            self.os = OsCounters()

    def arm(self, step: int) -> None:
        if self.file is not None:
            self.file.write(f"-- step {step + 1}: traces if its host work passes {self.seconds} s\n")
            self.file.flush()
            self.os.take()
            self.armed = True
            faulthandler.dump_traceback_later(self.seconds, repeat=False, file=self.file)

    def disarm(self, host_seconds: float | None = None) -> None:
        """Where the step's host work (`host_seconds`, as the metrics count it) ran past the threshold, also writes
        what the operating system did meanwhile (this rank's: the metrics are rank 0's alone)."""
        if self.armed:
            faulthandler.cancel_dump_traceback_later()
            self.armed = False
            counters = self.os.take()
            if host_seconds is not None and host_seconds > self.seconds:
                self.file.write(f"-- host work {host_seconds:.3f} s; the system meanwhile: {json.dumps(counters)}\n")
                self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.disarm()
            self.file.close()
            self.file = None


class GcClock:
    """Time the cyclic garbage collector spends, read per logging interval: a step that stalls on the host shows
    whether the collector was the cause (with `host_seconds`, in the metrics)."""

    def __init__(self):
        self.seconds, self.collections, self._start = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.collections += 1
            self._start = None

    def take(self) -> tuple[float, int]:
        """Seconds and collections since the last take."""
        out = (self.seconds, self.collections)
        self.seconds, self.collections = 0.0, 0
        return out

    @contextlib.contextmanager
    def installed(self):
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


# ------------------------------------------------------------------------------------------------
# Setup


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest `value` over the ranks of the default process group (`value` itself without one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def parse_cpulist(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def exclusive_cpus(local_rank: int, near: list[set[int] | None], allowed: set[int]) -> set[int]:
    """This local rank's share of the allowed CPUs: those near its GPU (`near[r]`, the GPU's NUMA-local CPUs, None
    where unknown) divided evenly, in order, among the local ranks whose GPUs are near the same CPUs. Where a GPU's
    neighbourhood is unknown or holds no allowed CPU, all local ranks share out the allowed CPUs instead. Never empty
    while `allowed` is not: with more ranks than CPUs, neighbours in rank order share one."""
    mine = near[local_rank] & allowed if near[local_rank] is not None else set()
    if not mine:
        group, pool = list(range(len(near))), sorted(allowed)
    else:
        group = [r for r, cpus in enumerate(near) if cpus is not None and cpus & allowed == mine]
        pool = sorted(mine)
    share, index = len(pool) / len(group), group.index(local_rank)
    chosen = set(pool[int(index * share):int((index + 1) * share)])
    return chosen or {pool[min(int(index * share), len(pool) - 1)]}


def gpu_local_cpus(device_index: int) -> set[int] | None:
    """The CPUs the system lists as local to a CUDA device (its PCI function's NUMA node), or None."""
    try:
        props = torch.cuda.get_device_properties(device_index)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return parse_cpulist(Path(f"/sys/bus/pci/devices/{bus}/local_cpulist").read_text()) or None
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None


def bind_cpus(local_rank: int, local_world: int) -> list[int] | None:
    """THUNDER_TK_CPU_AFFINITY=exclusive: this process (and what it starts later: inductor's compile workers, data
    threads) runs on its own share of the CPUs near its GPU, so that one rank's work cannot take another rank's cores
    (the 4-GPU hosts' once-per-process host stalls, benchmarks/NOTES.md). Unset or `none`: the affinity is left
    alone. Returns the CPUs bound, or None."""
    try:
        mode = CPU_AFFINITY.read()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if mode == "none":
        return None
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    near = [gpu_local_cpus(r) if cuda else None for r in range(local_world)]
    cpus = exclusive_cpus(local_rank, near, allowed)
    os.sched_setaffinity(0, cpus)
    return sorted(cpus)


# Settings of tk's kernels for FSDP training on several GPUs, where tk's schedule (thunder_tk/fsdp_schedule.py)
# runs collectives beside the compute: collectives on 32 SMs instead of 128 (a collective block and a GEMM block
# each need a whole SM), and GEMMs taking their tiles from a counter, so blocks that start late, behind a
# collective, take fewer. Llama-2-7B at 8 layers on 4x H100 (f078594), median step: 0.202 s, against 0.211 s with
# 128 blocks (static schedule), 0.213 s with 128 blocks (dynamic), 0.208 s with 32 blocks (static). A variable
# already set in the environment wins.
FSDP_KERNEL_SETTINGS = {"THUNDER_TK_COLLECTIVE_BLOCKS": "32", "THUNDER_TK_GEMM_SCHEDULE": "dynamic"}


def apply_fsdp_kernel_settings(world: int, environ=os.environ) -> dict[str, str]:
    """Sets FSDP_KERNEL_SETTINGS where several processes train and the environment leaves them unset; returns the
    ones it set."""
    if world <= 1:
        return {}
    chosen = {k: v for k, v in FSDP_KERNEL_SETTINGS.items() if k not in environ}
    environ.update(chosen)
    return chosen


def check_collective_environment(world: int) -> None:
    """With several processes, the THUNDER_TK_COLLECTIVE_* settings and the collective switches of
    THUNDER_TK_DISABLE are checked before the model is built, on every rank and against each other (one object
    all-gather): a bad one, or one rank's differing from another's, would otherwise fail or hang minutes into the
    first step."""
    if world <= 1:
        return
    import torch.distributed as dist

    from thunder_tk.claim_rules import DISABLE_ENV, collective_switches
    from thunder_tk.collectives import ranks_holding, settings_or_error, settings_problem, shared_settings

    config = settings_or_error()
    if not dist.is_available() or not dist.is_initialized():
        if isinstance(config, ValueError):
            raise ConfigError(f"tk collectives' settings: {config}") from None
        return
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (shared_settings(config), "+".join(sorted(collective_switches())) or "none"))
    problem = settings_problem([settings for settings, _ in every])
    if problem:
        raise ConfigError(f"tk collectives' settings: {problem}")
    switches = [names for _, names in every]
    if len(set(switches)) > 1:
        raise ConfigError(f"{DISABLE_ENV} turns off different collective rules on different ranks "
                          f"({ranks_holding(switches)}); every rank must run the same collectives in the same order")


class Dist:
    def __init__(self, config: PretrainConfig):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        wanted = world_size_of(config)
        if self.world != wanted:
            raise ConfigError(
                f"devices: the config asks for {wanted} processes ({config.devices} x {config.num_nodes} nodes) "
                f"but {self.world} were launched; start with `torchrun --nnodes {config.num_nodes} "
                f"--nproc_per_node {config.devices} -m thunder_tk.cli pretrain ...`"
            )
        # Before anything starts threads or processes, which inherit the affinity.
        self.cpus = bind_cpus(self.local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.device = torch.device(f"cuda:{self.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    @property
    def group(self):
        """The process group of every rank (whose shards make up the model), or None in one process."""
        if self.world == 1:
            return None
        import torch.distributed as dist

        return dist.group.WORLD

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def max_over_ranks(self, value: float) -> float:
        return max_over_ranks(value, self.device)


def model_config_of(config: PretrainConfig):
    _, Config = _litgpt()
    model_config = config.model_config
    if config.model_name is None and model_config is None and config.initial_checkpoint_dir is not None:
        model_config = checkpoint_model_config(config.initial_checkpoint_dir)  # validate() saw that it has one
    cfg = config_of(Config, config.model_name, model_config)
    if config.compiler.jit and (why := jit_unsupported(cfg)):
        raise ConfigError(f"{why}; `--compiler.jit false` trains it in eager PyTorch")
    seq = config.train.max_seq_length or min(cfg.block_size, 2048)
    if seq > cfg.block_size:
        raise ConfigError(f"train.max_seq_length: {seq} exceeds the model's block_size {cfg.block_size}")
    return cfg, seq


def resolve_executors(names: list[str]):
    """Executor names -> executors. `default` stands for Thunder's default list (`thunder_tk.baseline_executors`:
    the torch.compile fuser in nvFuser's place where nvFuser cannot load), the baseline tk is compared with."""
    from thunder.extend import get_executor

    import thunder_tk

    found = []
    for name in names:
        if name == "default":
            found.extend(ex for ex in thunder_tk.baseline_executors() if ex not in found)
            continue
        ex = thunder_tk.tk if name == "tk" else get_executor(name)
        if ex is None:
            raise ConfigError(f"compiler.executors: no executor named {name!r} is registered here")
        found.append(ex)
    return found


def build_optimizer(args, params):
    module, _, cls_name = args.class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):
        raise ConfigError(f"optimizer.class_path: {args.class_path} not found") from None
    init = dict(args.init_args)
    if "betas" in init:
        init["betas"] = tuple(init["betas"])
    try:
        return cls(params, **init)
    except TypeError as e:
        raise ConfigError(f"optimizer.init_args: {e}") from None


def learning_rate(step: int, total: int, base: float, warmup: int, min_lr: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_lr` at `total`."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def flops_per_token(cfg, seq_len: int, params_2d: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters plus attention at the actual sequence length."""
    return 6 * params_2d + 12 * cfg.n_layer * cfg.n_head * cfg.head_size * seq_len


# ------------------------------------------------------------------------------------------------
# Checkpoints: one file per rank in out_dir/checkpoints/step-XXXXXXXX/, `latest` names the newest complete one.


def checkpoint_folder(out_dir: Path, step: int) -> Path:
    return out_dir / "checkpoints" / f"step-{step:08d}"


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint folder, or None."""
    latest = out_dir / "checkpoints" / "latest"
    return out_dir / "checkpoints" / latest.read_text().strip() if latest.is_file() else None


def save_checkpoint(out_dir: Path, dist: Dist, step: int, state: dict) -> Path:
    folder = checkpoint_folder(out_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / f"rank{dist.rank}.pt", lambda p: torch.save(state, p))
    dist.barrier()
    if dist.main:
        atomic_write(out_dir / "checkpoints" / "latest", lambda p: p.write_text(folder.name + "\n"))
    dist.barrier()
    return folder


def load_checkpoint(out_dir: Path, dist: Dist, resume: bool | str = "auto") -> dict | None:
    """The state to resume from: `resume` true (the latest checkpoint in out_dir; ConfigError if there is none),
    "auto" (the latest, or None), a checkpoint folder, or false (None). A checkpoint written by another number of
    processes is refused: Thunder FSDP's shards are per rank."""
    if resume is False:
        return None
    if resume is True or resume == "auto":
        folder = latest_checkpoint(out_dir)
        if folder is None:
            if resume is True:
                raise ConfigError(f"resume: true, but {out_dir / 'checkpoints'} holds no checkpoint (resume: auto "
                                  "starts from step 0 where there is none)")
            return None
    else:
        folder = Path(resume)
        if not folder.is_dir():
            raise ConfigError(f"resume: {folder} is not a checkpoint folder")
    ranks = list(folder.glob("rank*.pt"))
    if len(ranks) != dist.world:
        raise ConfigError(f"resume: {folder} holds {len(ranks)} rank file{'s' if len(ranks) != 1 else ''}, written "
                          f"by that many processes; this run has {dist.world} (Thunder FSDP's shards are per rank)")
    return torch.load(folder / f"rank{dist.rank}.pt", map_location="cpu", weights_only=False)


# ------------------------------------------------------------------------------------------------
# The run


class Progress:
    def __init__(self, stream):
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def update(self, text: str, final: bool = False):
        if self.tty:
            self.stream.write("\r" + text.ljust(100) + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def pretrain(config: PretrainConfig, *, resume: bool | str | None = None, checkpoints: bool = True,
             stream=None) -> dict:
    """Train as `config` says; returns the summary that is also written to out_dir/summary.json.
    resume: as the config's `resume` (true, "auto", a checkpoint folder, false), which it replaces where given.
    At the end the model is written as a LitGPT checkpoint folder, out_dir/final (litgpt_checkpoint).
    checkpoints=False writes none (benchmark runs of large models, where a checkpoint is many GB per rank)."""
    from thunder_tk.data import SyntheticTokens, TextFiles, batch, has_tokenizer

    stream = stream or sys.stdout
    dist = Dist(config)
    kernel_settings = apply_fsdp_kernel_settings(dist.world)  # before any GEMM or collective reads them
    check_collective_environment(dist.world)
    out_dir = Path(config.out_dir)
    if dist.main:
        out_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # The diagnostics' environment settings are read before the model is built: a bad one fails in seconds.
    stalls = StallTracer(out_dir, dist.rank)
    profiler = StepProfiler(out_dir, dist.rank, dist.device)
    torch.manual_seed(config.seed)
    cfg, seq = model_config_of(config)
    GPT, _ = _litgpt()
    precision, param_dtype, autocast_dtype = precision_of(config.precision, dist.device.type)
    with torch.device(dist.device):
        model = GPT(cfg)
        model.max_seq_length = seq
    init_like_litgpt_pretrain(model, cfg)  # every rank the same weights (same seed), as LitGPT's pretrain draws them
    if config.train.tie_embeddings:
        model.transformer.wte.weight = model.lm_head.weight
    vectorize_window_masks(model)  # LitGPT's loop over positions would be traced a write at a time
    model = model.to(getattr(torch, param_dtype))
    params_2d = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "wte" not in n)
    # The tokenizer: the config's, else the initial checkpoint's (a `litgpt download` folder holds the model's own)
    tokenizer_dir = resolve_dir(config.data.tokenizer_dir) if config.data.tokenizer_dir else None
    if tokenizer_dir is None and config.initial_checkpoint_dir is not None:
        initial = resolve_dir(config.initial_checkpoint_dir)
        if has_tokenizer(initial):
            tokenizer_dir = initial
    if config.data.kind == "synthetic":
        data = SyntheticTokens(cfg.padded_vocab_size, seq, config.seed)
    else:
        if tokenizer_dir is None:
            raise ConfigError(f"data.tokenizer_dir: text data needs a tokenizer, and "
                              f"{resolve_dir(config.initial_checkpoint_dir)} has no tokenizer.json or tokenizer.model")
        try:
            data = TextFiles(config.data.paths, str(tokenizer_dir), seq, config.data.val_fraction,
                             config.data.val_paths or None)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e)) from None
        if data.vocab_size > cfg.padded_vocab_size:
            raise ConfigError(f"data.tokenizer_dir: the tokenizer has {data.vocab_size} tokens, more than the "
                              f"model's padded_vocab_size {cfg.padded_vocab_size}")
    t = config.train
    accum = t.global_batch_size // (t.micro_batch_size * dist.world)
    total_steps = t.max_steps if t.max_steps is not None else max(1, t.max_tokens // (t.global_batch_size * seq))
    if t.lr_warmup_fraction:  # LitGPT's meaning: a fraction of an epoch (validate() allows it for text data only)
        warmup_steps = min(total_steps, math.ceil(t.lr_warmup_fraction * data.samples_per_epoch / t.global_batch_size))
    else:
        warmup_steps = t.lr_warmup_steps or 0

    resume = config.resume if resume is None else resume
    checkpoint = load_checkpoint(out_dir, dist, resume)
    if resume == "auto" and checkpoint is None and dist.main:
        stream.write(f"no checkpoint in {out_dir / 'checkpoints'}; starting from step 0\n")
    if checkpoint is None and config.initial_checkpoint_dir is not None:
        path = load_initial_weights(model, config.initial_checkpoint_dir, cfg)  # before FSDP shards the weights
        if dist.main:
            stream.write(f"initial weights from {path}\n")
    if checkpoint is not None and dist.world == 1:
        model.load_state_dict(checkpoint["model"])

    net = LossModule(model)
    graphs = None  # compiler.cuda_graphs: the transform, which counts the graphs it captured
    if config.compiler.jit:
        import thunder

        options = {"tk_disable": list(config.compiler.disable)} if config.compiler.disable else {}
        if config.compiler.cuda_graphs:
            from thunder_tk.cuda_graphs import CUDAGraphs

            graphs = CUDAGraphs()
            options["transforms"] = [graphs]
        net = thunder.jit(net, executors=resolve_executors(config.compiler.executors), **options)
        if dist.world > 1:
            from thunder.distributed import fsdp

            net = fsdp(net, device=dist.device)
            if checkpoint is not None:
                net.load_state_dict(checkpoint["model"])
    elif dist.world > 1:
        raise ConfigError("compiler.jit: several devices need Thunder (FSDP runs through thunder.distributed.fsdp)")
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = build_optimizer(config.optimizer, params)
    base_lr = float(config.optimizer.init_args.get("lr", optimizer.param_groups[0]["lr"]))
    if dist.device.type == "cuda":
        # Peak memory of training, not of building the model: every rank materialises the whole model in fp32
        # before FSDP shards it, which says nothing about the executors.
        torch.cuda.synchronize(dist.device)
        torch.cuda.reset_peak_memory_stats(dist.device)

    step, samples = 0, 0
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        step, samples = checkpoint["step"], checkpoint["samples"]
        torch.set_rng_state(checkpoint["rng"])

    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if dist.device.type == "cuda"
                 and k in torch.cuda.get_device_name(dist.device)), None)
    fpt = flops_per_token(cfg, seq, params_2d)
    metrics_path = out_dir / "metrics.jsonl"
    progress = Progress(stream)
    state_of = (lambda: net.state_dict()) if dist.world > 1 else (lambda: model.state_dict())

    def save(at_step: int):
        save_checkpoint(out_dir, dist, at_step, {
            "model": state_of(), "optimizer": optimizer.state_dict(), "step": at_step, "samples": samples,
            "rng": torch.get_rng_state(), "config": asdict(config),
            "model_config": asdict(cfg),  # for `thunder-tk export` (litgpt_checkpoint.export_run_checkpoint)
        })

    traced_eval = False

    def evaluate() -> float:
        nonlocal traced_eval
        losses = []
        with torch.no_grad(), tracing_without_cyclic_gc(not traced_eval):  # the first call traces (no grad)
            traced_eval = True
            for i in range(config.eval.max_iters):
                # Validation samples: text training never reads (data.validation)
                first = (i * dist.world + dist.rank) * t.micro_batch_size
                x, y = batch(data.validation, list(range(first, first + t.micro_batch_size)), dist.device)
                with autocast_for(autocast_dtype, dist.device.type):
                    losses.append(net(x, y).float())
        value = dist.all_reduce_sum(torch.stack(losses).mean()) / dist.world
        return float(value)

    first_step = step
    run_start = steady_start = time.perf_counter()
    # Seconds per step over each logging interval after the first step (log points synchronise). Their median is
    # the steady pace, which the odd slow interval (a host stall) does not move; the mean over the run takes those
    # in. Evaluations and checkpoints during training are timed apart (`aside`) and left out of both: they are not
    # training, and the first evaluation traces and compiles a trace of its own.
    paces: list[float] = []
    aside = {"evaluation": 0.0, "checkpoint": 0.0}

    @contextlib.contextmanager
    def set_aside(what: str):
        nonlocal mark
        if dist.device.type == "cuda":
            torch.cuda.synchronize(dist.device)  # the step's own work ends inside the step's time
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            aside[what] += spent
            mark += spent  # the current logging interval's pace without it

    mark, mark_step = 0.0, None  # the last log point after the first step (time, step); none yet
    last_loss = float("nan")
    interval_profiled = False  # a profiled step in the current logging interval
    gc_clock = GcClock()
    phase = HostPhases()
    allocator = AllocatorCounters(dist.device)
    system = OsCounters()

    def log_validation(at_step: int, **extra) -> float:
        val = evaluate()
        if dist.main:
            with metrics_path.open("a") as f:
                f.write(json.dumps({"step": at_step, "val_loss": val, **extra}) + "\n")
        return val

    if config.eval.initial_validation and step == first_step:
        log_validation(step, initial=True)
    # train.max_time: each step's host clock against the limit. Several processes must stop at the same step, so
    # there the main rank's verdict is all-reduced and read one step later (reading it at once would wait for the
    # step's work to end before the next is issued).
    stopped_by_time = False
    time_verdict = None
    with gc_clock.installed(), contextlib.closing(stalls):
        while step < total_steps:
            if step > first_step:  # never the run's first step, which traces and compiles (a resumed run's too)
                profiler.before(step + 1)  # THUNDER_TK_PROFILE_STEPS: it synchronises first, outside the step's time
            profiled = profiler.active
            interval_profiled |= profiled
            step_start = time.perf_counter()
            phase.reset()
            if step > first_step:  # the first step traces and compiles for a minute
                stalls.arm(step)
            lr = learning_rate(step, total_steps, base_lr, warmup_steps, t.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=dist.device)
            with tracing_without_cyclic_gc(step == first_step):  # the first step traces forward and backward
                for micro in range(accum):
                    first = samples + (micro * dist.world + dist.rank) * t.micro_batch_size
                    with phase("batch"):
                        x, y = batch(data, list(range(first, first + t.micro_batch_size)), dist.device)
                    with phase("forward"), autocast_for(autocast_dtype, dist.device.type):
                        loss = net(x, y) / accum
                    with phase("backward"):
                        loss.backward()
                        loss_sum += loss.detach().float()
            grad_norm = None
            if t.max_norm is not None:
                with phase("clip"):
                    grad_norm = clip_gradients(params, t.max_norm, optimizer, dist.group)
            with phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            enqueued = time.perf_counter()  # the step's work issued; on a GPU the host waits below
            stalls.disarm(enqueued - step_start)
            samples += t.global_batch_size
            step += 1
            profiler.after(step)

            if step == first_step + 1:
                if config.compiler.jit and dist.main:
                    write_explain(net, out_dir)
                dist.barrier()
                if dist.device.type == "cuda":
                    torch.cuda.synchronize(dist.device)
                steady_start = time.perf_counter()  # after compilation and the explain report
                mark, mark_step = steady_start, step
            if t.max_time is not None and step < total_steps:
                over = time.perf_counter() - run_start > t.max_time
                if dist.world == 1:
                    stopped_by_time = over
                else:
                    if time_verdict is not None:
                        stopped_by_time = float(time_verdict) > 0
                    # made on the device by a fill (torch.tensor would copy from the host and wait for the stream)
                    flag = torch.full((), float(over and dist.main), device=dist.device)
                    time_verdict = dist.all_reduce_sum(flag)
            if step % t.log_interval == 0 or step == total_steps or stopped_by_time:
                last_loss = float(dist.all_reduce_sum(loss_sum) / dist.world)
                if dist.device.type == "cuda":
                    torch.cuda.synchronize(dist.device)
                now = time.perf_counter()
                seconds = now - step_start
                if mark_step is not None and step > mark_step:
                    if not interval_profiled:  # the profiler's synchronisations and its write are no pace
                        paces.append((now - mark) / (step - mark_step))
                    mark, mark_step, interval_profiled = now, step, False
                tokens_per_s = t.global_batch_size * seq / seconds
                mfu = fpt * tokens_per_s / dist.world / peak if peak else None
                gc_seconds, gc_collections = gc_clock.take()
                # host_seconds: this step until its work was issued (near step_seconds: the host set the pace),
                # host_phases: that time by phase; gc_*: the cyclic collector, the allocator's counters and the
                # operating system's (`system`), since the previous log point (this rank's).
                record = {"step": step, "loss": last_loss, "lr": lr,
                          # the gradients' global norm before clipping (train.max_norm; all ranks' shards together)
                          "grad_norm": float(grad_norm) if grad_norm is not None else None, "tokens": samples * seq,
                          "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / dist.world,
                          "mfu": mfu, "step_seconds": seconds, "host_seconds": enqueued - step_start,
                          "host_phases": phase.rounded(), "gc_seconds": gc_seconds,
                          "gc_collections": gc_collections, **allocator.take(), "system": system.take()}
                if profiled:  # under the profiler, and synchronised at its end
                    record["profiled"] = True
                if dist.main:
                    with metrics_path.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                    progress.update(
                        f"step {step}/{total_steps} | loss {last_loss:.4f} | {tokens_per_s / 1e3:.1f}k tok/s"
                        + (f" | MFU {100 * mfu:.1f}%" if mfu is not None else "") + f" | lr {lr:.2e}",
                        final=step == total_steps or stopped_by_time,
                    )
            if config.eval.interval and step % config.eval.interval == 0:
                with set_aside("evaluation"):
                    log_validation(step)
            if checkpoints and t.save_interval and step % t.save_interval == 0 and step < total_steps:
                if not stopped_by_time:  # the run saves at its end below
                    with set_aside("checkpoint"):
                        save(step)
            if stopped_by_time:
                if dist.main:
                    stream.write(f"train.max_time: {t.max_time:g} s passed; stopping after step {step}\n")
                break
    profiler.finish()  # the run ended inside the window
    if dist.device.type == "cuda":
        torch.cuda.synchronize(dist.device)
    loop_end = time.perf_counter()
    final_val = log_validation(step, final=True) if config.eval.final_validation else None
    if checkpoints and (step > first_step or checkpoint is None):
        save(step)
    if checkpoints:  # the model for the rest of LitGPT (generate, finetune, convert_from_litgpt)
        weights = full_state_dict(model, net if dist.world > 1 else None, world=dist.world, main=dist.main)
        if dist.main:
            write_litgpt_checkpoint(out_dir / "final", weights, cfg, tokenizer_dir=tokenizer_dir,
                                    hyperparameters=asdict(config))
        del weights
        dist.barrier()
    elapsed = time.perf_counter() - run_start
    # The profiled steps (THUNDER_TK_PROFILE_STEPS) are left out of the steady pace, with their wall time, and so
    # are the evaluations and checkpoints after the first step.
    steady_steps = step - first_step - 1 - profiler.done
    steady_seconds = loop_end - steady_start - profiler.spent_s - sum(aside.values())
    steady = steady_steps * t.global_batch_size * seq / steady_seconds if steady_steps > 0 else None
    pace, slowest = (statistics.median(paces), max(paces)) if paces else (None, None)
    on_gpu = dist.device.type == "cuda"
    peak_gib = dist.max_over_ranks(torch.cuda.max_memory_allocated(dist.device) / 2**30) if on_gpu else None
    # The allocated peak leaves out where CUDA graphs keep their temporaries (their pool's free part); reserved has it.
    reserved_gib = dist.max_over_ranks(torch.cuda.max_memory_reserved(dist.device) / 2**30) if on_gpu else None
    graphs_gib = ({k: dist.max_over_ranks(b / 2**30) for k, b in graphs.memory().items()}
                  if graphs is not None and on_gpu else None)
    summary = {
        "steps": step, "final_loss": last_loss, "tokens": samples * seq, "seconds": elapsed,
        "stopped_by": "train.max_time" if stopped_by_time else None, "final_val_loss": final_val,
        "litgpt_checkpoint": str(out_dir / "final") if checkpoints else None,
        "tokens_per_s": (step - first_step) * t.global_batch_size * seq / elapsed if step > first_step else 0.0,
        # Training alone after the first step: profiled steps, evaluations and checkpoints left out.
        "tokens_per_s_after_first_step": steady,
        "tokens_per_s_per_device_after_first_step": steady / dist.world if steady else None,
        "mfu_after_first_step": fpt * steady / dist.world / peak if steady and peak else None,
        # The same pace from the median logging interval (per step), and the slowest interval's.
        "step_seconds_median_after_first_step": pace,
        "step_seconds_max_after_first_step": slowest,
        "tokens_per_s_per_device_median_step": t.global_batch_size * seq / pace / dist.world if pace else None,
        # Seconds the training loop spent evaluating and writing checkpoints (the final ones after it not counted).
        "evaluation_seconds": aside["evaluation"], "checkpoint_seconds": aside["checkpoint"],
        "device": torch.cuda.get_device_name(dist.device) if on_gpu else "cpu",
        "world_size": dist.world, "seq_len": seq, "global_batch_size": t.global_batch_size,
        # The precision run (the config's, or what null picked for the device): weights and autocast dtypes.
        "precision": precision, "parameter_dtype": param_dtype, "autocast_dtype": autocast_dtype,
        "executors": list(config.compiler.executors) if config.compiler.jit else ["eager"],
        # compiler.cuda_graphs: the graphs captured (none where every tensor is off the GPU); None: not asked for
        "cuda_graphs_captured": graphs.graphs_captured if graphs is not None else None,
        # The optimizer, and for thunder_tk.optim.AdamW which tensors its last step updated on tk's kernel and which
        # took torch's path, with the first reason
        "optimizer": optimizer_report(optimizer, config.optimizer.class_path),
        # Largest per-rank peak of torch's allocator during training (setup excluded): allocated, and reserved (the
        # allocator's cache and the CUDA graphs' pool included); with graphs, what they hold (CUDAGraphs.memory).
        "peak_memory_gib": peak_gib,
        "peak_reserved_gib": reserved_gib,
        "cuda_graphs_memory_gib": graphs_gib,
        # THUNDER_TK_CPU_AFFINITY=exclusive: how many CPUs rank 0 was bound to (None: the affinity left alone).
        "cpus_bound": len(dist.cpus) if dist.cpus is not None else None,
        # FSDP_KERNEL_SETTINGS this run set (several GPUs, the environment silent on them).
        "kernel_settings": kernel_settings,
        # Every THUNDER_TK_* setting the run had (those above included): which collective engine, how many
        # collective blocks, which GEMM schedule, what was disabled, so a result says how it was made.
        "tk_environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("THUNDER_TK_")},
    }
    if dist.main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        stream.write(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, {elapsed:.1f} s"
                     + (f", {steady / 1e3:.1f}k tok/s after the first (compiling) step" if steady else "")
                     + (f" (median step {pace:.3f} s, slowest {slowest:.3f} s)" if pace else "")
                     + "".join(f", {what} {sec:.1f} s" for what, sec in aside.items() if sec)
                     + f"; outputs in {out_dir}\n")
    return summary


def optimizer_report(optimizer, class_path: str) -> dict:
    """The summary's account of the optimizer: its class, and for thunder_tk.optim.AdamW its last step's routes."""
    report = {"class_path": class_path}
    if hasattr(optimizer, "route_counts"):
        counts = optimizer.route_counts()
        report.update(tensors_on_tk=counts["tk"], tensors_on_torch=counts["torch"],
                      first_reason=next(iter(counts["declined"]), None))
    return report


def clip_gradients(params, max_norm: float, optimizer=None, process_group=None) -> torch.Tensor | None:
    """Clip by the global gradient norm as torch.nn.utils.clip_grad_norm_ does, the squared norms summed over
    `process_group`'s ranks where the parameters are its shards (thunder.distributed.fsdp's are plain tensors, which
    torch's function would take for whole ones). thunder_tk.optim.AdamW folds the scaling into its next update (its
    clip_grad_norm_: one read of the gradients, none written); otherwise fp32 norms by torch's foreach kernels and an
    in-place multiply. Returns the norm on the device (nothing waits for it), or None without gradients."""
    from thunder_tk.optim import AdamW as TkAdamW, clip_factor, sq_norm_by_torch

    if isinstance(optimizer, TkAdamW):
        return optimizer.clip_grad_norm_(max_norm, process_group=process_group)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    sq = sq_norm_by_torch(grads)
    if process_group is not None:
        torch.distributed.all_reduce(sq, group=process_group)
    norm = sq.sqrt()
    torch._foreach_mul_(grads, clip_factor(norm, max_norm))
    return norm


def write_explain(net, out_dir: Path) -> None:
    from thunder_tk.explain import explain

    try:
        report = explain(net)
    except (TypeError, ValueError):
        return
    (out_dir / "explain.txt").write_text(str(report) + "\n")
    (out_dir / "explain.json").write_text(report.to_json())
