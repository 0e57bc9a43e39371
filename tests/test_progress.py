"""The ETA (llmz/run/progress.py): the units left times the median time of recent units, so the first unit (it
compiles and warms caches) and a slow one here and there do not make it; until a second unit is done the
first's own time stands in."""
import pytest

from llmz.run import progress
from llmz.run.progress import Progress, fmt_duration


@pytest.fixture
def clock(monkeypatch):
    """A clock the test moves: clock.advance(seconds)."""
    class Clock:
        now = 1000.0

        def advance(self, seconds):
            self.now += seconds
    c = Clock()
    monkeypatch.setattr(progress.time, "perf_counter", lambda: c.now)
    return c


def test_eta_is_the_median_of_recent_units_not_the_warm_up(clock):
    p = Progress(total=100)
    assert p.eta is None and p.line() == "0.0s elapsed"
    clock.advance(60.0)                     # the first step: compilation
    p.tick()
    assert p.eta == pytest.approx(99 * 60.0)            # nothing else known yet
    for i in range(10):
        clock.advance(5.0 if i == 3 else 0.5)           # one slow step (validation, a busy core)
        p.tick()
    assert p.eta == pytest.approx(89 * 0.5)
    assert p.line() == "1m10s elapsed, ETA 44.5s"


def test_the_median_follows_the_recent_units_only(clock):
    p = Progress(total=200, done=50)                    # a resumed run
    clock.advance(1.0)
    p.tick()
    for _ in range(progress.WINDOW):
        clock.advance(2.0)
        p.tick()
    for _ in range(progress.WINDOW // 2 + 1):           # the machine got faster: most of the window says so
        clock.advance(1.0)
        p.tick()
    assert p.eta == pytest.approx((200 - p.done) * 1.0)


def test_tick_of_several_units_spreads_their_time(clock):
    p = Progress(total=10)
    clock.advance(1.0)
    p.tick()
    clock.advance(4.0)
    p.tick(4)
    assert p.done == 5 and p.eta == pytest.approx(5 * 1.0)


@pytest.mark.parametrize("seconds, text", [(12.34, "12.3s"), (245, "4m05s"), (7380, "2h03m")])
def test_durations_read_as_seconds_minutes_or_hours(seconds, text):
    assert fmt_duration(seconds) == text
