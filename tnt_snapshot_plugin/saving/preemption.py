"""Preemption: on a configured signal, finish the step, snapshot, then exit as the signal asked.

The handler only sets a flag (nothing else is safe inside a signal handler). The saver polls it at
each step end; under torch.distributed the ranks agree on it through :class:`AgreedFlag` (every
quarter second of training or so), so all ranks snapshot at the same step even if only some
received the signal. After the final snapshot the previous handler of the signal runs: the
default action terminates the process with that signal, a Python handler is called, an ignored
signal is ignored. If a Python handler returns (or the signal was ignored), training goes on and
the saver no longer watches the signals.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any, Callable, Optional

from tnt_snapshot_plugin.distributed import AgreedFlag, Collectives
from tnt_snapshot_plugin.saving.wall_clock import PREEMPTED

logger = logging.getLogger(__name__)


#: The plugin's handlers installed now, per signal, oldest first: a handler removed while a later
#: one is installed hands its own predecessor to that later one, so savers may stop in any order.
_installed: dict[int, list["PreemptionHandler"]] = {}


class PreemptionHandler:
    def __init__(
        self,
        signals: tuple[signal.Signals, ...],
        collectives: Collectives,
        on_signal: Optional[Callable[[], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_signal()``: called (on the main thread, as Python runs signal handlers) when a
        watched signal first arrives, after :attr:`received` is set. ``clock``: the agreement's
        time source (see AgreedFlag)."""
        self._signals = signals
        self._on_signal = on_signal
        #: the signal received; the saver's hot path reads it (in one process, poll() is this flag)
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}
        # a group of one rank has no one to agree with: its poll is the flag, as in one process
        self._flag = AgreedFlag(collectives, clock) if collectives.world_size > 1 else None
        #: whether the ranks must agree on it (poll() then runs a collective)
        self.distributed = self._flag is not None

    def install(self) -> None:
        if not self._signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "tnt_snapshot_plugin: training runs outside the main thread; signals %s cannot "
                "be handled there, so no snapshot is taken on preemption",
                [s.name for s in self._signals],
            )
            return
        for sig in self._signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
            _installed.setdefault(sig, []).append(self)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            chain = _installed.get(sig, [])
            if self in chain:
                later = chain.index(self) + 1
                if later < len(chain):  # installed after this one: it now hands on to our predecessor
                    chain[later]._previous[sig] = previous
                chain.remove(self)
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if self._flag is not None:
            self._flag.drain()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is None:
            self.received = signum
            if self._on_signal is not None:
                self._on_signal()

    def due(self, step: int) -> bool:
        """Whether ``step`` is one to poll at (every step in one process; under torch.distributed
        the agreement's steps, the same on every rank: see AgreedFlag)."""
        return self._flag is None or self._flag.due(step)

    def next_poll(self, step: int) -> int:
        """The first step from ``step`` on that :meth:`due` names."""
        return step if self._flag is None else self._flag.next_due(step)

    def poll(self, vote: int, step: int) -> int:
        """PREEMPTED (2) to stop now, else the MAX of the ranks' other ``vote`` (cadence.py);
        all ranks get the same answer at the same step. Call it at the steps :meth:`due` names."""
        local = PREEMPTED if self.received is not None else vote
        if self._flag is None:
            return local
        return self._flag.poll(local, step)

    @property
    def received_signal(self) -> int:
        """The signal this rank received (a rank told by another one: the first watched signal)."""
        return self.received if self.received is not None else self._signals[0]

    def finish(self) -> None:
        """After the final snapshot: hand the signal to whoever handled it before us."""
        sig = self.received_signal
        previous = self._previous.get(sig, signal.SIG_DFL)
        self.uninstall()
        self.received = None
        if callable(previous):
            previous(sig, None)
        elif previous == signal.SIG_DFL or previous is None:
            logger.info("tnt_snapshot_plugin: snapshot saved; exiting on %s", signal.Signals(sig).name)
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
