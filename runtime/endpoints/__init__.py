"""Prefill and decode endpoints: the request lifecycle on top of plans, pools and an engine.

Serving engines use the contract they know (names follow SGLang's): prefill
`endpoint.sender(room).send(...)` per chunk; decode `endpoint.receiver(room, generation)
.init(...)`; both `poll()` -> KVPoll and `abort()`.

Threads per endpoint: one control hub (ZeroMQ; reads the sockets and runs the timers, while
any thread sends: runtime/hub.py, Note [Sends from the caller's thread]) and one transfer
worker (prefill only; owns the engine batches). State shared between them sits behind one
lock per endpoint. Status is monotone: Bootstrapping < WaitingForInput <
Transferring < Success; Failed is terminal and carries a reason.

Note [Registration room]: replies to a registration travel as Status messages for the
reserved room REG_ROOM, so the wire needs no separate message type for them. Messages a
prefill rank refuses without a room to fail (malformed bytes, an abort from a connection that
is not the registered rank) are answered the same way, with the reason.

Note [Failure semantics]: what each side promises, so that no byte of a request lands in
memory that was given to another one.
- A prefill rank reports a terminal state for a (room, generation) only once none of its
  writes for it is in flight: Success after the last batch completed, Failed (a Status, or
  an AbortAck with drained=true to a rank that aborted) after every issued batch completed
  or failed. A decode rank therefore counts a prefill rank as *quiet* for a request once it
  has any of these from it. When the writes cannot be drained within `drain_timeout_s`,
  prefill says so (AbortAck drained=false) and decode quarantines at once.
- A decode request that fails for any reason of its own (abort, deadline, silent peer,
  checksum) sends an Abort to every prefill rank not yet quiet. Its pages stay allocated
  (`page_state` PENDING) until all are quiet (REUSABLE), or for at most
  `abort_ack_timeout_s`, after which they are QUARANTINED: the serving engine must never
  reuse them (a frozen prefill rank may wake up and finish its writes).
- Generations: decode keys requests by (room, generation) and ignores every message of
  another generation. Prefill serves one use of a room at a time; a request or abort of a
  newer generation ends the current use (it fails and drains) before the next use starts
  (Note [Room uses]).
- Peers: a linked peer silent for `peer_dead_after_s` fails the requests that wait on it,
  with a reason; a restarted decode rank registers again and replaces its earlier
  incarnation, whose requests fail; decode re-reads the bootstrap table to reach a restarted
  prefill rank.
- Input: every message is decoded defensively (wire.py), every request and abort must come
  from the connection that registered as that rank, every index is checked before any
  write, and everything keyed by peer input is capped (knobs.py).

Note [Room uses]: `PrefillEndpoint.rooms` holds the live use of each room. A use starts at the
first `sender(room)` or TransferRequest, takes its generation from the first request, and
ends in Success or Failed (retired into the bounded `finished` table). While a failed use
still drains, a newer request and a new `sender(room)` go to its successor, which becomes
live when the old use retires. A use that failed before any sender attached (decode aborted
before prefill started, a bad index) answers the first later `sender(room)` with Failed, so
a late prefill scheduler learns of the abort instead of waiting for its deadline.

Note [State-change signal]: a serving engine that waits for its requests' states instead of
polling them in a loop sets `endpoint.on_change` (a callable, no arguments, cheap, safe from
any thread; default: nothing). The endpoint calls it on its control thread after every turn
that read messages or ran its timers (at least every 20 ms: a request turned Success or
Failed, decode's request arrived, a deadline passed) and on prefill's transfer worker when a
request ends there. So a wait for the next state change that also has a time bound never
misses one: it wakes at the change, or at the bound for the rare change the signal does not
cover (decode's staged scatter, ended by a CUDA event that only a poll notices). SGLang's
scheduler uses it (Note [SGLang idle wait] in integrations/sglang/idle_wait.py).

Note [Typed mixins]: each endpoint is one class made of parts, one module each
(PrefillEndpoint: PrefillHandshake, PrefillControl, PrefillLiveness, PrefillWorker,
PrefillStaging; DecodeEndpoint: DecodeHandshake, DecodeLiveness, DecodeStaging). The parts
work on the state the endpoint's __init__ sets and call each other's methods. For the type
checker each part derives from its side's host (host.py: PrefillHost, DecodeHost), a class
that declares that state with its types and, as abstract methods, the methods one part calls
on another; at run time the base is `object` (host.py is imported under TYPE_CHECKING only),
so the classes and their method order are what they would be without it. mypy then checks
every use of the state in the parts, that __init__ assigns values of the declared types, that
each part's method matches its declaration, and (abstract methods) that the endpoint has
them all. A part that needs another attribute or another part's method declares it in
host.py. (mypy refuses a self-type `self: PrefillEndpoint` on a class that is not a base of
it, and with a Protocol as the host an attribute a part assigns would be a new, unchecked
definition.)
"""

from .common import REG_ROOM, KVPoll, PageState, RequestStats, check_backend
from .decode import DecodeEndpoint, DecodeReceiver
from .faults import NO_FAULTS, Faults
from .prefill import PrefillEndpoint, PrefillSender

__all__ = [
    "NO_FAULTS",
    "REG_ROOM",
    "DecodeEndpoint",
    "DecodeReceiver",
    "Faults",
    "KVPoll",
    "PageState",
    "PrefillEndpoint",
    "PrefillSender",
    "RequestStats",
    "check_backend",
]
