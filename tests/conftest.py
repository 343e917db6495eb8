import gc
import warnings

import pytest

warnings.filterwarnings("ignore", message=".*module not found.*")


def _gpu_skip_reason() -> str:
    import torch

    from thunder_tk import _extension

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    cap = torch.cuda.get_device_capability(0)
    if cap != _extension.SUPPORTED_CAPABILITY:
        return f"GPU is sm_{cap[0]}{cap[1]}, tk kernels need sm_90"
    if _extension.extension() is None:
        return _extension.unavailable_reason()
    return ""


def _shard(config, items):
    """THUNDER_TK_TEST_SHARD=k/n keeps every n-th collected test from the k-th on (1 <= k <= n) and deselects the rest:
    the whole GPU suite no longer fits one device call (2240 of its tests took about 470 s on an H200, beside a
    110 s build, in 600), and taking tests in turns gives each shard about the same share of every file's time, the
    slow ones included."""
    import os

    spec = os.environ.get("THUNDER_TK_TEST_SHARD", "")
    if not spec:
        return
    try:
        k, n = (int(x) for x in spec.split("/"))
        if not 1 <= k <= n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"THUNDER_TK_TEST_SHARD must be k/n with 1 <= k <= n, not {spec!r}") from None
    kept = items[k - 1::n]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k - 1])
    items[:] = kept


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: shards and the probe see the tests that run
def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            if reason is None:
                reason = _gpu_skip_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
    # Only the CPU tests start processes that compile for the CPU (torchrun ranks, `thunder-tk pretrain` on the CPU);
    # a run of GPU tests alone skips the probe (14 s on CI's two cores, paid before a GPU call's first test).
    if not config.option.collectonly and any("gpu" not in item.keywords for item in items):
        _inductor_isa_probe_once(config)


# Test files whose tests start several processes (torchrun ranks, `thunder-tk pretrain` runs), the costliest first.
# xdist's loadfile hands files out by test count, most first, which left these few-test files to the end of a run,
# where a worker with two tests to go takes the next file as well: on two CPUs both distributed files ran one after
# the other on one worker while the other worker sat idle (about 150 s of CI's wall time). They go out first instead.
# Only the order of the files changes; a name that no longer matches a file is ignored.
COSTLY_FILES_FIRST = ("test_pretrain_distributed.py", "test_rms_norm_fsdp.py", "test_fsdp_schedule.py")


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with COSTLY_FILES_FIRST handed out before the other files (which keep xdist's order)."""
    if config.getvalue("dist") != "loadfile":
        return None
    try:
        from xdist.scheduler import LoadFileScheduling
    except ImportError:
        return None
    if not callable(getattr(LoadFileScheduling, "_assign_work_unit", None)):
        return None  # an xdist whose scheduler is built otherwise: its own order

    class CostlyFilesFirst(LoadFileScheduling):
        _ordered = False

        def _assign_work_unit(self, node):
            if not self._ordered:  # the first assignment: the work queue (file -> tests) is complete
                self._ordered = True
                rank = {name: i for i, name in enumerate(COSTLY_FILES_FIRST)}
                costly = sorted((s for s in self.workqueue if s.rsplit("/", 1)[-1] in rank),
                                key=lambda s: rank[s.rsplit("/", 1)[-1]])
                for scope in reversed(costly):
                    self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return CostlyFilesFirst(config, log)


def _one_share_of_the_cpus_each(config):
    """An xdist worker's torch runs its ops on its share of the CPUs (the CPUs over the workers, at least one), and the
    processes its tests start inherit that share through OMP_NUM_THREADS (torchrun sets 1 for several ranks, not
    for one). With every worker's ops on all the CPUs, each worker's OpenMP threads waited on those the other
    workers kept busy: on two CPUs, a one-layer model's step of 15 ms took a second in the suite. A value of
    OMP_NUM_THREADS given by the environment is kept."""
    import os

    if not hasattr(config, "workerinput") or "OMP_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cpus // int(config.workerinput.get("workercount", 1)))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def _inductor_isa_probe_once(config):
    """Inductor probes each vector ISA the CPU reports before its first CPU compile in a process: it builds a kernel
    for it and loads it in a fresh Python that imports torch (six such processes on an AVX-512/AMX CPU, about 8 s
    for each of the suite's torchrun ranks and `thunder-tk pretrain` runs). The test process probes once and hands
    its answers to the processes its tests start: TORCHINDUCTOR_VEC_ISA_OK=1 where every ISA the CPU reports passed
    (inductor then skips its base check), and each probe's answer in a JSON file (THUNDER_TK_TEST_ISA_PROBES) that
    `subprocess_site/sitecustomize.py`, put on their PYTHONPATH, answers inductor's AVX-512 bf16, VNNI and AMX probes
    from (TORCHINDUCTOR_VEC_ISA_OK does not skip those). The xdist controller runs no tests and skips it."""
    import atexit
    import importlib.util
    import json
    import os
    import platform
    import shutil
    import sys
    import tempfile

    controller = getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")
    if controller or not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "subprocess_site")
    try:
        from torch._inductor import cpu_vec_isa

        spec = importlib.util.spec_from_file_location("_tk_subprocess_site", os.path.join(site, "sitecustomize.py"))
        probe_key = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(probe_key)
        probe_key = probe_key.probe_key
        answers = {}
        probe = cpu_vec_isa.VecISA.check_build

        def recording(self, code):
            answers[probe_key(self, code)] = answer = bool(probe(self, code))
            return answer

        cpu_vec_isa.VecISA.check_build = recording
        try:
            reported = cpu_vec_isa.x86_isa_checker()
            candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                          if all(flag in reported for flag in str(isa).split())]
            valid = cpu_vec_isa.valid_vec_isa_list()
        finally:
            cpu_vec_isa.VecISA.check_build = probe
        if candidates and valid == candidates:
            os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
        if answers:
            folder = tempfile.mkdtemp(prefix="tk_isa_probes_")
            atexit.register(shutil.rmtree, folder, True)
            path = os.path.join(folder, "answers.json")
            with open(path, "w") as f:
                json.dump(answers, f)
            os.environ["THUNDER_TK_TEST_ISA_PROBES"] = path
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    except Exception:  # another torch's inductor: its subprocesses probe for themselves
        pass


