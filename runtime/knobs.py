"""Every runtime timeout and limit, declared once with its default and its meaning.

Read a knob with `knobs.get("name")`; set one for a process with the environment variable
`PDC_<NAME>` (upper case) or in code with `knobs.override(name=value)`. Code never reads
os.environ for these directly, so this file is the complete list. docs/knobs.md is generated
from `table()` (`python -m pdc.runtime.knobs > docs/knobs.md`; a test keeps them in sync).

Knobs are read when they are needed, not cached, so an override takes effect at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    name: str
    default: float | int | str
    unit: str
    doc: str


KNOBS = {k.name: k for k in (
    # ~~~ time ~~~
    Knob("bootstrap_timeout_s", 30.0, "s", "how long a decode rank waits for the prefill "
         "bootstrap table and for every linked prefill rank to accept its registration"),
    Knob("transfer_timeout_s", 60.0, "s", "deadline of one request on decode, from init() to "
         "Success; past it the request fails (reason names the prefill ranks that did not "
         "report) and decode sends an abort"),
    Knob("prefill_room_timeout_s", 120.0, "s", "deadline of one request on prefill, from the "
         "first sender() or TransferRequest to a terminal state; bounds rooms whose decode "
         "never sends its request or whose prefill never sends its chunks"),
    Knob("abort_ack_timeout_s", 10.0, "s", "how long decode keeps a failed request's pages "
         "waiting for every prefill rank's drain ack; past it the pages are quarantined "
         "(never reused)"),
    Knob("drain_timeout_s", 30.0, "s", "how long prefill waits for a failed room's in-flight "
         "writes; past it prefill acks with drained=false (decode quarantines at once) and "
         "forgets the room"),
    Knob("heartbeat_interval_s", 1.0, "s", "period of heartbeats between linked ranks"),
    Knob("peer_dead_after_s", 5.0, "s", "a linked peer silent for this long is declared dead "
         "and the requests waiting on it fail with a reason; a peer that speaks again is "
         "alive again for new requests"),
    Knob("reconnect_interval_s", 1.0, "s", "decode re-reads the bootstrap table this often "
         "while a prefill peer is dead, and re-registers when that rank has a new address "
         "(a restarted prefill rank)"),
    Knob("poll_sleep_s", 0.0002, "s", "sleep of the transfer worker between polls of what "
         "cannot wake it: CUDA events of the forward, and in-flight writes of an engine "
         "that ends them only when polled (NIXL)"),
    Knob("worker_poll", 0, "0/1", "1: the transfer worker polls every poll_sleep_s while "
         "writes are in flight and every 10 x poll_sleep_s while idle, as before "
         "2026-12-03, instead of sleeping until work or a finished batch wakes it (Note "
         "[Completion wake-up]); a fallback, and the 'before' of bench/worker_wake.py"),
    Knob("mooncake_status_nice", 0, "nice", "> 0: the Mooncake engine's per-peer thread, "
         "whose status call spins a core while a batch is written, runs at this nice value "
         "(1-19), yielding that core to the serving engine's threads (Note [Status spin "
         "priority] in runtime/engines/mooncake.py); 0: the process's priority"),
    Knob("endpoint_cpus", "", "CPU list", "e.g. '1' or '2-3': every thread pdc starts inside "
         "a serving engine (hub, transfer worker, the engine's and Mooncake's threads) computes "
         "on these CPUs instead of the engine's cores (Note [Endpoint CPUs] in "
         "runtime/cpus.py); empty: where the engine's thread that starts them computes"),
    # ~~~ addresses (Note [Bind and advertise] in control.py) ~~~
    Knob("bind_host", "127.0.0.1", "IP", "interface the control sockets (bootstrap server, "
         "hubs) listen on; a wildcard (0.0.0.0, ::) listens on all and then needs "
         "advertise_host"),
    Knob("advertise_host", "", "IP", "address peers are told to dial for this process's "
         "control sockets and its transfer engine (Mooncake's hostname); empty = bind_host"),
    # ~~~ authentication (Note [Control authentication] in auth.py) ~~~
    Knob("control_auth", "auto", "auto/on/off", "auto: authenticate every control message "
         "when a secret is set, and refuse to listen on a non-loopback bind_host without one "
         "(Note [Auth default]); on: require a secret; off: never authenticate (a trusted "
         "network only)"),
    Knob("control_secret_file", "", "path", "file holding the control secret (16+ bytes; "
         "surrounding whitespace ignored); every prefill and decode process of a deployment "
         "needs the same one"),
    Knob("control_secret", "", "text", "the control secret itself, when no file is given "
         "(set it in the environment only: never pass a secret as a command-line flag)"),
    # ~~~ limits (everything keyed by peer input is capped) ~~~
    Knob("max_message_bytes", 64 << 20, "bytes", "control messages above this are refused "
         "by ZeroMQ before decoding (the sending connection is dropped)"),
    Knob("max_pending_rooms", 65536, "rooms", "live rooms a prefill rank tracks at once; a "
         "TransferRequest that would create one more is refused with a reason"),
    Knob("max_pending_rooms_per_peer", 16384, "rooms", "live rooms the requests of one decode "
         "rank may create before prefill's sender() claims them; more are refused with a "
         "reason (one flooding peer cannot crowd out the others)"),
    Knob("max_finished_rooms", 65536, "rooms", "outcomes of finished rooms a prefill rank "
         "remembers (answers to late or repeated messages, aborts before the first chunk); "
         "oldest forgotten first"),
    Knob("max_registrations", 1024, "peers", "transfer-engine peers a prefill rank connects "
         "over its lifetime (registrations and re-registrations of restarted decode ranks); "
         "more are refused with a reason"),
    Knob("max_control_sessions", 4096, "sessions", "authenticated connections a control "
         "socket holds, and pending challenges besides; the oldest is forgotten first (its "
         "peer says hello again)"),
    Knob("max_messages_per_tick", 256, "messages", "control messages the hub reads from one "
         "socket before it runs its timers again (a flood cannot starve them)"),
    Knob("control_lane", 1, "0/1", "1: hubs on loopback addresses also talk over an abstract "
         "Unix-domain socket named after the listening address, read and written by their "
         "own threads, instead of through ZeroMQ's I/O threads (Note [Same-host lane] in "
         "runtime/lane.py; never with a control key); 0: ZeroMQ only"),
    Knob("control_queue_depth", 10000, "messages", "ZeroMQ high-water mark of each control "
         "connection; messages beyond it are dropped and counted, and the requests they "
         "belonged to fail by their deadlines"),
    Knob("staged_min_descriptors", 1024, "descriptors", "decode stages a request's partial "
         "entries (head slices, sub-blocks) from one prefill rank when the direct path would "
         "need more descriptors than this for them; 0 stages every partial entry"),
    Knob("descriptor_copy_graphs", 1, "0/1", "1: a descriptor-copy launch of a shape already "
         "seen on the same stream replays a CUDA graph instead of Triton's launcher (Note "
         "[Descriptor-copy graphs] in runtime/descriptor_copy.py); 0: every launch through "
         "Triton"),
    Knob("advance_inline", 1, "0/1", "1: the prefill thread that makes work (the control "
         "thread after a decode request, cuda_ipc's completion thread after a batch) moves the "
         "rooms forward itself when no worker pass runs (Note [Advance on the waking thread] in "
         "runtime/endpoints/prefill_worker.py); 0: it wakes the transfer worker, as before"),
    Knob("landed_wakeup", 1, "0/1", "1: a cuda_ipc decode rank queues a host function "
         "behind each written event it opened (Note [Landed wake-up] in "
         "runtime/engines/cuda_watch.py), which wakes the endpoint's caller as the bytes "
         "land; 0: the caller finds the event complete at its next poll"),
    Knob("success_by_event", 1, "0/1", "1: a cuda_ipc prefill rank sends decode its last "
         "writes' done event (a CUDA IPC handle) as soon as they are queued, and decode's poll "
         "ends the request when that event completes, without waiting for prefill's Success "
         "message (Note [Success by event] in runtime/endpoints/prefill_worker.py); 0: only "
         "the Success message ends it"),
    Knob("descriptor_grids", 1, "0/1", "1: the direct path hands an engine that takes them "
         "(cuda_ipc) a chunk's descriptors as base addresses x id runs, which one kernel expands "
         "on the device (Note [Descriptor grids] in runtime/engines/base.py); 0: the flat "
         "descriptor list"),
    Knob("staging_graphs", 1, "0/1", "1: the staged path's copy-kernel launches of one "
         "gather or scatter whose shape ran before on the same stream replay as one CUDA graph "
         "(Note [Staging graphs] in runtime/staging_graphs.py); 0: every launch through Triton"),
    Knob("graph_input", "kernel", "copy/kernel/mapped", "how a replayed copy-kernel graph "
         "reads its per-call values from its pinned buffer (Note [Pinned graph input] in "
         "runtime/pinned_graph.py): kernel = its first node is a kernel reading them across "
         "the bus; copy = its first node copies them to the device; mapped = every launch "
         "reads them across the bus"),
    Knob("staging_copies", "auto", "auto/torch/kernels", "how the staged path copies on "
         "device pools (pools.TensorPools): kernels = one copy-kernel launch per component "
         "and run of items, torch = one indexing op per staging block; auto = kernels on "
         "CUDA. Host pools always use numpy"),
    Knob("staging_arena_bytes", 512 << 20, "bytes", "registered staging arena of each rank "
         "(decode: regions it hands to prefill; prefill: gather buffers); 0 turns the staged "
         "path off. A request whose region does not fit on decode moves through a ring of slots "
         "(staging_ring_slots); with no ring either, the direct path"),
    Knob("staging_ring_slots", 4, "slots", "slots of the ring a staged request takes when its "
         "whole region does not fit in decode's arena (Note [Staging ring] in "
         "runtime/staging_ring.py): prefill fills slot after slot, decode scatters and frees "
         "each; fewer when the arena holds fewer; 0 turns rings off (such a request takes the "
         "direct path, as before 2026-12-05)"),
    Knob("staging_ring_slot_bytes", 64 << 20, "bytes", "most bytes of one ring slot (one "
         "piece, one write and one message each way); smaller when the arena's largest free "
         "stretch cannot hold staging_ring_slots of them, never below one item of the "
         "link's largest staging block (an 8K Llama-70B request through the default arena "
         "on an H100: 150 ms with 64 MiB, 414 ms with 8 MiB, BENCHMARKS.md (t))"),
    # ~~~ observability ~~~
    Knob("transfer_log", 0, "0/1", "1: one JSON line per finished request and side on the "
         "`pdc.transfer` logger (bytes, descriptors, bootstrap/wait/transfer ms, GB/s; "
         "runtime/metrics.py)"),
    Knob("health_stall_s", 30.0, "s", "a rank is unhealthy (runtime/health.py) when writes "
         "are in flight and none completed for this long, or its control thread has not run "
         "for this long"),
    Knob("health_max_quarantined", 64, "requests", "a decode rank is unhealthy once more "
         "requests than this are quarantined (their pages are never reused)"),
    # ~~~ SGLang backend (Note [SGLang per-layer sends] in integrations/sglang/layerwise.py) ~~~
    Knob("sglang_layer_send", 0, "0/1", "1: an SGLang prefill server of the pdc backend "
         "queues each batch's pages before the forward and sends each attention layer's "
         "pages as that layer's forward completes, instead of all layers after the forward "
         "(\"lever A\"; paged-KV families without request state, no speculation)"),
    Knob("sglang_idle_wait_us", 2000, "us", "after a turn of SGLang's scheduler that ran "
         "nothing while a transfer of the pdc backend is pending, the scheduler waits for a "
         "request, a state change of a pdc request, or this long, whichever comes first, "
         "instead of turning again at once (Note [SGLang idle wait] in "
         "integrations/sglang/idle_wait.py); 0: never waits"),
    Knob("sglang_first_token_early", 1, "0/1", "1: an SGLang prefill server of the pdc "
         "backend streams a request's first token, when its router asked for it, as the "
         "request's last chunk goes to pdc, before pdc's transfer worker wakes (Note [SGLang "
         "first token from prefill]); 0: after SGLang has processed the batch's results"),
    Knob("sglang_first_token_direct", 1, "0/1", "1: an SGLang prefill server of the pdc "
         "backend sends a request's first token straight to the socket its router named, one "
         "datagram, instead of streaming it through SGLang's detokenizer and HTTP server "
         "(Note [First token straight to the router] in integrations/sglang/first_token.py); "
         "0: SGLang's way out"),
    Knob("sglang_cached_send", 0, "0/1", "1: an SGLang prefill server of the pdc backend "
         "sends the pages that are final before the forward (its radix-cache hit, earlier "
         "chunks) before the forward starts (\"lever B\"; same families)"),
    Knob("sglang_hold_chunks", "auto", "auto/0/1", "1: an SGLang prefill server of the pdc "
         "backend keeps a chunked request's earlier chunks and sends every page with its last "
         "chunk, so the transfer does not compute beside the request's later forwards (Note "
         "[SGLang held chunks]; ignored with sglang_layer_send or sglang_cached_send); 0: "
         "each chunk as its forward ends; auto: 1 where the KV cache is in host memory (the "
         "forward computes on the cores the transfer uses), 0 on a GPU"),
    # ~~~ integrity ~~~
    Knob("checksum", 0, "0/1", "1: prefill sends a 64-bit digest of the bytes it wrote on "
         "each link with Success, decode recomputes it over its destination items and fails "
         "the request on a mismatch (both sides must agree; costs one read of the bytes on "
         "each side)"),
)}

_overrides: dict[str, float | int | str] = {}


def choices(knob: Knob) -> tuple[str, ...]:
    """The values a knob takes when its unit lists them ("0/1", "copy/kernel/mapped")."""
    parts = knob.unit.split("/")
    return tuple(parts) if len(parts) > 1 and all(p.isalnum() for p in parts) else ()


_CHOICES = {name: choices(k) for name, k in KNOBS.items()}  # get() runs on request paths


def get(name: str):
    knob = KNOBS[name]
    if name in _overrides:
        value, source = _overrides[name], f"knobs.override({name}=...)"
    else:
        env = os.environ.get("PDC_" + name.upper())
        if env is None:
            return knob.default
        source = f"PDC_{name.upper()}"
        try:
            value = type(knob.default)(env)
        except ValueError:
            raise ValueError(f"{source}={env!r} is not a valid {knob.unit} value "
                             f"(default {knob.default})") from None
    allowed = _CHOICES[name]
    if allowed and str(value) not in allowed:
        raise ValueError(f"{source}={value!r} is not one of {', '.join(allowed)} "
                         f"(default {knob.default})")
    return value


def errors() -> list[str]:
    """Every knob set to a value it does not take, one message each. The endpoints refuse to
    start on any (Note [Knobs checked at start]).

    Note [Knobs checked at start]: knobs are read where they are needed, some only on a
    request's path or inside a guarded step (a graph capture whose failure falls back to
    plain launches), so a mistyped value could pass unnoticed or fail one request later. Both
    endpoints read every knob once as they are built and refuse with all the bad values."""
    found = []
    for name in KNOBS:
        try:
            get(name)
        except ValueError as exc:
            found.append(str(exc))
    return found


def override(**values) -> None:
    for name, value in values.items():
        if name not in KNOBS:
            raise KeyError(f"unknown knob '{name}'; known: {', '.join(sorted(KNOBS))}")
        _overrides[name] = value


def reset(*names: str) -> None:
    """Drop overrides (all of them when no name is given)."""
    for name in names or list(_overrides):
        _overrides.pop(name, None)


def table() -> str:
    rows = [f"| `{k.name}` | `PDC_{k.name.upper()}` | {k.default} {k.unit} | {k.doc} |"
            for k in KNOBS.values()]
    return "| knob | env | default | meaning |\n|---|---|---|---|\n" + "\n".join(rows)


def markdown() -> str:
    """docs/knobs.md."""
    return ("# Runtime knobs\n\n"
            "<!-- generated from runtime/knobs.py: python -m pdc.runtime.knobs > docs/knobs.md"
            " -->\n\n"
            "Every timeout and limit of the runtime. Set one for a process with the "
            "environment variable, or in code with `pdc.runtime.knobs.override(name=value)`.\n\n"
            + table() + "\n")


if __name__ == "__main__":
    print(markdown(), end="")
