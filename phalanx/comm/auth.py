"""Authentication of phalanx's sockets: one secret per Ray session, HMAC challenge-response.

Every phalanx endpoint listens on a TCP port (see ``endpoint.py``). Before a connection
carries anything that is unpickled, both ends prove they hold the cluster's secret:

1. client -> server: ``PXA1`` + a 16-byte random client nonce
2. server -> client: ``PXA1`` + a 16-byte random server nonce
   + ``HMAC-SHA256(secret, "px-server" + client nonce + server nonce)``
3. client -> server: ``HMAC-SHA256(secret, "px-client" + server nonce + client nonce)``

Each side checks the other's MAC with ``hmac.compare_digest``; a mismatch, a wrong magic,
or a peer that stalls longer than ``HANDSHAKE_TIMEOUT_S`` closes the connection. The
server never reads past step 3 of a client that failed it, so a stranger who can reach
the port cannot get a single byte unpickled. The server also proves itself to the client,
so a process squatting on a stale address cannot collect messages.

The secret is 32 random bytes kept in Ray's internal KV store (namespace ``phalanx_comm``,
key ``auth/secret``). The first phalanx process of a Ray session that needs it creates it;
everyone else reads the same value. Only processes that can talk to Ray's GCS can read it,
so it is exactly as protected as the Ray cluster itself (Ray's token authentication, when
enabled, guards the KV store). It lives and dies with the Ray session. It authenticates
connections; it does not encrypt them (nor does Ray's token authentication).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct

from phalanx.comm.errors import AuthenticationError, CommError

KV_NAMESPACE = "phalanx_comm"
SECRET_KEY = b"auth/secret"
HANDSHAKE_TIMEOUT_S = 10.0

_MAGIC = b"PXA1"
_NONCE = 16
_MAC = 32
_HELLO = struct.Struct(f"<4s{_NONCE}s")
_CHALLENGE = struct.Struct(f"<4s{_NONCE}s{_MAC}s")


def cluster_secret() -> bytes:
    """This Ray session's secret, created on first use (see the module docstring)."""
    from ray.experimental import internal_kv

    secret = internal_kv._internal_kv_get(SECRET_KEY, namespace=KV_NAMESPACE)
    if secret:
        return secret
    # Several processes may race to create it: only the first put lands, all read it back.
    internal_kv._internal_kv_put(
        SECRET_KEY, secrets.token_bytes(32), overwrite=False, namespace=KV_NAMESPACE
    )
    secret = internal_kv._internal_kv_get(SECRET_KEY, namespace=KV_NAMESPACE)
    if not secret:
        raise RuntimeError("phalanx could not store its cluster secret in Ray's KV store")
    return secret


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


def client_handshake(sock: socket.socket, secret: bytes, peer: str) -> None:
    """Authenticate to the server on ``sock`` and check that it holds ``secret`` too."""
    timeout = sock.gettimeout()
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        client_nonce = secrets.token_bytes(_NONCE)
        sock.sendall(_HELLO.pack(_MAGIC, client_nonce))
        magic, server_nonce, server_mac = _CHALLENGE.unpack(_read(sock, _CHALLENGE.size))
        expected = _mac(secret, b"px-server", client_nonce, server_nonce)
        if magic != _MAGIC or not hmac.compare_digest(server_mac, expected):
            raise AuthenticationError(
                peer,
                f"the endpoint announced for {peer} failed authentication: it does not hold "
                "this Ray cluster's phalanx secret",
            )
        sock.sendall(_mac(secret, b"px-client", server_nonce, client_nonce))
    except (OSError, ConnectionError, struct.error) as e:
        if isinstance(e, CommError):
            raise
        raise AuthenticationError(
            peer, f"handshake with {peer} failed: {type(e).__name__}: {e}"
        ) from None
    finally:
        sock.settimeout(timeout)


def server_handshake(sock: socket.socket, secret: bytes) -> bool:
    """True when the client on ``sock`` proved it holds ``secret``; nothing else is read."""
    timeout = sock.gettimeout()
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        magic, client_nonce = _HELLO.unpack(_read(sock, _HELLO.size))
        if magic != _MAGIC:
            return False
        server_nonce = secrets.token_bytes(_NONCE)
        server_mac = _mac(secret, b"px-server", client_nonce, server_nonce)
        sock.sendall(_CHALLENGE.pack(_MAGIC, server_nonce, server_mac))
        client_mac = _read(sock, _MAC)
        return hmac.compare_digest(
            client_mac, _mac(secret, b"px-client", server_nonce, client_nonce)
        )
    except (OSError, ConnectionError, struct.error):
        return False
    finally:
        try:
            sock.settimeout(timeout)
        except OSError:
            pass
