"""hvd_qsgd.driver.StagedDriver: how it waits on a collective and advances the other exchanges."""
import threading
import time
from types import SimpleNamespace

from hvd_qsgd.driver import StagedDriver


class FakeLibrary:
    """Handles that complete after a number of polls; synchronize records whether the handle had
    completed when it was called, and completes it (the library's own wait)."""

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
        self.left[handle] = 0
        return f"result of {handle}"


def test_wait_alone_is_the_library_wait():
    """Nothing else in flight: the library's own wait, at once (no sleeps added to the latency)."""
    lib = FakeLibrary()
    driver = StagedDriver(lib.poll, lib.synchronize, lambda ex: False)
    assert driver.wait(lib.start("a", polls_until_done=5)) == "result of a"
    assert lib.synchronized_early == [True] and lib.polls == 0


def test_wait_runs_the_next_stage_of_other_exchanges_meanwhile():
    lib = FakeLibrary()
    stages = []

    def next_stage(ex):
        stages.append(ex.name)
        return False

    driver = StagedDriver(lib.poll, lib.synchronize, next_stage)
    other = SimpleNamespace(name="other", handle=lib.start("other", polls_until_done=2))
    driver.add(other)
    assert driver.wait(lib.start("mine", polls_until_done=6)) == "result of mine"
    assert stages == ["other"] and other.started.is_set()


def test_finish_runs_the_exchanges_own_stage_and_waits_for_one_run_by_another_thread():
    lib = FakeLibrary()
    ran = []
    driver = StagedDriver(lib.poll, lib.synchronize, lambda ex: ran.append(ex.name) or False)
    mine = SimpleNamespace(name="mine", handle=lib.start("mine", polls_until_done=100))
    driver.add(mine)
    driver.finish(mine)   # its collective still running: its stage runs (and waits in it)
    assert ran == ["mine"] and mine.started.is_set()

    release = threading.Event()
    driver = StagedDriver(lib.poll, lib.synchronize, lambda ex: release.wait(5) and False)
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
