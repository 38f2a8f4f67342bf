"""Worker for tests/torchrun/test_transport_torchrun.py, run by torchrun with 3 ranks (target, draft, pruner).

Usage: torchrun --standalone --nproc-per-node 3 transport_worker.py OUT_DIR
Each rank writes OUT_DIR/rank<r>.json with what it observed; the test asserts on those files.
A failure is recorded as {"error": traceback} so the test shows it instead of a bare exit code.
"""

from __future__ import annotations

import json
import pickle
import statistics
import sys
import time
import traceback
from pathlib import Path

import msgpack
import structlog
import torch
import torch.distributed as dist
import zmq
from structlog.testing import capture_logs

from vpsd.pipeline.messages import DraftChunk, KeepIndices, Shutdown, TensorAnnounce, VerifyResult
from vpsd.transport.control import ControlChannel, PeerTimeout
from vpsd.transport.tensors import TensorChannel, init_distributed

ROLES = ["target", "draft", "pruner"]
TIMEOUT_S = 15.0


def expected_tensors(src: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + src)
    return [
        torch.randn(3, 5, generator=g),  # float32
        torch.randint(0, 152_000, (7,), generator=g),  # int64: token ids beyond bf16's exact range
        (torch.randn(4, 2, generator=g) * 300).to(torch.bfloat16),
        torch.empty(0, 4),  # announced but nothing goes on the wire
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # non-contiguous
    ]


def ring(ch: ControlChannel, rank: int, world: int, round_: int) -> dict:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    ch.send(nxt, DraftChunk(f"ring-{round_}", round_, rank, [rank, nxt, 10**12], rank % 2 == 0))
    src, msg = ch.recv(TIMEOUT_S, src=prv)
    ok = src == prv and msg == DraftChunk(f"ring-{round_}", round_, prv, [prv, rank, 10**12], prv % 2 == 0)
    return {"src": src, "ok": ok, "type": type(msg).__name__}


