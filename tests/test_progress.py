"""The sweep's progress line (sweeper/sweep/progress.py): its ETA starts once a trial's
time can be judged, and it is per trial across parallel slots."""
import io

from sweeper.sweep.progress import ProgressLine


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _lines(events, total=20):
    """events: (seconds since start, trials ran so far); the lines written, one per event."""
    clock, out = _Clock(), io.StringIO()
    line = ProgressLine(total, stream=out, clock=clock)
    start = clock.now
    for at, ran in events:
        clock.now = start + at
        line.update(ran, 0, 0, 0, None, ran, force=True)
    return out.getvalue().splitlines()


def test_no_eta_until_three_trials_ran():
    # two slots: the first pair finishes together 20 s in (start-up and the first compile),
    # then a pair every 2 s: the sweep's throughput is one trial a second
    lines = _lines([(20.0, 1), (20.05, 2), (22.0, 3), (22.05, 4), (24.0, 5)])
    assert ["ETA" in text for text in lines] == [False, False, True, True, True]
    # after 5 trials, 4 s since the first for 4 more: 1 s a trial x 15 left
    assert lines[-1].endswith("ETA 0:15")


def test_finished_sweep_shows_its_duration():
    lines = _lines([(10.0, 1), (12.0, 2), (14.0, 3)], total=3)
    assert lines[-1] == "[3/3] ok 3  failed 0  pruned 0 | 0:14"
