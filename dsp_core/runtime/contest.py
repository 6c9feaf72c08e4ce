"""The replay contest: a segment's two best variants timed again, in turns, while the plan replays.

The measured auction (``dsp_core.backends.auction``) picks a segment's backend and thread count
from about a second of timing at freeze. On a shared machine that second may not last: the CNN
fixture's segment at two threads timed 50.5 us on one thread against 61.6 on two in its trial,
and minutes later ran 68.3 us on one where ONNX Runtime's own call on two took 61.2
(benchmarks/results/cpu_race_2026-12-05c/). So a short segment whose runner-up came close
(``auction.CONTEST_RATIO``) keeps it as a rival (the closest other backend, and the closest other
thread count of the winner: up to two), bound onto the same buffers (``CompiledSegment.rival_call``),
and the steady replay calls a ``Contest`` in place of the segment's own call:

- Between duels a step is the running variant's call and one counter decrement.
- A duel is ``DUEL_ROUNDS`` rounds of real steps, each round a burst of steps on each variant
  (the order rotating round by round, each burst about ``DUEL_BURST_S`` long, its first step
  not counted: it pays for the variant before it). Each step is one the caller asked for: a duel
  runs no extra work, its steps just run on the variants in turn.
- After a duel the running variant is kept unless another was clearly the faster: by more than
  the auction's ``TIE`` (5%) by median, and in enough rounds for a sign test at ``DUEL_SIGN_P``
  (9 rounds of 10). A tie keeps the running variant.
- A duel whose fastest was faster by more than ``TIE`` but in too few rounds leaves a doubt: its
  rounds count again in the next duel if the same variant is the fastest by more than ``TIE`` there
  (the last ``DOUBT_ROUNDS`` rounds pooled: 8 of 10 twice is 16 of 20, enough), and the next duel
  comes soon. A tie, or the running variant the fastest, clears it.
- The next duel comes after ``DUEL_GAP`` duels' worth of steps, twice that after a duel that
  changed nothing and left no doubt (up to ``DUEL_GAP_MAX``), back to ``DUEL_GAP`` after a switch or
  a doubt: about 1/17 of the steps are in duels at first, and fewer while the choice holds.

A rival that raises is dropped and released (where it was running, the holder, the segment's own
compiled segment, which owns the buffers, runs that step and the next); the holder's faults are
the plan's, as without a contest.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from dsp_core.backends.auction import TIE, sign_test
from dsp_core.backends.guard import describe

log = logging.getLogger("dsp")

DUEL_ROUNDS = 10
# A duel moves the segment only to a variant faster by more than the auction's TIE (5%) that also had
# the lower median in so many rounds that two equally fast variants would give as many at most this
# often (9 of 10). A duel is some 10 ms of steps in bursts, and every duel is another chance for
# noise: with the trial's rule (a tie to the faster by a sign test at 0.1) the CNN fixture's contest
# at one thread moved it to OpenVINO on 48.5 against 49.7 us and ran 1.9% slower than ONNX Runtime's
# own call in the row (race of 2026-12-05 05:13, cpu_race_2026-12-05d); with 9 of 10 rounds, at two
# threads, to one thread on 68.9 against 70.3 us, and ran 1.131x ONNX Runtime's call on two (05:48,
# cpu_race_2026-12-05e). Ties keep the running variant.
DUEL_SIGN_P = 0.011
# Rounds of a doubt (a variant faster by more than TIE in too few rounds) pooled with the next duel's.
# With a duel's 10 rounds alone, the CNN fixture's bound row at two threads, batch 1, moved to two ONNX
# Runtime threads (65 against 72 us in its last duel), while its ``run`` row, the same model compiled
# again, kept one thread in its last of 3 duels on 73.1 against 65.3 us for two, short of 9 rounds of
# 10, and ran 77.3 us a call against ONNX Runtime's own ``run`` at 66.9 (race of 2026-12-05 08:31,
# cpu_race_2026-12-05g).
DOUBT_ROUNDS = 3 * DUEL_ROUNDS
DUEL_BURST_S = 0.5e-3
BURST_MIN, BURST_MAX = 3, 32
DUEL_GAP = 16  # duels' worth of steps between duels
DUEL_GAP_MAX = 1024
_clock = time.perf_counter  # the duel's clock (a test gives it a fake one)


class Contest:
    """Variants of one segment's replay, the fastest running: see the module docstring.

    ``names``: the holder's, then each rival's, as the trial names them ("onnxruntime@1");
    ``calls``: their zero-argument replay calls on the same buffers; ``step_s``: the holder's
    median in the trial (sizes the bursts); ``rivals``: the rivals' compiled segments (their
    ``rival_call`` binds them again for a new steady program); ``release``: frees one of them.
    """

    def __init__(
        self,
        names: list[str],
        calls: list[Callable[[], Any]],
        step_s: float,
        rivals: list[Any],
        release: Callable[[Any], None],
    ) -> None:
        assert len(names) == len(calls) == len(rivals) + 1 >= 2
        self.names = list(names)
        self.calls = list(calls)
        self.rivals = list(rivals)
        self.running = 0
        self.call = calls[0]
        self.burst = max(BURST_MIN, min(BURST_MAX, round(DUEL_BURST_S / max(step_s, 1e-9)) + 1))
        self.gap = DUEL_GAP
        self.left = self.gap * self.duel_steps
        self.duels = 0
        self.switches = 0
        self.dropped: list[str] = []
        self.last: dict[str, Any] = {}
        self._doubt: tuple[str, list[bool]] | None = None  # (a variant, the rounds it won against the running one)
        self._release = release
        self._plan: list[tuple[int, bool, bool]] = []  # (variant, timed, ends its burst), last first
        self._burst: list[float] = []
        self._samples: list[list[float]] = []
        self._rounds: list[list[float]] = []

    @property
    def duel_steps(self) -> int:
        """Steps in one duel."""
        return DUEL_ROUNDS * len(self.calls) * self.burst

    @property
    def live(self) -> bool:
        """False once every rival was dropped."""
        return len(self.calls) > 1

    def rebind(self, calls: list[Callable[[], Any] | None]) -> None:
        """The calls bound anew (a new steady program; None: that rival cannot bind now, and is
        dropped): a duel under way is dropped, the next one comes after a gap."""
        running = self.names[self.running]
        for i in range(len(calls) - 1, 0, -1):
            if calls[i] is None:
                self._drop_rival(i, "it cannot bind onto the segment's buffers now")
        self.calls = [c for c in calls if c is not None]
        self.running = self.names.index(running) if running in self.names else 0
        self.call = self.calls[self.running]
        if self._plan:
            self._plan = []
            self.left = self.gap * self.duel_steps

    def __call__(self) -> Any:
        left = self.left - 1
        if left > 0:
            self.left = left
            try:
                return self.call()
            except Exception as exc:
                if self.running == 0:
                    raise  # the holder's fault: the plan's, as without a contest
                return self._failed(self.running, exc)
        return self._duel_step()

    # -- duels -------------------------------------------------------------------------------
    def _duel_step(self) -> Any:
        if not self._plan:
            self._start()
        side, timed, last = self._plan.pop()
        call = self.calls[side]
        try:
            if timed:
                start = _clock()
                result = call()
                self._burst.append(_clock() - start)
            else:
                result = call()
        except Exception as exc:
            self._plan = []
            self.left = self.gap * self.duel_steps
            if side == 0:
                raise
            return self._failed(side, exc)
        if last:
            self._samples[side].extend(self._burst)
            self._rounds[side].append(statistics.median(self._burst))
            self._burst = []
        if self._plan:
            self.left = 1  # the next step comes back here
        else:
            self._decide()
        return result

    def _start(self) -> None:
        n = len(self.calls)
        order = [self.running] + [i for i in range(n) if i != self.running]
        plan: list[tuple[int, bool, bool]] = []
        for r in range(DUEL_ROUNDS):
            for side in order[r % n :] + order[: r % n]:
                plan += [(side, i > 0, i == self.burst - 1) for i in range(self.burst)]
        plan.reverse()
        self._plan = plan
        self._burst = []
        self._samples = [[] for _ in range(n)]
        self._rounds = [[] for _ in range(n)]

    def _decide(self) -> None:
        names, n = self.names, len(self.calls)
        times = {names[s]: statistics.median(self._samples[s]) for s in range(n) if self._samples[s]}
        rounds = {names[s]: self._rounds[s] for s in range(n)}
        self.duels += 1
        if len(times) == n:
            faster, self._doubt = _clearly_faster(names[self.running], times, rounds, self._doubt)
            self.last = {
                "times_us": {k: round(v * 1e6, 2) for k, v in times.items()},
                "rounds": len(self._rounds[0]),
                "kept": faster,
            }
            if self._doubt is not None:
                name, won = self._doubt
                self.last["doubt"] = f"{name} the faster in {sum(won)} of {len(won)} rounds"
            if faster != names[self.running]:
                self.running = names.index(faster)
                self.call = self.calls[self.running]
                self.switches += 1
                self.gap = DUEL_GAP
                log.info("DSP replay contest: %s is the faster now (%s); it runs the segment", faster, self.last)
            elif self._doubt is not None:
                self.gap = DUEL_GAP  # an open question: asked again soon
            else:
                self.gap = min(self.gap * 2, DUEL_GAP_MAX)
        self.left = self.gap * self.duel_steps

    def _failed(self, side: int, exc: BaseException) -> Any:
        """Rival ``side`` raised: out of the contest for good; where it ran, the holder runs this
        step and the next."""
        self._drop_rival(side, f"it failed: {describe(exc)}")
        del self.calls[side]
        if self.running == side:
            self.running = 0
        elif self.running > side:
            self.running -= 1
        self.call = self.calls[self.running]
        self.left = self.gap * self.duel_steps
        return self.calls[0]()

    def _drop_rival(self, side: int, why: str) -> None:
        """Rival ``side`` (1 on) out of the contest for good, and released (``calls`` is the caller's)."""
        name = self.names.pop(side)
        self.dropped.append(f"{name}: {why}")
        log.warning("DSP replay contest: %s is out (%s); %s runs the segment", name, why, self.names[0])
        self._release(self.rivals.pop(side - 1))

    def release(self) -> None:
        """Free every rival's compiled segment (the unit is released)."""
        while self.rivals:
            self._release(self.rivals.pop())
        self.names = self.names[:1]
        self.calls = self.calls[:1]
        self.running = 0
        self.call = self.calls[0]
        self.left = 2**62

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form for ``explain``."""
        return {
            "holder": self.names[0],
            "rivals": self.names[1:],
            "running": self.names[self.running],
            "duels": self.duels,
            "switches": self.switches,
            "last": self.last,
            "dropped": self.dropped,
        }


def _clearly_faster(
    running: str,
    times: dict[str, float],
    rounds: dict[str, list[float]],
    doubt: tuple[str, list[bool]] | None = None,
) -> tuple[str, tuple[str, list[bool]] | None]:
    """The variant a duel leaves running, and the doubt it leaves.

    The fastest by median runs where it was faster than ``running`` by more than the auction's TIE
    and had the lower median in enough rounds to pass the sign test at DUEL_SIGN_P: this duel's
    rounds, after ``doubt``'s where the same variant left it (the last DOUBT_ROUNDS). Else
    ``running`` stays, with a doubt where the fastest was faster by more than TIE: (its name, the
    rounds it won, pooled); None where it was not (a tie, or ``running`` the fastest)."""
    fastest = min(times, key=lambda name: times[name])
    if fastest == running or times[fastest] * (1 + TIE) >= times[running]:
        return running, None
    won = [a < b for a, b in zip(rounds[fastest], rounds[running])]
    if doubt is not None and doubt[0] == fastest:
        won = (doubt[1] + won)[-DOUBT_ROUNDS:]
    if won and sign_test(sum(won), len(won)) <= DUEL_SIGN_P:
        return fastest, None
    return running, (fastest, won)