def main(out_dir: Path) -> dict:
    rank, world, backend = init_distributed(startup_timeout_s=60)
    role = ROLES[rank]
    res: dict = {"rank": rank, "role": role, "backend": backend, "world": world}
    ch = ControlChannel.from_process_group(role)
    tc = TensorChannel(ch)
    res["address"] = ch.address

    # 1. control ring, after a heartbeat from everyone to everyone
    ch.heartbeat(r for r in range(world) if r != rank)
    res["ring1"] = ring(ch, rank, world, 1)
    res["heard_from"] = sorted(r for r in range(world) if ch.last_seen(r) is not None)
    res["peer_roles"] = [ch.peer_role(r) for r in range(world)]

    # 2. announced tensors in a ring: isend first, overlap, then receive from the previous rank
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    handle = tc.send(nxt, expected_tensors(rank), tag="ring", epoch=7)
    src, ann = ch.recv(TIMEOUT_S, src=prv)
    assert isinstance(ann, TensorAnnounce), ann
    got = tc.recv_announced(ann)
    handle.wait(TIMEOUT_S)
    want = expected_tensors(prv)
    res["tensors"] = {
        "announce": {"tag": ann.tag, "src": ann.src, "epoch": ann.epoch, "dtypes": ann.dtypes,
                     "shapes": ann.shapes, "devices": ann.devices},
        "dtypes": [str(t.dtype) for t in got],
        "equal": [bool(torch.equal(a, b)) and a.dtype == b.dtype for a, b in zip(got, want)],
    }

    # 3. malformed messages to rank 0 are dropped and logged; the channel keeps working.
    #    Strangers on raw sockets (no identity, a rank's identity) never pass the CURVE handshake: not even
    #    logged. Raw bytes from rank 2's own socket (a buggy peer) are attributed to sender 2.
    from_strangers = [b"\xc1not msgpack", pickle.dumps(Shutdown("pwned")),
                      msgpack.packb({"type": "Shutdown/1", "reason": "not a rank"})]
    from_rank2 = [b"\xc1not msgpack", pickle.dumps(Shutdown("pwned")), msgpack.packb({"type": "Nope/1"}),
                  msgpack.packb({"type": "Shutdown/1", "reason": "x", "exec": "rm -rf /"}), [b"a", b"b"]]
    if rank == 2:
        peer = msgpack.unpackb(ch._store.get("vpsd/ctrl/0"), raw=False)
        ctx = zmq.Context()
        for identity in (None, b"1"):
            raw = ctx.socket(zmq.DEALER)
            if identity:
                raw.setsockopt(zmq.IDENTITY, identity)
            raw.connect(peer["address"])
            for payload in from_strangers:
                raw.send(payload)
            raw.close(linger=2000)
        ctx.term()
        own = ch._dealer(0)
        for payload in from_rank2:
            own.send_multipart(payload) if isinstance(payload, list) else own.send(payload)
        ch.send(0, VerifyResult("after-garbage", 0, 0, 0, 0, 0, "full", False))
    if rank == 0:
        expected = len(from_rank2)
        with capture_logs() as logs:
            src, msg = ch.recv(TIMEOUT_S, src=2)  # same socket as the rank-2 garbage: arrives after it
            deadline = time.monotonic() + TIMEOUT_S
            while sum(e["event"] == "bad_message" for e in logs) < expected and time.monotonic() < deadline:
                ch.poll(0.05, src=-1)  # src -1 never matches: just pump the socket
        res["after_garbage"] = {"src": src, "type": type(msg).__name__, "item_id": getattr(msg, "item_id", None)}
        res["bad_expected"] = expected
        res["bad_messages"] = [
            {k: e.get(k) for k in ("event", "log_level", "sender", "error", "peer_address", "nbytes")}
            for e in logs if e["event"] == "bad_message"
        ]

    # 4. timeouts name the peer: the draft waits on the pruner, which never writes to it
    if rank == 1:
        t0 = time.monotonic()
        try:
            ch.recv(0.3, src=2)
            res["timeout"] = {"raised": False}
        except PeerTimeout as e:
            res["timeout"] = {"raised": True, "rank": e.rank, "role": e.role, "waited_s": e.waited_s,
                              "text": str(e), "elapsed": time.monotonic() - t0}
        try:
            ch.check_alive([2], timeout_s=0.0)
            res["liveness"] = {"raised": False}
        except PeerTimeout as e:
            res["liveness"] = {"raised": True, "rank": e.rank, "role": e.role, "text": str(e)}
        ch.check_alive([0], timeout_s=60.0)  # heard from rank 0 recently: no raise

    # 5. channel still works for everyone after all that
    res["ring2"] = ring(ch, rank, world, 2)

    # 6. round-trip latency target <-> draft (small control messages)
    if rank in (0, 1):
        peer = 1 - rank
        rtts = []
        for i in range(300):
            if rank == 0:
                t0 = time.perf_counter()
                ch.send(peer, KeepIndices("ping", i))
                ch.recv(TIMEOUT_S, src=peer)
                rtts.append(time.perf_counter() - t0)
            else:
                _, msg = ch.recv(TIMEOUT_S, src=peer)
                ch.send(peer, msg)
        if rtts:
            rtts = sorted(rtts[20:])
            res["rtt_us"] = {"median": statistics.median(rtts) * 1e6, "p90": rtts[int(0.9 * len(rtts))] * 1e6}

    # Every rank is done with ZeroMQ receives before the collective (see NOTES: mixing them deadlocks).
    dist.barrier()
    ch.close()
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    out = Path(sys.argv[1])
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        result = main(out)
    except BaseException:
        import os

        result = {"rank": int(os.environ.get("RANK", -1)), "error": traceback.format_exc()}
        (out / f"rank{result['rank']}.json").write_text(json.dumps(result))
        raise
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))
