"""ZeroMQ control channel between ranks: small typed messages, never tensors, never pickle.

Contract:
- One `ControlChannel` per rank. It binds a ROUTER on a random port and publishes
  `{"address", "role"}` (msgpack) under `<namespace>/<rank>` in the torch.distributed store, so peers on
  other nodes find it. The advertised host is `host`, else env `VPSD_HOST`, else 127.0.0.1 (standalone).
- Authenticated (vpsd/transport/auth.py): every ROUTER is a CURVE server that admits only the world's rank
  keys, derived from the job's secret. The sender of a message is the rank its key belongs to (the
  `User-Id` ZeroMQ reports), never what the peer says it is; a peer without a rank key never completes the
  handshake, so it can neither deliver a message nor take over a rank's link.
- `send(dst, msg)` goes through one DEALER per peer (its routing identity is the sender's rank, which must
  match the authenticated one). Sends are queued by ZeroMQ; a send that cannot be queued within `send_timeout_s`
  raises `PeerTimeout` naming the peer.
- `recv(timeout_s, src=None)` returns `(src_rank, message)` in arrival order, optionally only from one
  rank or a set of ranks (messages from others stay queued for later calls), and raises `PeerTimeout` naming
  the rank and role waited on. A malformed, unknown or oversized message is logged (structlog event `bad_message`,
  with the sender) and dropped: it never reaches the caller and is never acted on.
- `Heartbeat` messages are consumed by the channel: they refresh `last_seen` and say what the peer's role is
  doing (`doing`: vpsd/activity.py); `check_alive` turns a silent peer into a `PeerTimeout`. Every valid
  message counts as a sign of life. `start_heartbeat(dsts,
  interval_s)` sends them from a thread of its own (own sockets, routing identity `<rank>/hb`), so a rank busy in
  a long forward still shows it is alive, and one that is stopped or dead falls silent.
- The store record also holds the rank's pid and host (`peer_record`), to name and end a silent peer.
- Not thread-safe (ZeroMQ sockets are not): use a channel from the thread that created it.

Why timeouts everywhere: a rank blocked on a ZeroMQ recv while its peer waits in a torch.distributed
collective deadlocks silently; a bounded wait turns that into an error that names the peer.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Iterable

import msgspec
import structlog
import torch.distributed as dist
import zmq

from vpsd.activity import ACTIVITY
from vpsd.pipeline.messages import Heartbeat, Message, MessageError, decode, encode
from vpsd.transport.auth import ZAP_DOMAIN, RankAuthenticator, job_secret, rank_keypair
from vpsd.transport.startup import rendezvous_store

log = structlog.get_logger(__name__)

DEFAULT_NAMESPACE = "vpsd/ctrl"
# Control messages are token ids and small headers; anything this large is a bug or an attack, and
# ZeroMQ drops the connection before buffering it.
MAX_MESSAGE_BYTES = 16 * 2**20
_POLLIN = int(zmq.POLLIN)  # a plain int: enum arithmetic showed up in the receive profile


Source = int | frozenset[int] | None  # whom a receive takes from: one rank, a set of ranks, or anyone


def _from(sender: int, src: Source) -> bool:
    return src is None or (sender == src if isinstance(src, int) else sender in src)


class PeerTimeout(TimeoutError):
    """Waited `waited_s` seconds on rank `rank` (role `role`) in vain; rank None means any peer."""

    def __init__(self, rank: int | None, role: str | None, waited_s: float, what: str = "a message from") -> None:
        self.rank = rank
        self.role = role
        self.waited_s = waited_s
        peer = "any peer" if rank is None else f"rank {rank} ({role or 'unknown role'})"
        super().__init__(f"waited {waited_s:.3f} s for {what} {peer}")


def advertised_host(host: str | None = None) -> str:
    """The address peers use to reach this rank: `host`, else env VPSD_HOST, else 127.0.0.1."""
    return host or os.environ.get("VPSD_HOST") or "127.0.0.1"


POLL_MAX_MS = 2**31 - 1  # zmq_poll's timeout is a C int (~24.8 days)


class ControlChannel:
    """This rank's end of the control plane: one ROUTER to receive, one DEALER per peer to send."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        role: str,
        store: dist.Store,
        *,
        secret: bytes,
        host: str | None = None,
        bind_host: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        send_timeout_s: float = 10.0,
        connect_timeout_s: float = 60.0,
    ) -> None:
        """`secret`: the job's secret (auth.job_secret()). `bind_host` defaults to the advertised host's IPv4
        address; pass "*" to listen on every interface."""
        self.rank, self.world_size, self.role = rank, world_size, role
        self._store, self._namespace = store, namespace
        self._send_timeout_s, self._connect_timeout_s = send_timeout_s, connect_timeout_s
        self._secret = secret
        self._public, self._secret_key = rank_keypair(secret, rank)
        self._ctx = zmq.Context()
        # The ZAP handler must run before the ROUTER binds: a CURVE server without one admits any client key.
        self._auth = RankAuthenticator(self._ctx, secret, world_size)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.curve_server = True
        self._router.curve_secretkey = self._secret_key
        self._router.curve_publickey = self._public
        self._router.zap_domain = ZAP_DOMAIN.encode()
        # A peer that reconnects (restarted socket) takes its identity over instead of being ignored. Only
        # peers that passed the CURVE handshake have an identity at all, so no stranger can take one over.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._router.setsockopt(zmq.LINGER, 0)
        host = advertised_host(host)
        # ZeroMQ binds interfaces or IPs, not DNS names; peers connect by name, which ZeroMQ resolves.
        bind_ip = bind_host or socket.gethostbyname(host)
        port = self._router.bind_to_random_port(f"tcp://{bind_ip}")
        self.address = f"tcp://{host}:{port}"
        self._dealers: dict[int, zmq.Socket] = {}
        self._roles: dict[int, str] = {rank: role}
        self._inbox: deque[tuple[int, Message]] = deque()
        self._last_seen: dict[int, float] = {}
        self._beats: dict[int, tuple[float, Heartbeat]] = {}  # rank -> (when it came, the last heartbeat)
        self._started = time.monotonic()
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        store.set(self._key(rank), msgspec.msgpack.encode({"address": self.address, "role": role, "pid": os.getpid(),
                                                           "host": socket.gethostname()}))
        log.debug("control_bound", rank=rank, role=role, address=self.address)

    @classmethod
    def from_process_group(cls, role: str, **kwargs) -> "ControlChannel":
        """A channel for this rank of the default process group, published in its rendezvous store; the secret
        defaults to the job's (VPSD_JOB_SECRET, MissingSecret if unset). The control plane holds one identity
        more than torch.distributed: rank `world_size`, the job's coordinator (launch/coordinator.py), a
        thread with a channel of its own."""
        store = kwargs.pop("store", None) or rendezvous_store()
        secret = kwargs.pop("secret", None) or job_secret()
        return cls(dist.get_rank(), dist.get_world_size() + 1, role, store, secret=secret, **kwargs)

    # --- sending ----------------------------------------------------------------------------------------

    def send(self, dst: int, msg: Message) -> None:
        """Queue `msg` for rank `dst` (validated and encoded first; MessageError on a bad message)."""
        data = encode(msg)
        try:
            self._dealer(dst).send(data)
        except zmq.Again:
            raise PeerTimeout(dst, self._roles.get(dst), self._send_timeout_s, "room in the send queue to") from None

    def heartbeat(self, dsts: Iterable[int]) -> None:
        """Tell each rank in `dsts` that this rank is alive, and what its role is doing."""
        hb = self._heartbeat()
        for dst in dsts:
            self.send(dst, hb)

    def _heartbeat(self) -> Heartbeat:
        now = ACTIVITY.report()
        return Heartbeat(self.role, self.rank, time.time(), now.phase, now.item, now.busy_s, now.typical_s)

    def start_heartbeat(self, dsts: Iterable[int], interval_s: float) -> None:
        """Send each rank in `dsts` a Heartbeat every `interval_s` from a background thread, until close()."""
        peers = {dst: self._lookup(dst, self._connect_timeout_s)["address"] for dst in dsts}
        self._beat_thread = threading.Thread(target=self._beat, args=(peers, interval_s), name="vpsd-heartbeat",
                                             daemon=True)
        self._beat_thread.start()

    def _beat(self, peers: dict[int, str], interval_s: float) -> None:
        socks = {dst: self._connect(dst, address, f"{self.rank}/hb") for dst, address in peers.items()}
        try:
            while not self._beat_stop.is_set():
                data = encode(self._heartbeat())
                for sock in socks.values():
                    try:
                        sock.send(data, zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # that peer is not reading: it is the one to be reported, not us
                self._beat_stop.wait(interval_s)
        finally:
            for sock in socks.values():
                sock.close(linger=0)

    def _dealer(self, dst: int) -> zmq.Socket:
        sock = self._dealers.get(dst)
        if sock is not None:
            return sock
        if not 0 <= dst < self.world_size:
            raise ValueError(f"rank {dst} is outside world of size {self.world_size}")
        peer = self._lookup(dst, self._connect_timeout_s)
        sock = self._connect(dst, peer["address"], str(self.rank))
        sock.setsockopt(zmq.SNDTIMEO, int(self._send_timeout_s * 1000))
        # On close, give queued messages a moment to leave; a dead peer must not hang shutdown.
        sock.setsockopt(zmq.LINGER, 1000)
        self._dealers[dst] = sock
        return sock

    def _connect(self, dst: int, address: str, identity: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.curve_secretkey = self._secret_key
        sock.curve_publickey = self._public
        sock.curve_serverkey = rank_keypair(self._secret, dst)[0]  # only the real rank dst can answer the handshake
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.connect(address)
        return sock

    def _lookup(self, rank: int, timeout_s: float) -> dict:
        key = self._key(rank)
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as e:  # the store's timeout error carries no peer name
            raise PeerTimeout(rank, None, timeout_s, "the control endpoint of") from e
        peer = msgspec.msgpack.decode(self._store.get(key))
        self._roles[rank] = peer["role"]
        return peer

    def peer_record(self, rank: int) -> dict:
        """What `rank` published: address, role, pid, host (waits for it up to the connect timeout)."""
        return self._lookup(rank, self._connect_timeout_s)

    def peer_role(self, rank: int) -> str | None:
        """Role of `rank` if it has published its endpoint, without waiting."""
        if rank not in self._roles and self._store.check([self._key(rank)]):
            self._lookup(rank, 0.0)
        return self._roles.get(rank)

    # --- receiving --------------------------------------------------------------------------------------

    def recv(self, timeout_s: float | None = None, src: Source = None) -> tuple[int, Message]:
        """Next valid message (from `src` only, if given); PeerTimeout after `timeout_s` (None: wait forever)."""
        if not self._wait(timeout_s, src):
            one = src if isinstance(src, int) else None
            raise PeerTimeout(one, None if one is None else self.peer_role(one), timeout_s or 0.0)
        return self._take(src)  # type: ignore[return-value]

    def poll(self, timeout_s: float | None = 0.0, src: Source = None) -> bool:
        """Whether a valid message (from `src`, if given) is ready within `timeout_s`; consumes nothing."""
        return self._wait(timeout_s, src)

    def _wait(self, timeout_s: float | None, src: Source) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._drain()  # even a zero timeout sees what has already arrived
            if self._has(src):
                return True
            timeout_ms = None
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                timeout_ms = min(math.ceil(remaining * 1000), POLL_MAX_MS)  # a longer wait polls again
            # Readiness may be a bad message that _drain drops, or another rank's: loop, do not return.
            self._router.poll(timeout_ms, zmq.POLLIN)

    def _has(self, src: Source) -> bool:
        return any(_from(s, src) for s, _ in self._inbox)

    def _take(self, src: Source) -> tuple[int, Message] | None:
        for i, (s, msg) in enumerate(self._inbox):
            if _from(s, src):
                del self._inbox[i]
                return s, msg
        return None

    def _drain(self) -> None:
        """Move every message ZeroMQ holds into the inbox, dropping the bad ones."""
        # Checking EVENTS costs half of a failed NOBLOCK recv (which raises): this is the hot path.
        while self._router.getsockopt(zmq.EVENTS) & _POLLIN:
            self._accept(self._router.recv_multipart(copy=False))

    def _accept(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        # The rank is the one the peer's CURVE key proved (ZAP's User-Id), not the identity it chose.
        src = int(_user_id(frames[-1]))
        try:
            if ident not in (str(src).encode(), f"{src}/hb".encode()):
                raise MessageError(f"routing identity {ident!r} is not the authenticated rank {src}")
            if len(frames) != 2:
                raise MessageError(f"expected one payload frame, got {len(frames) - 1}")
            msg = decode(frames[1].bytes)
        except MessageError as e:
            log.warning(
                "bad_message",
                sender=src,
                peer_address=_peer_address(frames[-1]),
                rank=self.rank,
                role=self.role,
                nbytes=sum(len(f.bytes) for f in frames[1:]),
                error=str(e),
            )
            return
        self._last_seen[src] = time.monotonic()
        if isinstance(msg, Heartbeat):
            self._beats[src] = (time.monotonic(), msg)
            return
        self._inbox.append((src, msg))

    # --- liveness ---------------------------------------------------------------------------------------

    def doing(self, rank: int) -> tuple[Heartbeat, float] | None:
        """`rank`'s last heartbeat and how long ago it came (what its role was doing then), if any came."""
        self._drain()
        got = self._beats.get(rank)
        return None if got is None else (got[1], time.monotonic() - got[0])

    def last_seen(self, rank: int) -> float | None:
        """time.monotonic() of the last valid message from `rank`, None if none yet."""
        return self._last_seen.get(rank)

    def check_alive(self, ranks: Iterable[int], timeout_s: float, unheard_s: float | None = None) -> None:
        """Raise PeerTimeout for the first rank silent for more than `timeout_s`; a rank never heard from is
        allowed `unheard_s` (default `timeout_s`) from channel start: the start-up bound, while it may still be
        coming up. Drains pending messages first so queued heartbeats count."""
        self._drain()
        now = time.monotonic()
        for rank in ranks:
            seen = self._last_seen.get(rank)
            silent = now - (self._started if seen is None else seen)
            if silent > (timeout_s if seen is not None or unheard_s is None else unheard_s):
                raise PeerTimeout(rank, self.peer_role(rank), silent, "a sign of life from")

    # --- teardown ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the sockets (queued sends get up to 1 s to leave) and the ZeroMQ context."""
        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join()
        for sock in self._dealers.values():
            sock.close()
        self._router.close()
        self._auth.stop()
        self._ctx.term()

    def __enter__(self) -> "ControlChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _key(self, rank: int) -> str:
        return f"{self._namespace}/{rank}"


def _user_id(frame: zmq.Frame) -> str:
    """The rank ZAP authenticated the frame's sender as (RankAuthenticator.curve_user_id)."""
    return frame.get("User-Id")


def _peer_address(frame: zmq.Frame) -> str | None:
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:  # not every transport reports one
        return None
