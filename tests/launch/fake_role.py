"""Stand-in for ``python -m bpstrain.launch`` in role mode (scheduler / server).

A tiny rendezvous over the real DMLC_PS_ROOT_URI/PORT, so the tests exercise the
launcher's env plumbing without the C++ engine: the scheduler exits 0 once every
worker said "bye" (and closes the servers' connections), servers exit on EOF.

Knobs (env): FAKE_ROLE_FAIL=<role> exits 3 after starting; FAKE_ROLE_STUCK=1
never exits after its work; FAKE_GRANDCHILD=1 starts a long sleeper in the same process group.
"""

import os
import signal
import socket
import subprocess
import sys
import time

role = os.environ["DMLC_ROLE"]
host, port = os.environ["DMLC_PS_ROOT_URI"], int(os.environ["DMLC_PS_ROOT_PORT"])
print(f"{role} ready pid={os.getpid()} host_id={os.environ.get('BPSTRAIN_HOST_ID', '-')}",
      flush=True)
if os.environ.get("FAKE_GRANDCHILD") == "1":
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild={sleeper.pid}", flush=True)
if os.environ.get("FAKE_ROLE_FAIL") == role:
    print(f"{role} failing on purpose", flush=True)
    sys.exit(3)


def connect() -> socket.socket:
    for _ in range(400):  # The scheduler may not be listening yet; no event to wait on.
        try:
            return socket.create_connection((host, port), timeout=60)
        except OSError:
            time.sleep(0.025)
    raise SystemExit(f"{role}: scheduler at {host}:{port} never came up")


if role == "scheduler":
    listener = socket.create_server((host, port))
    servers, byes = [], 0
    # Like a real scheduler: done once every server registered and every worker left.
    workers = int(os.environ["DMLC_NUM_WORKER"]) * int(os.environ["BYTEPS_LOCAL_SIZE"])
    while byes < workers or \
            len(servers) < int(os.environ["DMLC_NUM_SERVER"]):
        conn, _ = listener.accept()
        kind = conn.makefile().readline().split()
        if kind[0] == "server":
            servers.append(conn)
        else:
            byes += 1
            print(f"bye from rank {kind[1]}", flush=True)
            conn.close()
    for conn in servers:
        conn.close()
    print("scheduler done", flush=True)
else:
    conn = connect()
    conn.sendall(f"server {os.environ['DMLC_SERVER_ID']}\n".encode())
    conn.recv(1)  # EOF once the scheduler is done.
    print("server done", flush=True)
if os.environ.get("FAKE_ROLE_STUCK") == "1":
    while True:
        signal.pause()
