"""Frames on a phalanx connection and the socket helpers that read and write them.

After the handshake (``auth.py``) the connecting side sends a JSON hello (``<I`` length,
at most 64 KiB). Every message then is a frame: a fixed ``<QQ`` header (metadata length,
inline bytes), the pickled metadata, then the inline bytes. A header over
``max_frame_bytes`` (``PHALANX_COMM_MAX_FRAME_BYTES``) breaks the connection before
anything is allocated, and large parts are read in chunks as they arrive, so a header
that promises a gigabyte and then falls silent costs no memory.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

PREFIX = struct.Struct("<QQ")  # meta length, inline bytes length
HELLO_LEN = struct.Struct("<I")  # length of the JSON hello that follows the handshake
MAX_HELLO = 1 << 16
MAX_IOV = 512
CHUNK = 1 << 24  # read at most this much ahead of the data that arrived


class FrameTooLarge(ValueError):
    """A frame header announced more bytes than ``max_frame_bytes`` allows."""


def check_frame(meta_len: int, inline_len: int, limit: int) -> None:
    """Refuse a frame larger than ``limit`` bytes in all (``FrameTooLarge``)."""
    if meta_len + inline_len > limit:
        raise FrameTooLarge(
            f"a frame of {meta_len + inline_len:,} bytes exceeds max_frame_bytes={limit:,} "
            "(PHALANX_COMM_MAX_FRAME_BYTES)"
        )


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``ConnectionError`` if the peer closes first."""
    n = 0
    total = view.nbytes
    while n < total:
        got = sock.recv_into(view[n:], min(total - n, 1 << 26))
        if got == 0:
            raise ConnectionError("connection closed by peer")
        n += got


def recv_bytes(sock: socket.socket, size: int) -> bytearray:
    """``size`` bytes from ``sock``, memory growing with what arrived (``CHUNK`` at a time)."""
    out = bytearray(min(size, CHUNK))
    recv_exact(sock, memoryview(out))
    while len(out) < size:
        chunk = bytearray(min(size - len(out), CHUNK))
        recv_exact(sock, memoryview(chunk))
        out += chunk
    return out


def send_views(sock: socket.socket, views: list[memoryview], check: Callable[[], None]) -> None:
    """Send all views in order; between partial sends ``check`` may raise (peer dead)."""
    views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if v.nbytes]
    while views:
        try:
            sent = sock.sendmsg(views[:MAX_IOV])
        except TimeoutError:
            check()
            continue
        while sent:
            head = views[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0


def frame_views(meta: bytes, inline: list[memoryview] = ()) -> list[memoryview]:
    """The views of one frame: header, metadata, inline bytes."""
    inline_len = sum(v.nbytes for v in inline)
    return [memoryview(PREFIX.pack(len(meta), inline_len)), memoryview(meta), *inline]


def closed_by_peer(sock: socket.socket, poller: object) -> bool:
    """True when the peer closed this outgoing connection (it never writes to it).

    ``poller``: a ``select.poll`` with ``sock`` registered for reading (one syscall here).
    """
    try:
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


def close_socket(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
