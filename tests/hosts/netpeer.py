"""A TCP end for the harness tests, run inside a host: ``python netpeer.py sink|send ...``.

``sink HOST PORT SECONDS``: accept one connection, read it for up to ``SECONDS`` (or to
its end), print ``<bytes> <seconds>``. ``send HOST PORT BYTES``: connect, send ``BYTES``
(0: until the peer goes), print ``sent``.
"""

from __future__ import annotations

import socket
import sys
import time


def sink(host: str, port: int, seconds: float) -> None:
    with socket.create_server((host, port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        conn.settimeout(0.2)
        got, start = 0, time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            try:
                data = conn.recv(1 << 16)
            except TimeoutError:
                continue
            if not data:
                break
            got += len(data)
        print(f"{got} {elapsed:.3f}", flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    block = b"\xa5" * (1 << 16)
    with socket.create_connection((host, port), timeout=30) as conn:
        sent = 0
        try:
            while nbytes == 0 or sent < nbytes:
                n = block if nbytes == 0 else block[: nbytes - sent]
                conn.sendall(n)
                sent += len(n)
        except OSError:  # the sink went away: done
            pass
    print("sent", flush=True)


if __name__ == "__main__":
    mode, host, port, amount = sys.argv[1:5]
    if mode == "sink":
        sink(host, int(port), float(amount))
    else:
        send(host, int(port), int(amount))
