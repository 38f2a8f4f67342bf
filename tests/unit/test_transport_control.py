"""ControlChannel in one process: channels share an in-memory store, so no torchrun is needed (fast)."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch.distributed as dist
import zmq
from structlog.testing import capture_logs

from vpsd.pipeline.messages import DraftChunk, KeepIndices, MessageError, Shutdown
from vpsd.transport.auth import MissingSecret, job_secret, rank_keypair
from vpsd.transport.control import ControlChannel, PeerTimeout, advertised_host

SECRET = b"test-secret"


@pytest.fixture
def world():
    store = dist.HashStore()
    chans = [ControlChannel(r, 3, role, store, secret=SECRET) for r, role in enumerate(["target", "draft", "pruner"])]
    yield chans
    for ch in chans:
        ch.close()


def test_send_recv_in_order(world):
    t, d, _ = world
    for i in range(5):
        d.send(0, KeepIndices("item", i))
    got = [t.recv(2.0) for _ in range(5)]
    assert got == [(1, KeepIndices("item", i)) for i in range(5)]


def test_recv_from_one_src_keeps_others_queued(world):
    t, d, p = world
    p.send(0, Shutdown("from pruner"))
    d.send(0, Shutdown("from draft"))
    assert t.poll(2.0, src=1)
    assert t.recv(2.0, src=1) == (1, Shutdown("from draft"))
    assert t.recv(2.0) == (2, Shutdown("from pruner"))  # another connection: its handshake may finish later


def test_recv_from_a_set_of_ranks_keeps_the_others_queued(world):
    """A role's "any peer" is its pipeline's ranks (roles/context.py): a coordinator's message waits for the
    launcher's own receive."""
    t, d, p = world
    p.send(0, Shutdown("from the coordinator"))
    assert t.poll(2.0, src=2)
    assert not t.poll(0.0, src=frozenset({0, 1}))
    d.send(0, Shutdown("from draft"))
    assert t.recv(2.0, src=frozenset({0, 1})) == (1, Shutdown("from draft"))
    with pytest.raises(PeerTimeout):
        t.recv(0.05, src=frozenset({1}))
    assert t.recv(0.0, src=2) == (2, Shutdown("from the coordinator"))


def test_self_send(world):
    t = world[0]
    t.send(0, Shutdown("me"))
    assert t.recv(2.0) == (0, Shutdown("me"))


def test_timeout_names_peer_and_role(world):
    t, d, _ = world
    with pytest.raises(PeerTimeout) as info:
        t.recv(0.05, src=2)
    assert (info.value.rank, info.value.role) == (2, "pruner")
    assert "rank 2 (pruner)" in str(info.value)
    with pytest.raises(PeerTimeout) as info:
        d.recv(0.0)
    assert info.value.rank is None and "any peer" in str(info.value)
    assert not d.poll(0.0)


def test_bad_message_from_a_rank_is_logged_and_dropped(world):
    t, d, _ = world
    with capture_logs() as logs:
        d._dealer(0).send(b"\x80\x04garbage")
        d.send(0, KeepIndices("after", 1))
        assert t.recv(2.0) == (1, KeepIndices("after", 1))
    bad = [e for e in logs if e["event"] == "bad_message"]
    assert len(bad) == 1 and bad[0]["sender"] == 1 and "msgpack" in bad[0]["error"]


