"""The TCP example driver's frames: one fixed header, then the frame's own bytes.

Sender to receiver: HELLO (the sender's address and the fence epoch of the
endpoint its link was made from), BATCH (destinations, sizes, the notification,
the payload; a notification alone is a BATCH of no descriptor), ABORT (a batch
id). Receiver to sender: DONE or FAILED (a batch id, the reason).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

HELLO, BATCH, ABORT, DONE, FAILED = range(1, 6)
HEADER = struct.Struct("<BQQIIQ")  # kind, batch id, generation, count, notify length, body
NO_NOTE = 0xFFFFFFFF


class Frame(NamedTuple):
    kind: int
    id: int
    generation: int
    dst: np.ndarray  # uint64
    nbytes: np.ndarray  # uint64
    notify: bytes | None
    body: bytes  # the payload (BATCH), address and epoch (HELLO), the reason (FAILED)


def encode(
    kind: int,
    id: int = 0,
    generation: int = 0,
    dst: np.ndarray | None = None,
    nbytes: np.ndarray | None = None,
    notify: bytes | None = None,
    body: bytes = b"",
) -> bytes:
    count = 0 if dst is None else len(dst)
    note = NO_NOTE if notify is None else len(notify)
    head = HEADER.pack(kind, id, generation, count, note, len(body))
    arrays = b"" if dst is None or nbytes is None else dst.tobytes() + nbytes.tobytes()
    return b"".join((head, arrays, notify or b"", body))


def decode(buf: bytearray) -> Frame | None:
    """The first whole frame in ``buf``, removed from it; None while it is incomplete."""
    if len(buf) < HEADER.size:
        return None
    kind, id, generation, count, note, body = HEADER.unpack_from(buf)
    notes = 0 if note == NO_NOTE else note
    size = HEADER.size + 16 * count + notes + body
    if len(buf) < size:
        return None
    at = HEADER.size
    dst = np.frombuffer(bytes(buf[at : at + 8 * count]), dtype=np.uint64)
    nbytes = np.frombuffer(bytes(buf[at + 8 * count : at + 16 * count]), dtype=np.uint64)
    at += 16 * count
    notify = None if note == NO_NOTE else bytes(buf[at : at + notes])
    payload = bytes(buf[at + notes : size])
    del buf[:size]
    return Frame(kind, id, generation, dst, nbytes, notify, payload)