def pytest_configure(config):
    """SIGTERM (`timeout` ending a GPU step in gpu_run.sh) stops the run as Ctrl-C does: pytest then prints what failed
    so far and writes its junit XML, where a plain SIGTERM left neither. `timeout` signals the process and its group,
    so the same signal may come twice: only the first counts. xdist workers keep the default (their controller
    reports). A worker is known by its config's workerinput, not by PYTEST_XDIST_WORKER: a pytest that a worker's test
    starts inherits that variable and is no worker. (First: a worker's share of the CPUs. Inductor's ISA probe comes
    after collection, pytest_collection_modifyitems.)"""
    import signal
    import threading

    global _config
    _config = config
    _one_share_of_the_cpus_each(config)
    if hasattr(config, "workerinput") or threading.current_thread() is not threading.main_thread():
        return

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum} (SIGTERM)")

    signal.signal(signal.SIGTERM, interrupt)


_config = None


def pytest_runtest_logreport(report):
    """A failure's report the moment it happens, not only in the summary at the end of the run: on the terminal, and
    appended to the file THUNDER_TK_FAILURE_LOG names (gpu_run.sh's failures.log). A GPU call stopped at the device
    tool's time limit, before pytest's summary, then still says what failed and why (the first whole-suite call of
    2026-12-01 lost a failure's text that way). The xdist controller reports its workers' failures; workers write
    nothing."""
    import os

    if not report.failed or _config is None or hasattr(_config, "workerinput"):
        return
    text = f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n"
    reporter = _config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(text)
    path = os.environ.get("THUNDER_TK_FAILURE_LOG")
    if path:
        with open(path, "a") as log:
            log.write(text + "\n")


@pytest.fixture(autouse=True)
def gpu_test_watchdog(request):
    """A GPU test that runs past THUNDER_TK_TEST_TIMEOUT seconds (default 240; 0: no limit) ends the process with every
    thread's traceback on stderr: a hung kernel then names its test at once instead of holding the GPU host until the
    suite's own timeout (gpu_run.sh goes on to its next step)."""
    import faulthandler
    import os
    import sys

    limit = float(os.environ.get("THUNDER_TK_TEST_TIMEOUT", "240"))
    if "gpu" not in request.keywords or limit <= 0:
        yield
        return
    # The process's own stderr: pytest's capture has fd 2 in a file that nobody reads once the process is gone.
    capture = request.config.pluginmanager.getplugin("capturemanager")
    err_fd = getattr(getattr(getattr(capture, "_global_capturing", None), "err", None), "targetfd_save", None)
    out = os.fdopen(os.dup(err_fd), "w") if err_fd is not None else sys.__stderr__
    faulthandler.dump_traceback_later(limit, exit=True, file=out)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if out is not sys.__stderr__:
            out.close()


