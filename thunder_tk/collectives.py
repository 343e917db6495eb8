"""tk's all-gather and reduce-scatter between the GPUs of one node, over NVLink peer memory.

Each (process group, GPU) gets a `Channel` on first use: one buffer from torch's symmetric memory (allocated and
exchanged once, then reused by every call), and a CUDA stream the channel's kernels run on. The data movement
and the flags the ranks synchronise with are tk's own kernels (csrc/kernels/collectives); torch only provides
the memory and its peer mappings. NVLink multicast is never used.

Calls are stream-ordered like NCCL's: the channel's stream waits for the caller's stream, runs the kernel, and
`Work.wait()` makes the caller's stream wait for it, so communication overlaps the caller's later compute. A
peer that never arrives makes the kernel stop after the channel's timeout; the next `wait()` or call on that
channel raises `CollectiveTimeoutError` naming the op and the peer.

Calls can be captured into CUDA graphs (thunder_tk.CUDAGraphs does so under FSDP): the kernels keep their flags'
sequence numbers in GPU memory, the channel's stream joins the capture through the events above, and a Work made
under capture keeps its tensors until `wait()` (a stream recorded on a tensor would keep its memory out of reuse
for the rest of the capture). `graph_replay()` orders a graph's replay against the channel's launches outside it.

Environment knobs (read when a channel is made; making one checks that every rank of the group has the same
settings, but for the timeout and the copy engines' summing blocks and signalling, and raises ValueError on every
rank alike, naming the variable and which ranks have which value):
- THUNDER_TK_COLLECTIVE_TIMEOUT_S (default 600): how long a kernel waits for a peer.
- THUNDER_TK_COLLECTIVE_BLOCKS (default 128): thread blocks (one SM each) a large collective may use; fewer
  leave more SMs to overlapping compute at some cost in bandwidth (benchmarks/NOTES.md).
- THUNDER_TK_COLLECTIVE_BUFFER_MB (default 64): staging buffer per rank.
- THUNDER_TK_COLLECTIVE_SLOTS (default 4): staging cells per (block, peer); the buffer is split into
  blocks x slots x peers cells (blocks x slots with pairs).
- THUNDER_TK_COLLECTIVE_PAIRS (default 1): with three or more ranks, each block exchanges with one peer (block b
  sends to the rank 1 + b % (ranks - 1) ahead) instead of every block with every peer (0).
- THUNDER_TK_COLLECTIVE_ENGINE (default sm): "sm" moves every collective's data with tk's kernels; "copy" moves
  it on the GPUs' copy engines (cudaMemcpyAsync between peer mappings: no SMs, but for reduce-scatter's sum on
  THUNDER_TK_COLLECTIVE_CE_REDUCE_BLOCKS blocks, default 32), so compute that overlaps keeps every SM; "auto"
  uses the copy engines from THUNDER_TK_COLLECTIVE_CE_MIN_MB (default 16) of gathered data up. Streams under
  CUDA-graph capture always get the kernels. The copy-engine path has a buffer of its own,
  THUNDER_TK_COLLECTIVE_CE_BUFFER_MB (default 256), in THUNDER_TK_COLLECTIVE_CE_SLOTS (default 4) slots per
  source, and no timeout: a rank that never reaches a collective leaves its peers waiting, as with NCCL.
  THUNDER_TK_COLLECTIVE_CE_SIGNAL (default write): how it raises a peer's flag, "write" (a stream write into
  the peer's memory) or "copy" (a local stream write and a 4-byte copy to the peer).
- THUNDER_TK_COLLECTIVE_KEEP (default wait; this rank's alone): how an asynchronous collective's tensors return
  to the allocator. "wait": the Work keeps them until `wait()`, after which the caller's stream may reuse them at
  once (what capture always does; NCCL's TORCH_NCCL_AVOID_RECORD_STREAMS is the same choice; tk's FSDP schedule then
  waits for reduce-scatters early enough to bound what they keep, fsdp_schedule.py); "record": the caller frees
  them, their reuse ordered after the collective by a stream recorded on them (a freed block then waits for the
  channel's stream to pass that point, and the allocator takes new memory meanwhile: under FSDP at 16 layers of
  Llama-3.2-1B, 30.7 GiB reserved against 18.6 with "wait", benchmarks/NOTES.md).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from functools import lru_cache

import torch

from thunder_tk.env_settings import COLLECTIVE_KEEP, env_word
from thunder_tk.ops import _DTYPE_CODES

MAX_RANKS = 16  # the kernels' peer table
MIN_CHUNK_BYTES = 8192  # smallest unit of work one block moves
# Staging cells per (block, peer): senders run up to SLOTS units ahead of the receivers. 4x H200, paired blocks
# (6be777d): 4 slots against 2 took reduce-scatter from 257 to 290 GB/s at 64 MiB and 286 to 325 at 256 MiB,
# all-gather 307 to 313 at 64 MiB; on 2x H200 2, 4 and 8 were equal within 1% (benchmarks/NOTES.md).
SLOTS = 4
UNITS_PER_BLOCK = 4  # aim for this many units per block, so sending and draining overlap inside each block
ENGINES = ("sm", "copy", "auto")


class CollectiveError(RuntimeError):
    """A tk collective failed; the channel it ran on is closed."""


class CollectiveTimeoutError(CollectiveError):
    """A peer did not reach the same collective within the channel's timeout."""


