"""A tiny TCP throughput probe used to check the emulated links.

Receiver (prints ``READY`` once listening, then one JSON line)::

    python -m bpstrain.bench._tcp_probe recv --host 10.213.0.2 --port 5001 --conns 1

Sender (sends ``--bytes`` bytes, then closes)::

    python -m bpstrain.bench._tcp_probe send --host 10.213.0.2 --port 5001 --bytes 8000000

The receiver reports ``{"bytes": N, "seconds": T, "mbit_s": R}`` measured from
the first byte received to the last one, over all connections together.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

_CHUNK = 1 << 16


def receive(host: str, port: int, conns: int, timeout_s: float) -> dict:
    """Accepts ``conns`` connections and drains them; returns aggregate throughput."""
    with socket.create_server((host, port), backlog=conns) as srv:
        srv.settimeout(timeout_s)
        print("READY", flush=True)
        first: list[float] = []
        last: list[float] = []
        totals: list[int] = []
        lock = threading.Lock()

        def drain(sock: socket.socket) -> None:
            total, t_first = 0, None
            with sock:
                sock.settimeout(timeout_s)
                while chunk := sock.recv(_CHUNK):
                    if t_first is None:
                        t_first = time.perf_counter()
                    total += len(chunk)
            with lock:
                totals.append(total)
                if t_first is not None:
                    first.append(t_first)
                    last.append(time.perf_counter())

        threads = []
        for _ in range(conns):
            sock, _addr = srv.accept()
            thread = threading.Thread(target=drain, args=(sock,), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(timeout_s)
    nbytes = sum(totals)
    seconds = (max(last) - min(first)) if first else 0.0
    return {"bytes": nbytes, "seconds": seconds,
            "mbit_s": nbytes * 8 / seconds / 1e6 if seconds > 0 else 0.0}


def send(host: str, port: int, nbytes: int, timeout_s: float) -> None:
    """Connects (retrying until ``timeout_s``) and sends ``nbytes`` zero bytes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = bytes(_CHUNK)
    with sock:
        remaining = nbytes
        while remaining > 0:
            sent = sock.send(payload[:min(remaining, _CHUNK)])
            remaining -= sent


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bpstrain.bench._tcp_probe")
    parser.add_argument("mode", choices=["recv", "send"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--conns", type=int, default=1)
    parser.add_argument("--bytes", type=int, default=8_000_000)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.mode == "recv":
        print(json.dumps(receive(args.host, args.port, args.conns, args.timeout)), flush=True)
    else:
        send(args.host, args.port, args.bytes, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