@pytest.fixture(autouse=True)
def no_cyclic_gc_in_cpu_tests(request):
    """CPU tests run with the cyclic garbage collector off, as `thunder-tk pretrain` traces: Thunder's interpreter
    can fail with "dictionary changed size during iteration" when the collector frees a module in the middle of a
    trace (lightning-thunder#2095, `pretrain.tracing_without_cyclic_gc`; it failed a LitGPT routing test in CI once).
    Each test's garbage is collected after it from the young generations only: a full collection per test (the
    whole heap of torch, Thunder and LitGPT) cost CI 100 s. GPU tests keep the collector: their cycles may hold
    device memory."""
    if "gpu" in request.keywords or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(1)


@pytest.fixture(autouse=True)
def gemm_size_policy_off(request, monkeypatch):
    """The suite's GEMMs are small, and it checks their routing and results: tk claims every supported size unless a
    test asks for the size policy (marker `gemm_size_policy`)."""
    from thunder_tk import claim_rules

    monkeypatch.setattr(claim_rules, "gemm_size_policy_default", "gemm_size_policy" in request.keywords)


@pytest.fixture
def standin_nvfuser():
    """Registers an eager fusion executor under the name "nvfuser" (no nvFuser build exists for torch 2.11)."""
    from thunder.extend import deregister_executor, get_executor, register_executor

    from standins import EagerRegionFuser

    assert get_executor("nvfuser") is None, "a real nvFuser is loaded; these tests expect none"
    fuser = EagerRegionFuser("nvfuser")
    register_executor(fuser)
    yield fuser
    deregister_executor(fuser)


@pytest.fixture
def standin_attention(monkeypatch):
    """A CPU attention executor, put where tk looks for cuDNN/SDPA."""
    from thunder.extend import deregister_executor, register_executor

    import thunder_tk.executor as tk_executor
    from standins import make_standin_attention

    ex = make_standin_attention()
    register_executor(ex)
    monkeypatch.setattr(tk_executor, "ATTENTION_FALLBACKS", (ex.name,))
    yield ex
    deregister_executor(ex)


@pytest.fixture
def kernels_not_built(monkeypatch):
    """As if installed without nvcc."""
    from thunder_tk import _extension

    info = {"kernels_built": False, "reason": "no CUDA compiler (nvcc) was found at install time"}
    monkeypatch.setattr(_extension, "build_info", lambda: info)
    _extension._load.cache_clear()
    yield info["reason"]
    _extension._load.cache_clear()


@pytest.fixture
def extension_without_gpu():
    """The compiled module, where it is built and there is no GPU (CI): its argument checks run on made-up
    addresses, which no launch then reads (a launch fails for want of a device)."""
    import torch

    from thunder_tk import _extension

    module = _extension.extension()
    if module is None:
        pytest.skip(f"kernels not built: {_extension.unavailable_reason()}")
    if torch.cuda.is_available():
        pytest.skip("a GPU would run the launch on these made-up addresses")
    return module


@pytest.fixture
def kernels_built(monkeypatch):
    """As if the compiled module were present (for judging rules; nothing is launched)."""
    from thunder_tk import _extension
    from thunder_tk.claim_rules import KERNELS_IN_SOURCE

    class FakeModule:
        @staticmethod
        def kernels():
            return sorted(KERNELS_IN_SOURCE)

    monkeypatch.setattr(_extension, "_load", lambda: (FakeModule, ""))
    yield


@pytest.fixture
def standin_tk_build(monkeypatch):
    """As if built with this version's kernels, the attention kernels standing in on CPU tensors
    (`standins.StandinBuild`; `.add(name)` and `.remove(name)` change which kernels the build has)."""
    from standins import StandinBuild

    return StandinBuild(monkeypatch)