def keeps_until_wait() -> bool:
    """Whether an async collective's Work keeps its tensors until wait() (THUNDER_TK_COLLECTIVE_KEEP)."""
    return COLLECTIVE_KEEP.read() == "wait"


def _env_number(name: str, default, parse=int):
    raw = os.environ.get(name, "")
    try:
        return parse(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if parse is int else 'a number'}") from None


# ------------------------------------------------------------------------------------------------
# Which groups tk can serve (metadata only: environment, device count, peer-access table; no GPU work)


def _group_ranks(group) -> list[int]:
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


@lru_cache(maxsize=None)
def _peer_access(i: int, j: int) -> bool:
    return torch.cuda.can_device_access_peer(i, j)


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def group_support_reason(group, *, planning: bool = False) -> str:
    """Why tk cannot run collectives on `group` ("" when it can).

    A group qualifies when it has 2..16 ranks, all on this node, and every pair of their GPUs has peer access.
    Ranks map to nodes and GPUs the way torchrun assigns them: node = rank // LOCAL_WORLD_SIZE, GPU = the
    rank's local index. While planning without GPUs only the first two checks apply.
    """
    try:
        size = group.size()
    except Exception as e:  # not a ProcessGroup
        return f"not a process group ({type(group).__name__}: {e})"
    if size < 2:
        return "the process group has one rank (nothing to exchange)"
    if size > MAX_RANKS:
        return f"the process group has {size} ranks; tk's collectives serve up to {MAX_RANKS} GPUs of one node"
    ranks = _group_ranks(group)
    local_world = _env_number("LOCAL_WORLD_SIZE", 0)
    if local_world > 0:
        nodes = sorted({r // local_world for r in ranks})
        if len(nodes) > 1:
            return (f"the process group spans {len(nodes)} nodes (ranks {ranks}, {local_world} per node); "
                    "tk's collectives work within one node, so NCCL runs it")
        local = [r % local_world for r in ranks]
    else:
        local = ranks
    if planning:
        return ""
    visible = _visible_gpus()
    if max(local) >= visible:
        where = "LOCAL_WORLD_SIZE is not set and " if local_world <= 0 else ""
        return (f"{where}this process sees {visible} GPU(s) but the group's local ranks are {local}; tk needs every "
                "GPU of the group visible to each rank (one GPU per local rank, as torchrun sets it up)")
    for a in local:
        for b in local:
            if a != b and not _peer_access(a, b):
                return f"GPUs {a} and {b} have no peer access (no NVLink/PCIe P2P between them)"
    return ""


# ------------------------------------------------------------------------------------------------
# Channels


_ERROR_FIELDS = ("code", "op", "peer", "block", "expected", "seen", "rank")
_OPS = {1: "all_gather", 2: "reduce_scatter"}


@dataclass(frozen=True)
class ChannelConfig:
    blocks: int
    buffer_bytes: int
    timeout_s: float
    slots: int = SLOTS  # staging cells per (block, peer); more let senders run further ahead of the receivers
    # Of a block's 16 warps, how many send (the rest receive). Reduce-scatter's receivers read two sources and
    # add, and were its bottleneck with 8 (2x H200, 1 GiB: 240 GB/s with 8 senders, 361 with 4; NOTES.md).
    ag_sender_warps: int = 8
    rs_sender_warps: int = 4
    min_chunk_bytes: int = MIN_CHUNK_BYTES  # smallest unit of work one block moves (a multiple of 16)
    # Units each block (lane) aims at: more make a deeper pipeline (its first send and last drain a smaller share
    # of the message) at more handshakes. With 128 blocks and a 64 MiB buffer, messages of about 5 to 84 MiB
    # gathered on 4 ranks come out at this many per lane (smaller ones at min_chunk_bytes, larger at a cell).
    units_per_block: int = UNITS_PER_BLOCK
    # With three or more ranks: each block paired with one peer each way (its handshakes wait for one peer, its
    # stores go to one), the blocks of a lane (one per peer) sharing units. Ignored with two ranks.
    # 4x H200 (6be777d): reduce-scatter 0.91-0.99x NCCL at >= 64 MiB unpaired, 1.06-1.10x paired (4 slots),
    # all-gather 0.98-1.06x and 1.06-1.18x, and under 17 us where unpaired took 17-19 at <= 1 MiB.
    pairs: bool = True
    # Where the data moves: "sm" (tk's kernels), "copy" (the copy engines), "auto" (copy engines for gathered
    # sizes >= copy_min_bytes). The copy engines leave the SMs to the compute that overlaps a collective.
    engine: str = "sm"
    # 2x H200 (83844bb), reduce-scatter at 1 GiB: 180 GB/s with 128 MiB, 2 slots, 16 summing blocks; 311 with
    # 256 MiB, 4 slots, 32 blocks (the sum, not the link, had been the limit). All-gather 227 and 260.
    copy_buffer_bytes: int = 256 << 20
    copy_slots: int = 4
    copy_min_bytes: int = 16 << 20
    copy_reduce_blocks: int = 32
    # How a copy-engine collective raises a peer's flag: "write" (a stream write into the peer's mapping) or
    # "copy" (a stream write into a local word, then a 4-byte cudaMemcpyAsync to the peer: what NCCL does).
    copy_signal: str = "write"

    def __post_init__(self):
        problems = [f"{name} {why}" for name, bad, why in (
            ("blocks", self.blocks < 1, "must be >= 1"),
            ("buffer_bytes", self.buffer_bytes < 1, "must be positive"),
            ("timeout_s", not self.timeout_s > 0, "must be positive"),
            ("slots", self.slots < 2, "must be >= 2 (one cell drains while the next fills)"),
            ("ag_sender_warps", not 1 <= self.ag_sender_warps <= 15, "must be 1..15 (of a block's 16 warps)"),
            ("rs_sender_warps", not 1 <= self.rs_sender_warps <= 15, "must be 1..15 (of a block's 16 warps)"),
            ("min_chunk_bytes", self.min_chunk_bytes < 16 or self.min_chunk_bytes % 16,
             "must be a positive multiple of 16"),
            ("units_per_block", self.units_per_block < 1, "must be >= 1"),
            ("engine", self.engine not in ENGINES, f"must be one of {', '.join(ENGINES)}"),
            ("copy_buffer_bytes", self.copy_buffer_bytes < (1 << 20), "must be at least 1 MiB"),
            ("copy_slots", self.copy_slots < 2, "must be >= 2 (one slot is read while the next fills)"),
            ("copy_min_bytes", self.copy_min_bytes < 0, "must be >= 0"),
            ("copy_reduce_blocks", self.copy_reduce_blocks < 1, "must be >= 1"),
            ("copy_signal", self.copy_signal not in ("write", "copy"), "must be write or copy"),
        ) if bad]
        if problems:
            raise ValueError(f"ChannelConfig: {'; '.join(problems)} (got {self})")

    @staticmethod
    def from_env() -> "ChannelConfig":
        """The settings the THUNDER_TK_COLLECTIVE_* variables give; a bad one raises ValueError naming it."""
        try:
            return ChannelConfig._from_env()
        except ValueError as e:
            text = str(e)
            named = [f"{env}={os.environ[env]!r}" for field, env in _FIELD_ENV.items()
                     if env in os.environ and re.search(rf"\b{field} ", text)]
            raise ValueError(text + (f" (from {', '.join(named)})" if named else "")) from None

    @staticmethod
    def _from_env() -> "ChannelConfig":
        env = _FIELD_ENV
        return ChannelConfig(
            blocks=_env_number(env["blocks"], 128),
            buffer_bytes=_env_number(env["buffer_bytes"], 64) << 20,
            timeout_s=_env_number(env["timeout_s"], 600.0, float),
            slots=_env_number(env["slots"], SLOTS),
            pairs=bool(_env_number(env["pairs"], 1)),
            units_per_block=_env_number(env["units_per_block"], UNITS_PER_BLOCK),
            engine=env_word(env["engine"], "sm"),
            copy_buffer_bytes=_env_number(env["copy_buffer_bytes"], 256) << 20,
            copy_slots=_env_number(env["copy_slots"], 4),
            copy_min_bytes=int(_env_number(env["copy_min_bytes"], 16.0, float) * (1 << 20)),
            copy_reduce_blocks=_env_number(env["copy_reduce_blocks"], 32),
            copy_signal=env_word(env["copy_signal"], "write"),
        )

    def uses_copy_engine(self, gathered_bytes: int) -> bool:
        """Whether a collective of `gathered_bytes` (all-gather output, reduce-scatter input) moves on the copy
        engines."""
        return self.engine == "copy" or (self.engine == "auto" and gathered_bytes >= self.copy_min_bytes)


# The environment variable behind each ChannelConfig field that from_env reads (its one spelling: from_env reads
# through this table, and names the variable of a field its checks reject).
_FIELD_ENV = {
    "blocks": "THUNDER_TK_COLLECTIVE_BLOCKS", "buffer_bytes": "THUNDER_TK_COLLECTIVE_BUFFER_MB",
    "timeout_s": "THUNDER_TK_COLLECTIVE_TIMEOUT_S", "slots": "THUNDER_TK_COLLECTIVE_SLOTS",
    "pairs": "THUNDER_TK_COLLECTIVE_PAIRS",
    "units_per_block": "THUNDER_TK_COLLECTIVE_UNITS", "engine": "THUNDER_TK_COLLECTIVE_ENGINE",
    "copy_buffer_bytes": "THUNDER_TK_COLLECTIVE_CE_BUFFER_MB", "copy_slots": "THUNDER_TK_COLLECTIVE_CE_SLOTS",
    "copy_min_bytes": "THUNDER_TK_COLLECTIVE_CE_MIN_MB", "copy_reduce_blocks": "THUNDER_TK_COLLECTIVE_CE_REDUCE_BLOCKS",
    "copy_signal": "THUNDER_TK_COLLECTIVE_CE_SIGNAL",
}


# ChannelConfig fields that act on one rank only. Every other field fixes the buffers' layout, how a message is cut
# into units or chunks, or which path a call takes, so a rank whose value differs would read its peers' data at the
# wrong offsets or wait for a path they never take.
_PER_RANK_FIELDS = frozenset({"timeout_s", "copy_reduce_blocks", "copy_signal"})


def shared_settings(config: ChannelConfig | ValueError) -> dict | str:
    """What a rank brings to the comparison between ranks: its shared fields, or the text of the error its
    settings raised."""
    if isinstance(config, ValueError):
        return str(config)
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name not in _PER_RANK_FIELDS}


def ranks_holding(values: list[str]) -> str:
    """Which ranks hold which value (values[r] is rank r's, as text): "a on ranks 0, 2, b on rank 1"."""
    holders: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        holders.setdefault(v, []).append(r)
    return ", ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for v, rs in holders.items())


def settings_problem(every: list[dict | str]) -> str | None:
    """The error for every rank's shared_settings (every[r] is rank r's), or None: the ranks whose settings are
    invalid, else each shared field that differs (named with its variable and which ranks hold which value)."""
    invalid = [f"rank {r}: {e}" for r, e in enumerate(every) if isinstance(e, str)]
    if invalid:
        return "tk collectives' settings are invalid on " + "; ".join(invalid)
    differ = []
    for name in every[0]:
        values = [repr(settings[name]) for settings in every]
        if len(set(values)) > 1:
            label = f"{_FIELD_ENV[name]} ({name})" if name in _FIELD_ENV else name
            differ.append(f"{label}: {ranks_holding(values)}")
    if differ:
        return ("tk collectives' settings differ between the ranks of a group, which must share them: "
                + "; ".join(differ))
    return None


def check_same_on_every_rank(config: ChannelConfig | ValueError, group=None) -> None:
    """Collective over `group` (default: the world group): every rank passes its settings, or the error reading
    them raised; all ranks then raise the same ValueError if any rank's settings are invalid or any shared field
    differs between ranks (settings_problem). Without an initialised process group only this rank's own error is
    raised."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if isinstance(config, ValueError):
            raise config
        return
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, shared_settings(config), group=group)
    problem = settings_problem(every)
    if problem:
        raise ValueError(problem)


def settings_or_error() -> ChannelConfig | ValueError:
    """This rank's settings from the environment (ChannelConfig.from_env), or the error reading them: returned, not
    raised, so that a collective check raises it on every rank alike instead of leaving the others waiting."""
    try:
        return ChannelConfig.from_env()
    except ValueError as e:
        return e


def settings_on_every_rank(group=None) -> ChannelConfig:
    """Collective: this rank's settings from the environment (ChannelConfig.from_env), once check_same_on_every_rank
    has found them valid on every rank of `group` and the same where they must be."""
    config = settings_or_error()
    check_same_on_every_rank(config, group)
    return config


def chunk_bytes(bytes_per_rank: int, lanes: int, config: ChannelConfig, cell_bytes: int) -> int:
    """Bytes per unit of work: config.units_per_block units per lane where the message allows (a block pipelines
    its units through its cells), a multiple of 16, never below config.min_chunk_bytes nor above a cell."""
    per_unit = -(-bytes_per_rank // (lanes * config.units_per_block))
    return min(cell_bytes, max(config.min_chunk_bytes, -(-per_unit // 16) * 16))


class Channel:
    """One rank's end of tk's peer-memory channel for a process group on one GPU. Making one is collective."""

    def __init__(self, group, device: torch.device, config: ChannelConfig | None = None):
        from thunder_tk import _extension

        ext = _extension.extension()
        if ext is None:
            raise CollectiveError(f"tk collectives unavailable: {_extension.unavailable_reason()}")
        self.device = torch.device(device)
        with torch.cuda.device(self.device):  # an NCCL group's object collective runs on the current device
            if config is None:
                config = settings_on_every_rank(group)
            else:
                check_same_on_every_rank(config, group)
        self.group = group
        self._index = self.device.index
        self.world = group.size()
        self.rank = group.rank()
        self.config = config
        self._keep_until_wait = keeps_until_wait()
        peers = max(1, self.world - 1)
        # Pairs need a block per peer; with two ranks they are what the plain layout does anyway.
        self.pairs = config.pairs and self.world >= 3
        if self.pairs and config.blocks < peers:
            raise ValueError(f"pairs need a block per peer: {config.blocks} blocks for {peers} peers; raise "
                             "THUNDER_TK_COLLECTIVE_BLOCKS or unset THUNDER_TK_COLLECTIVE_PAIRS")
        # Blocks that share the units of a message: all of them, or with pairs one lane of `peers` blocks.
        self.lanes = config.blocks // peers if self.pairs else config.blocks
        cells = config.blocks * config.slots * (1 if self.pairs else peers)
        cell = config.buffer_bytes // cells // 4096 * 4096
        if cell < config.min_chunk_bytes:
            raise ValueError(f"a {config.buffer_bytes >> 20} MiB buffer is too small for {config.blocks} blocks and "
                             f"{self.world} ranks with {config.slots} slots; raise THUNDER_TK_COLLECTIVE_BUFFER_MB")
        self.cell_bytes = cell
        layout = ext.P2PChannel.layout(self.world, config.blocks, config.slots, cell, self.pairs)
        with torch.cuda.device(self.device):
            self._buffer, self._handle = self._symmetric_buffer(layout["total_bytes"], layout["flag_bytes"])
            self.stream = torch.cuda.Stream(self.device, priority=-1)
            self._error = torch.zeros(len(_ERROR_FIELDS) + 1, dtype=torch.int64, pin_memory=True)
            self._error_view = self._error.numpy()  # read without going through torch ops
            self._kernels = ext.P2PChannel(self.world, config.blocks, config.slots, cell, self.rank,
                                           [int(p) for p in self._handle.buffer_ptrs], self._error.data_ptr(),
                                           int(config.timeout_s * 1e9), self.stream.cuda_stream, self.pairs)
            self._copy_buffer = self._copy_handle = None
            if config.engine != "sm":
                copy_layout = ext.P2PChannel.copy_engine_layout(self.world, config.copy_slots,
                                                                config.copy_buffer_bytes)
                self._copy_buffer, self._copy_handle = self._symmetric_buffer(config.copy_buffer_bytes,
                                                                              copy_layout["flag_bytes"])
                self._kernels.attach_copy_engine(config.copy_slots, config.copy_buffer_bytes,
                                                 [int(p) for p in self._copy_handle.buffer_ptrs],
                                                 config.copy_reduce_blocks, config.copy_signal == "copy")
        self._failure: CollectiveError | None = None

    def _symmetric_buffer(self, nbytes: int, flag_bytes: int):
        """A buffer of torch's symmetric memory mapped into every rank of the group, its first `flag_bytes` zeroed on
        every rank before any rank returns (so no launch writes a peer's flag before that peer has cleared it).
        Collective; call under this channel's device."""
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        buffer[:flag_bytes].zero_()
        handle = symm_mem.rendezvous(buffer, self.group)
        handle.barrier()
        torch.cuda.current_stream(self.device).synchronize()
        return buffer, handle

    def chunk_bytes(self, bytes_per_rank: int) -> int:
        """Bytes per unit of work (see chunk_bytes)."""
        return chunk_bytes(bytes_per_rank, self.lanes, self.config, self.cell_bytes)

    # -- failures ---------------------------------------------------------------------------------------

    def failure(self) -> CollectiveError | None:
        """The error a kernel on this channel recorded (read from pinned memory; no synchronisation)."""
        if self._failure is None and self._error_view[0]:
            self._failure = self._describe(int(self._error_view[0]), dict(zip(_ERROR_FIELDS, self._error.tolist())))
        return self._failure

    def raise_if_failed(self) -> None:
        if self._failure is not None or self._error_view[0]:
            raise self.failure()

    def _describe(self, code: int, rec: dict) -> CollectiveError:
        op = _OPS.get(rec["op"], "collective")
        where = (f"thunder_tk {op} on rank {rec['rank']} of {self.world} (GPU {self.device}, group "
                 f"{getattr(self.group, 'group_name', '?')})")
        closed = "The channel is closed: later tk collectives on this group raise this error too."
        if code == 1:
            return CollectiveTimeoutError(
                f"{where} timed out after {self.config.timeout_s:g} s waiting for rank {rec['peer']} (block "
                f"{rec['block']} expected flag {rec['expected']}, saw {rec['seen']}). That rank did not reach the "
                f"same collective. {closed}")
        if code == 2:
            return CollectiveError(
                f"{where}: ranks are out of step: rank {rec['peer']} announced unit {rec['seen']} where "
                f"{rec['expected']} was expected (the ranks issued different collectives or sizes). {closed}")
        return CollectiveError(f"{where} failed with code {code}. {closed}")

    # -- launches ---------------------------------------------------------------------------------------

    # A synchronous call runs on the caller's stream; an asynchronous one on the channel's stream, which the
    # caller's stream waits for in Work.wait(). The binding keeps the channel's launches in order across both.

    def _work(self, handle: int, tensors: tuple[torch.Tensor, ...]) -> "Work":
        # The caller may free the tensors while the channel's stream still reads or writes them. Under CUDA-graph
        # capture the Work keeps them until wait() instead: the allocator keeps a recorded stream's memory out of
        # reuse for the rest of the capture, which would hold every gathered weight of a captured step at once.
        if self._keep_until_wait or torch.cuda.is_current_stream_capturing():
            return Work(self, handle, tensors)
        for t in tensors:
            t.record_stream(self.stream)
        return Work(self, handle)

    def graph_replay(self) -> None:
        """Around the replay of a CUDA graph that holds launches of this channel, on the current stream: before it,
        the replay waits for the channel's last launch outside a graph; after it, the channel's next launch waits for
        the replay. Raises the error a launch recorded, as a call would."""
        self.raise_if_failed()
        self._kernels.graph_replay(_current_stream(self._index))

    def all_gather(self, a: torch.Tensor, *, async_op: bool = False, out: torch.Tensor | None = None):
        """Concatenation of every rank's `a` along dim 0. Returns the tensor, or (Work, tensor) if async."""
        # Kept lean: at small sizes the host work per call is what the caller waits for.
        if a.dtype not in _DTYPE_CODES or a.get_device() != self._index or a.ndim == 0:
            self._check_tensor(a)
        self.raise_if_failed()
        if not a.is_contiguous():
            a = a.contiguous()
        out = self._output(out, (a.shape[0] * self.world, *a.shape[1:]), a)
        nbytes = a.numel() * a.element_size()
        handle = self._kernels.all_gather(a.data_ptr(), out.data_ptr(), nbytes, self.chunk_bytes(nbytes),
                                          a.element_size(), _current_stream(self._index), async_op, 0,
                                          self.config.ag_sender_warps,
                                          self.config.uses_copy_engine(nbytes * self.world))
        if not async_op:
            return out
        return self._work(handle, (a, out)), out

    def reduce_scatter(self, a: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                       out: torch.Tensor | None = None):
        """This rank's slice (along dim 0) of the sum (or average) of every rank's `a`."""
        if a.dtype not in _DTYPE_CODES or a.get_device() != self._index or a.ndim == 0:
            self._check_tensor(a)
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce_scatter op must be 'sum' or 'avg', not {op!r}")
        if a.shape[0] % self.world:
            raise ValueError(f"reduce_scatter needs dim 0 divisible by the group size {self.world}; got {tuple(a.shape)}")
        self.raise_if_failed()
        if not a.is_contiguous():
            a = a.contiguous()
        out = self._output(out, (a.shape[0] // self.world, *a.shape[1:]), a)
        n, esize = out.numel(), a.element_size()
        handle = self._kernels.reduce_scatter(a.data_ptr(), out.data_ptr(), n, self.chunk_bytes(n * esize) // esize,
                                              _DTYPE_CODES[a.dtype], op == "avg", _current_stream(self._index),
                                              async_op, 0, self.config.rs_sender_warps,
                                              self.config.uses_copy_engine(a.numel() * esize))
        if not async_op:
            return out
        return self._work(handle, (a, out)), out

    @staticmethod
    def _output(out: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        if out.shape != shape or out.dtype != like.dtype or out.get_device() != like.get_device() or (
                not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous {like.dtype} tensor of shape {tuple(shape)} on {like.device}; "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        return out

    def _check_tensor(self, a: torch.Tensor) -> None:
        if a.device != self.device:
            raise ValueError(f"tensor on {a.device}, but this channel serves {self.device}")
        if a.dtype not in _DTYPE_CODES:
            raise ValueError(f"tk collectives support bfloat16, float16 and float32, not {a.dtype}")
        if a.ndim == 0:
            raise ValueError("tk collectives gather and scatter along dim 0; got a 0-d tensor")




_current_stream = torch._C._cuda_getCurrentRawStream  # (device index) -> cudaStream_t as int


class Work:
    """What an async tk collective returns beside its tensor; Thunder's `wait` calls `wait()` on it."""

    __slots__ = ("_channel", "_handle", "_tensors")

    def __init__(self, channel: Channel, handle: int, tensors: tuple[torch.Tensor, ...] = ()):
        self._channel = channel
        self._handle = handle
        self._tensors = tensors  # kept until wait() (under graph capture, or THUNDER_TK_COLLECTIVE_KEEP=wait)

    def __del__(self):
        # Dropped without wait(): the tensors return to the allocator once the channel's stream is past them.
        try:
            for t in self._tensors:
                t.record_stream(self._channel.stream)
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def wait(self, timeout=None) -> bool:
        """Make the current stream wait for the collective (no host synchronisation); raise if it failed."""
        self._channel._kernels.wait(self._handle, _current_stream(self._channel._index))
        self._tensors = ()  # freed after the wait: their memory's next use is ordered after the collective
        self._channel.raise_if_failed()
        return True


_channels: dict[tuple[str, int], Channel] = {}


def channel(group, device: torch.device) -> Channel:
    """The channel for `group` on `device`, made on first use (a collective call: every rank must reach it)."""
    device = torch.device(device)
    key = (group.group_name, device.index if device.index is not None else torch.cuda.current_device())
    ch = _channels.get(key)
    if ch is None:
        ch = _channels[key] = Channel(group, torch.device("cuda", key[1]))
    return ch


def graph_replay(device: torch.device | None) -> None:
    """Channel.graph_replay for every channel made on `device` (None: the current device)."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    for (_, i), ch in _channels.items():
        if i == index:
            ch.graph_replay()


def _default_group(group):
    import torch.distributed as dist

    return group if group is not None else dist.group.WORLD


def all_gather(a: torch.Tensor, group=None, *, async_op: bool = False):
    """`torch.distributed.all_gather_into_tensor` along dim 0, on tk's kernels."""
    return channel(_default_group(group), a.device).all_gather(a, async_op=async_op)


def reduce_scatter(a: torch.Tensor, op: str = "sum", group=None, *, async_op: bool = False):
    """`torch.distributed.reduce_scatter_tensor` along dim 0 (sum or avg), on tk's kernels."""
    return channel(_default_group(group), a.device).reduce_scatter(a, op, async_op=async_op)
