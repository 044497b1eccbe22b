"""hvd_qsgd.driver.StagedDriver: how it waits on a collective and advances the other exchanges."""
import threading
import time
from types import SimpleNamespace

from hvd_qsgd.driver import MAX_SLEEP_S, StagedDriver


class FakeLibrary:
    """Handles that complete after a number of polls; synchronize records whether the handle had
    completed when it was called (a library whose own wait spins must only be entered then)."""

    def __init__(self):
        self.polls, self.synchronized_early, self.left = 0, [], {}

    def start(self, name, polls_until_done):
        self.left[name] = polls_until_done
        return name

    def poll(self, handle):
        self.polls += 1
        self.left[handle] -= 1
        return self.left[handle] <= 0

    def synchronize(self, handle):
        self.synchronized_early.append(self.left[handle] > 0)
        return f"result of {handle}"


def test_wait_polls_until_complete_and_synchronizes_only_then():
    lib = FakeLibrary()
    driver = StagedDriver(lib.poll, lib.synchronize, lambda ex: False)
    handle = lib.start("a", polls_until_done=5)
    t0 = time.perf_counter()
    assert driver.wait(handle) == "result of a"
    assert lib.synchronized_early == [False]
    assert lib.polls == 5
    # four sleeps, each at most MAX_SLEEP_S (plus the scheduler's slack, bounded generously)
    assert time.perf_counter() - t0 < 4 * MAX_SLEEP_S + 0.5


def test_wait_runs_the_next_stage_of_other_exchanges_meanwhile():
    lib = FakeLibrary()
    stages = []

    def next_stage(ex):
        stages.append(ex.name)
        return False

    driver = StagedDriver(lib.poll, lib.synchronize, next_stage)
    other = SimpleNamespace(name="other", handle=lib.start("other", polls_until_done=2))
    driver.add(other)
    assert driver.wait(lib.start("mine", polls_until_done=4)) == "result of mine"
    assert stages == ["other"] and other.started.is_set()
    assert lib.synchronized_early == [False]


def test_finish_waits_for_a_stage_run_by_another_thread():
    lib = FakeLibrary()
    release = threading.Event()

    def next_stage(ex):
        release.wait(5)
        return False

    driver = StagedDriver(lib.poll, lib.synchronize, next_stage)
    ex = SimpleNamespace(handle=lib.start("x", polls_until_done=1))
    driver.add(ex)
    other = threading.Thread(target=driver.advance)
    other.start()
    time.sleep(0.05)
    assert not ex.started.is_set()
    release.set()
    driver.finish(ex)
    other.join(5)
    assert ex.started.is_set()
