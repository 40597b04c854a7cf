"""Review of the pure algorithm modules (scheduler, clock, delay, staleness, idle): one test per bug."""

import json

from fedasync.server.scheduler import StalenessAwareScheduler


def _staleness_aware_with_history():
    """Clients first reply in the order 2, 0, 1: summing their durations in that order or in
    client-id order gives results one ulp apart ((0.3 + 0.5) + 0.4 != (0.5 + 0.4) + 0.3)."""
    s = StalenessAwareScheduler(seed=1, balance=0.0)
    s.on_dispatch(0, 0.0, 0)
    s.on_dispatch(1, 3.0, 3)  # one version per second
    for c, d in [(2, 0.3), (0, 0.5), (1, 0.4)]:
        s.on_reply(c, d, 0)
    return s


def test_staleness_aware_state_round_trip_keeps_the_choices():
    """A resumed run must be bit-identical: the mean over all observed durations (the expected
    staleness of an untried client) summed the per-client sums in insertion order, but the state
    saved them sorted by client id, so after a resume it was a different float and the argmin
    (client 1's 0.4 against an untried client's global mean) could fall the other way."""
    s = _staleness_aware_with_history()
    t = StalenessAwareScheduler(seed=1, balance=0.0)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    idle = [1, 5, 6, 7]
    assert t.costs(idle) == s.costs(idle)
    assert [t.choose(idle) for _ in range(30)] == [s.choose(idle) for _ in range(30)]