def _attacker(address: str, identity: bytes, *, keys: tuple[bytes, bytes] | None, server_key: bytes | None):
    """A DEALER from outside the job: plain (no CURVE), or CURVE with keys of its own."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return ctx, sock


def test_no_stranger_delivers_a_message_or_breaks_a_link(world):
    """The issue's attacks: a forged Shutdown under the draft's identity, and random bytes under it, from
    peers without the job's secret: plain, with a random CURVE key, with rank 1's key under another secret,
    even with the target's public key (were it leaked). None is heard, and the real draft's link keeps working."""
    t, d, _ = world
    d.send(0, KeepIndices("before", 0))  # the real draft's link is up before the attacks
    assert t.recv(10.0) == (1, KeepIndices("before", 0))
    server_key = rank_keypair(SECRET, 0)[0]
    attackers = [
        _attacker(t.address, b"1", keys=None, server_key=None),
        _attacker(t.address, b"1", keys=zmq.curve_keypair(), server_key=server_key),
        _attacker(t.address, b"1", keys=rank_keypair(b"another job", 1), server_key=server_key),
        _attacker(t.address, b"0", keys=zmq.curve_keypair(), server_key=rank_keypair(b"guess", 0)[0]),
    ]
    forged = msgpack.packb({"type": "Shutdown", "v": 1, "reason": "forged"})
    with capture_logs() as logs:
        for _, sock in attackers:
            for payload in (forged, bytes(range(256)) * 16):
                try:
                    sock.send(payload, zmq.NOBLOCK)  # queued until the handshake, which fails
                except zmq.Again:
                    pass  # or refused outright: the handshake already failed and the link is gone
        assert not t.poll(0.5)  # nothing from any of them, not even a bad_message
        for i in range(3):
            d.send(0, KeepIndices("after", i))
        assert [t.recv(10.0) for _ in range(3)] == [(1, KeepIndices("after", i)) for i in range(3)]
    assert not [e for e in logs if e["event"] == "bad_message"]
    for ctx, sock in attackers:
        sock.close(linger=0)
        ctx.term()


def test_the_rank_is_the_authenticated_one_not_the_claimed_one(world):
    """A rank's own key under another rank's identity is refused as a bad message, attributed to the key."""
    t = world[0]
    ctx, sock = _attacker(t.address, b"1", keys=rank_keypair(SECRET, 2), server_key=rank_keypair(SECRET, 0)[0])
    with capture_logs() as logs:
        sock.send(msgpack.packb({"type": "Shutdown", "v": 1, "reason": "claims to be rank 1"}))
        deadline = time.monotonic() + 2.0
        while not logs and time.monotonic() < deadline:
            t.poll(0.02)
    sock.close(linger=0)
    ctx.term()
    assert logs and logs[0]["event"] == "bad_message" and logs[0]["sender"] == 2
    assert "not the authenticated rank 2" in logs[0]["error"]
    assert not t.poll(0.0)


def test_the_secret_comes_from_the_environment():
    with pytest.raises(MissingSecret, match="VPSD_JOB_SECRET is not set.*torchrun.sh"):
        job_secret({})
    assert job_secret({"VPSD_JOB_SECRET": "abc"}) == b"abc"
    assert rank_keypair(b"abc", 1) == rank_keypair(b"abc", 1) != rank_keypair(b"abc", 2)
    assert rank_keypair(b"abc", 1) != rank_keypair(b"abd", 1)


def test_heartbeats_are_consumed_and_refresh_liveness(world):
    t, d, p = world
    d.heartbeat([0])
    deadline = time.monotonic() + 2.0
    while t.last_seen(1) is None and time.monotonic() < deadline:
        t.poll(0.01)
    assert t.last_seen(1) is not None
    assert not t.poll(0.0)  # the heartbeat itself is not delivered
    t.check_alive([1], timeout_s=5.0)
    time.sleep(0.02)
    with pytest.raises(PeerTimeout) as info:
        t.check_alive([1, 2], timeout_s=0.01)
    assert info.value.rank in (1, 2) and info.value.role in ("draft", "pruner")


def test_a_peer_never_heard_from_has_the_start_up_bound_and_then_the_timeout(world):
    t, d, _ = world
    time.sleep(0.05)
    t.check_alive([1, 2], timeout_s=0.01, unheard_s=5.0)  # not heard from yet: still starting
    with pytest.raises(PeerTimeout) as info:
        t.check_alive([1], timeout_s=5.0, unheard_s=0.01)
    assert info.value.rank == 1
    d.heartbeat([0])
    deadline = time.monotonic() + 2.0
    while t.last_seen(1) is None and time.monotonic() < deadline:
        t.poll(0.01)
    time.sleep(0.05)
    with pytest.raises(PeerTimeout):  # heard from once: --timeout rules from now on
        t.check_alive([1], timeout_s=0.01, unheard_s=5.0)


def test_unpublished_peer_times_out_by_name():
    store = dist.HashStore()
    with ControlChannel(0, 2, "target", store, secret=SECRET, connect_timeout_s=0.1) as ch:
        with pytest.raises(PeerTimeout) as info:
            ch.send(1, Shutdown("nobody there"))
        assert info.value.rank == 1
        with pytest.raises(ValueError):
            ch.send(5, Shutdown("outside the world"))


def test_invalid_message_fails_on_the_sender(world):
    with pytest.raises(MessageError):
        world[0].send(1, DraftChunk("i", 0, 0, ["not an int"], False))  # type: ignore[list-item]


def test_endpoint_published_in_store(world):
    t = world[0]
    peer = msgpack.unpackb(t._store.get("vpsd/ctrl/2"), raw=False)
    assert peer["role"] == "pruner" and peer["address"] == world[2].address
    assert t.peer_role(2) == "pruner"


def test_advertised_host(monkeypatch):
    monkeypatch.delenv("VPSD_HOST", raising=False)
    assert advertised_host() == "127.0.0.1"
    monkeypatch.setenv("VPSD_HOST", "node7")
    assert advertised_host() == "node7"
    assert advertised_host("10.0.0.2") == "10.0.0.2"



def test_heartbeats_from_a_thread_keep_a_busy_peer_alive(world):
    """start_heartbeat: the draft's thread speaks for it (own link, identity '1/hb', same authenticated rank)."""
    t, d, _ = world
    d.start_heartbeat([0], interval_s=0.05)
    deadline = time.monotonic() + 10.0
    while t.last_seen(1) is None and time.monotonic() < deadline:
        t.poll(0.05)
    first = t.last_seen(1)
    assert first is not None and not t.poll(0.0)
    while t.last_seen(1) == first and time.monotonic() < deadline:
        t.poll(0.05)
    assert t.last_seen(1) > first  # still coming, with no send from the draft's own thread
    d.send(0, KeepIndices("main link", 0))  # the main link is untouched by the heartbeat link
    assert t.recv(10.0) == (1, KeepIndices("main link", 0))
