"""The receiving ("decode") side of the engine tests, run in a spawned process.

Kept apart from the test module so the spawned interpreter imports only numpy and the engine,
not pytest. Everything here is deterministic so the receiver can rebuild the expected bytes
itself from a seed and the descriptor offsets.
"""

from __future__ import annotations

import numpy as np

SLOT_NBYTES = 4096


def background(nbytes: int) -> np.ndarray:
    """What the receiver's buffer holds before any write; differs from every source pattern."""
    return ((np.arange(nbytes, dtype=np.uint64) * 7 + 3) % 251).astype(np.uint8)


def source_pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def make_plan(counts: list[int], seed: int) -> dict[str, object]:
    """Scattered descriptors for several batches, as byte offsets into source and destination.

    Each descriptor gets its own 4 KiB slot on both sides, with a random length (1 byte to a
    full slot, so odd sizes are covered) at a random offset inside the slot. The destination
    has twice as many slots as descriptors, so untouched slots lie between written ones.
    """
    rng = np.random.default_rng(seed)
    total = sum(counts)
    nbytes = rng.integers(1, SLOT_NBYTES + 1, total).astype(np.uint64)
    nbytes[:4] = [1, 3, SLOT_NBYTES, SLOT_NBYTES - 1]
    inner_src = (rng.integers(0, SLOT_NBYTES, total).astype(np.uint64)) % (SLOT_NBYTES - nbytes + 1)
    inner_dst = (rng.integers(0, SLOT_NBYTES, total).astype(np.uint64)) % (SLOT_NBYTES - nbytes + 1)
    src_slots = rng.permutation(total).astype(np.uint64)
    dst_slots = rng.choice(2 * total, total, replace=False).astype(np.uint64)
    src_off = src_slots * SLOT_NBYTES + inner_src
    dst_off = dst_slots * SLOT_NBYTES + inner_dst
    bounds = np.cumsum([0, *counts])
    return {
        "seed": seed,
        "src_nbytes": total * SLOT_NBYTES,
        "dst_nbytes": 2 * total * SLOT_NBYTES,
        "batches": [
            (src_off[a:b], dst_off[a:b], nbytes[a:b])
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ],
    }


def expected_destination(plan: dict[str, object], batches_written: list[int]) -> np.ndarray:
    expected = background(plan["dst_nbytes"])
    src = source_pattern(plan["src_nbytes"], plan["seed"])
    for index in batches_written:
        src_off, dst_off, nbytes = plan["batches"][index]
        for s, d, n in zip(src_off.tolist(), dst_off.tolist(), nbytes.tolist(), strict=True):
            expected[d : d + n] = src[s : s + n]
    return expected


def peer_main(engine_name: str, conn, dst_nbytes: int) -> None:
    """Registers a buffer, sends (agent_info, base address), then answers requests."""
    from pdc.runtime.engines import make_engine

    engine = make_engine(engine_name)
    buf = background(dst_nbytes)
    engine.register(buf.ctypes.data, buf.nbytes)
    conn.send((engine.agent_info(), buf.ctypes.data))
    while True:
        request = conn.recv()
        if request[0] == "verify":
            _, plan, batches_written = request
            wrong = np.flatnonzero(buf != expected_destination(plan, batches_written))
            conn.send(("verified", int(wrong.size), wrong[:8].tolist()))
        elif request[0] == "stop":
            break
    engine.close()
    conn.send(("closed",))


def unprivileged_writer_main(conn, agent_info: bytes, dst_addr: int) -> None:
    """Drops to uid/gid 65534 (nobody), then tries one local-engine write into a root process."""
    import os

    from pdc.runtime.engines import TransferError, engine_class

    local_engine = engine_class("local")  # import while still allowed to read the tree
    os.setgid(65534)
    os.setuid(65534)
    engine = local_engine()
    src = np.ones(64, np.uint8)
    engine.register(src.ctypes.data, src.nbytes)
    peer = engine.connect(agent_info)
    try:
        batch = engine.submit_write(peer, [src.ctypes.data], [dst_addr], [64])
        conn.send(("no error", batch.state.name, batch.reason))
    except TransferError as exc:
        conn.send(("error", type(exc).__name__, str(exc)))
    engine.close()
