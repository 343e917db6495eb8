"""The GPU suite's watchdog (conftest.gpu_test_watchdog): a GPU test past THUNDER_TK_TEST_TIMEOUT ends the pytest process
with the tracebacks of its threads, naming the test, instead of holding the GPU host until the suite's timeout. And a
run ended by SIGTERM (conftest.pytest_configure; gpu_run.sh's `timeout`) still reports what failed so far."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def suite_conftest(tmp_path, picks: str) -> None:
    """A conftest in tmp_path that loads the suite's (under another module name) and takes from it only what `picks`
    binds (lines of Python over `suite`)."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
        suite = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite)
    """) + textwrap.dedent(picks) + "\n")


def run_suite(tmp_path, body: str, timeout_s: str) -> tuple[subprocess.CompletedProcess, float]:
    suite_conftest(tmp_path, "gpu_test_watchdog = suite.gpu_test_watchdog")  # the fixture alone, no GPU skip
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, THUNDER_TK_TEST_TIMEOUT=timeout_s)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                           str(tmp_path / "test_stuck.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    return done, time.monotonic() - t0


STUCK = """
    import time
    import pytest

    @pytest.mark.gpu
    def test_stuck_kernel():
        time.sleep(60)
"""


def test_a_stuck_gpu_test_ends_the_run_and_is_named(tmp_path):
    done, took = run_suite(tmp_path, STUCK, "2")
    assert done.returncode != 0
    assert took < 45, took
    assert "Timeout" in done.stderr and "test_stuck_kernel" in done.stderr, done.stderr[-2000:]


def test_other_tests_and_a_zero_limit_are_left_alone(tmp_path):
    quick = STUCK.replace("time.sleep(60)", "time.sleep(3)") + """
    def test_cpu_not_watched():
        time.sleep(3)
"""
    done, _ = run_suite(tmp_path, quick, "0")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    done, _ = run_suite(tmp_path, quick.replace("@pytest.mark.gpu", ""), "1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_run_ended_by_sigterm_reports_its_failures_and_writes_its_junit_xml(tmp_path):
    """As `timeout` ends a step: SIGTERM to the process and then to its group (twice). The failure before the
    signal is printed and in the XML; the stuck test is named as interrupted."""
    import signal

    suite_conftest(tmp_path, "pytest_configure = suite.pytest_configure")
    (tmp_path / "test_cut.py").write_text(textwrap.dedent("""
        import time

        def test_fails_first():
            assert 1 + 1 == 3

        def test_still_running():
            open("started", "w").close()
            time.sleep(60)
    """))
    xml = tmp_path / "report.xml"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                             f"--junitxml={xml}", str(tmp_path / "test_cut.py")], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in out and "SIGTERM" in out, out[-2000:]
    assert "assert (1 + 1) == 3" in out and "1 failed" in out, out[-2000:]
    report = xml.read_text()
    assert 'failures="1"' in report and "test_fails_first" in report, report


def test_a_failure_is_reported_and_logged_as_it_happens(tmp_path):
    """conftest.pytest_runtest_logreport: a failure's text is on the terminal and in THUNDER_TK_FAILURE_LOG before the
    next test starts (so a GPU call cut at the device tool's limit keeps it), once, beside pytest's own summary."""
    suite_conftest(tmp_path, """
        pytest_runtest_logreport = suite.pytest_runtest_logreport

        def pytest_configure(config):
            suite._config = config
    """)
    (tmp_path / "test_cut.py").write_text(textwrap.dedent("""
        import os

        def test_fails_first():
            assert 1 + 1 == 3

        def test_sees_the_failure_logged():
            text = open(os.environ["THUNDER_TK_FAILURE_LOG"]).read()
            assert "FAILED test_cut.py::test_fails_first (call)" in text and "assert (1 + 1) == 3" in text, text
    """))
    log = tmp_path / "failures.log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                           str(tmp_path / "test_cut.py")], cwd=tmp_path, env=dict(os.environ, THUNDER_TK_FAILURE_LOG=str(log)),
                          capture_output=True, text=True, timeout=120)
    out = done.stdout
    assert done.returncode == 1 and "1 failed, 1 passed" in out, out[-2000:] + done.stderr[-2000:]
    assert out.index("FAILED test_cut.py::test_fails_first (call)") < out.index("= FAILURES ="), out[-2000:]
    assert log.read_text().count("FAILED ") == 1, log.read_text()


def test_shards_split_the_tests_between_them(tmp_path):
    """conftest's THUNDER_TK_TEST_SHARD=k/n: the shards' tests are disjoint and together every test, taken in turns;
    a malformed value is named."""
    suite_conftest(tmp_path, "pytest_collection_modifyitems = suite.pytest_collection_modifyitems")
    (tmp_path / "test_many.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(7)))

    def collected(shard):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                               str(tmp_path / "test_many.py")], cwd=tmp_path,
                              env=dict(os.environ, THUNDER_TK_TEST_SHARD=shard), capture_output=True, text=True,
                              timeout=120)
        return done, [line.split("::")[1] for line in done.stdout.splitlines() if "::" in line]

    _, first = collected("1/2")
    _, second = collected("2/2")
    assert first == ["test_0", "test_2", "test_4", "test_6"] and second == ["test_1", "test_3", "test_5"]
    done, _ = collected("3/2")
    assert done.returncode != 0 and "THUNDER_TK_TEST_SHARD must be k/n" in done.stdout + done.stderr


def test_the_isa_probe_runs_only_for_cpu_tests(tmp_path):
    """conftest probes inductor's vector ISAs once for the processes CPU tests start; a run of GPU tests alone, and a
    collection without a run, skip it."""
    marker = tmp_path / "probed"
    suite_conftest(tmp_path, f"""
        pytest_collection_modifyitems = suite.pytest_collection_modifyitems
        suite._inductor_isa_probe_once = lambda config: open({str(marker)!r}, "a").write("probe\\n")
        suite._gpu_skip_reason = lambda: "not asked here"  # (the real one imports torch: seconds a run)
    """)
    (tmp_path / "test_mixed.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.gpu
        def test_on_gpu():
            pass

        def test_on_cpu():
            pass
    """))

    def probes(*args):
        marker.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", *args,
                               str(tmp_path / "test_mixed.py")], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return marker.read_text().count("probe") if marker.exists() else 0

    assert probes("-m", "gpu") == 0
    assert probes("--collect-only") == 0
    assert probes() == 1
