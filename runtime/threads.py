"""Settings of the serving engine's process that pdc's threads depend on.

Note [Switch interval]
~~~~~~~~~~~~~~~~~~~~~~
pdc's control and transfer threads run inside the serving engine's scheduler process. While a
transfer is pending, the scheduler's loop spins in Python (SGLang's disaggregated prefill
loop, vLLM's busy loop between steps), so it holds the GIL except when it calls into C; a pdc
thread that was waiting (on a socket, an event, Mooncake's status call) and wants the GIL back
waits until the interpreter asks the spinning thread to drop it: the switch interval, 5 ms by
default. A request's control path passes several such hand-offs (a message in, the write, its
completion, the answer out), each paying up to the interval on a busy scheduler. The knob
`switch_interval_us` sets a shorter one for the whole process at the integration's start;
the cost is more frequent GIL switches for the engine's own threads (a forward's Python parts
are preempted more often). BENCHMARKS.md (n) measures it against the default in one run.
"""

from __future__ import annotations

import logging
import sys

from . import knobs

logger = logging.getLogger("pdc.threads")


def apply_switch_interval() -> float | None:
    """Set the process's switch interval from the `switch_interval_us` knob (0: leave it);
    returns the interval now in force, in seconds, when the knob set it."""
    us = knobs.get("switch_interval_us")
    if us <= 0:
        return None
    if us < 10:
        raise ValueError(f"PDC_SWITCH_INTERVAL_US={us} is below 10 us, which would have the "
                         "interpreter switch threads more often than it can run them; hint: "
                         "use 100-1000 us, or 0 to leave the interpreter's interval")
    before = sys.getswitchinterval()
    sys.setswitchinterval(us / 1e6)
    logger.info("pdc: switch interval %.0f us (was %.0f us; Note [Switch interval])", us,
                before * 1e6)
    return sys.getswitchinterval()
