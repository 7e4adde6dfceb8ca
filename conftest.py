"""Test-session settings shared by every test.

- Inductor compiles in the calling thread (``TORCHINDUCTOR_COMPILE_THREADS=1``). The tests fork
  their ranks (``tests/dist_helpers.py``); a pytest process that compiled with inductor's pool
  (one worker thread per core) forks children whose pool thread does not exist, and a child
  that must compile waits for ever on it (``Future.result`` in ``CppCodeCache.load_async``).
  It only showed on a machine whose inductor cache was cold: a cached kernel is never compiled.
  Set before anything imports torch (inductor reads it once, at import).
- Every test has a time limit (``--time-limit``, default 600 s; ``@pytest.mark.time_limit(s)``
  for one test): past it the test fails with every thread's stack instead of holding the suite.
- Doctest collection (pyproject's ``--doctest-modules``) imports every module: an integration
  whose trainer is not installed is left out instead of failing the collection.
"""

import faulthandler
import importlib.util
import os
import signal
import sys

import pytest

pytest_plugins = ["pytester"]  # tests/test_time_limit.py runs small pytest sessions

os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

collect_ignore = []
if importlib.util.find_spec("lightning") is None:
    collect_ignore.append("zerokit/integrations/lightning.py")

DEFAULT_TIME_LIMIT_S = 600.0


class TestTimeLimitExceeded(BaseException):
    """Raised in the main thread when a test outlives its limit (a BaseException, so a test's
    own ``except Exception`` cannot swallow it)."""


def pytest_addoption(parser):
    parser.addoption(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help="seconds a test may run before it fails with a stack dump (0: no limit)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "time_limit(seconds): this test's own time limit")


def _limit_for(item) -> float:
    marker = item.get_closest_marker("time_limit")
    return float(marker.args[0]) if marker else item.config.getoption("--time-limit")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arm an alarm around the whole test (setup, call, teardown): SIGALRM dumps every thread's
    stack to stderr and raises in the main thread, where the forked ranks' join loop waits
    (``run_distributed`` then kills the ranks)."""
    limit = _limit_for(item)
    if limit <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        sys.stderr.write(f"\n=== {item.nodeid} ran past its time limit of {limit:g} s ===\n")
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a captured stream without a file
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        raise TestTimeLimitExceeded(f"{item.nodeid} ran past its time limit of {limit:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
