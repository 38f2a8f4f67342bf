"""Who may speak on the control plane: ZeroMQ CURVE keys derived from one per-job secret.

Contract:
- Every job has a secret, `VPSD_JOB_SECRET` in every rank's environment (./torchrun.sh makes a fresh one
  for a single-node run; a multi-node job must export the same one on every node). `job_secret()` reads
  it and raises `MissingSecret`, saying how to set it, when it is absent.
- Rank r's CURVE keypair is derived from the secret and r alone (`rank_keypair`), so every rank knows every
  other rank's public key without exchanging anything, and nobody without the secret knows any of them.
- Each ROUTER is a CURVE server checked by a ZAP handler (`RankAuthenticator`) that admits exactly the
  world's rank keys and names the peer by the rank its key belongs to: the message's `User-Id` property is
  that rank. A peer without a rank key never completes the handshake, so it can neither deliver a message
  nor take over a rank's routing identity (ROUTER_HANDOVER acts only on peers that finished the handshake).
- What this does not cover: torch.distributed's store and gloo/NCCL (see the README, "Security").
"""

from __future__ import annotations

import hashlib
import os
from typing import Mapping

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

SECRET_ENV = "VPSD_JOB_SECRET"
ZAP_DOMAIN = "vpsd"
_PERSON = b"vpsd-curve-v1"  # domain separation: these bytes are keys for this use only


class MissingSecret(RuntimeError):
    """The job has no secret to derive its control-plane keys from."""


def job_secret(env: Mapping[str, str] = os.environ) -> bytes:
    """The job's secret from `VPSD_JOB_SECRET`; MissingSecret (with the fix) when unset or empty."""
    secret = env.get(SECRET_ENV, "")
    if not secret:
        raise MissingSecret(
            f"{SECRET_ENV} is not set: the control plane authenticates ranks with keys derived from it. "
            f"./torchrun.sh sets a fresh one for a single-node run; launching torchrun yourself, or on several "
            f"nodes, export the same value on every node, e.g. "
            f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return secret.encode()


def rank_keypair(secret: bytes, rank: int) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys of `rank`, z85-encoded: a keyed hash of the rank, then Curve25519."""
    key = hashlib.blake2b(secret, digest_size=64, person=_PERSON).digest()  # any secret length -> 64 bytes
    raw = hashlib.blake2b(str(rank).encode(), key=key, digest_size=32, person=_PERSON).digest()
    secret_z85 = z85.encode(raw)
    return zmq.curve_public(secret_z85), secret_z85


class RankAuthenticator(ThreadAuthenticator):
    """ZAP handler for one channel's context: admits the world's rank keys, User-Id = the rank."""

    def __init__(self, context: zmq.Context, secret: bytes, world_size: int) -> None:
        super().__init__(context)
        self._ranks = {rank_keypair(secret, r)[0]: r for r in range(world_size)}
        self.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
        self.start()

    def callback(self, domain: str, key: bytes) -> bool:  # the credentials provider's hook (z85 key)
        return key in self._ranks

    def curve_user_id(self, client_public_key: bytes) -> str:
        return str(self._ranks[z85.encode(client_public_key)])
