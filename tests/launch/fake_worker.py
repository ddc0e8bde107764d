"""Stand-in worker: reports its env, then says bye to the fake scheduler.

Knobs (env): FAKE_FAIL_RANK / FAKE_FAIL_CODE make one rank exit with that code;
FAKE_BLOCK=1 makes the other ranks wait until killed; FAKE_LINGER=S makes them
take S seconds before they finish; FAKE_IGNORE_TERM=1 ignores
SIGTERM; FAKE_GRANDCHILD=1 starts a long sleeper in the same process group.
FAKE_SYNC_DIR=D with FAKE_SYNC_COUNT=N: every rank creates D/<rank> once it has printed
its lines, and the failing rank fails only after N such files exist, so the ranks that
the launcher then stops have always printed theirs.
"""

import os
import signal
import socket
import subprocess
import sys
import time

env = os.environ
local_size = int(env["BYTEPS_LOCAL_SIZE"])
rank = int(env["DMLC_WORKER_ID"]) * local_size + int(env["BYTEPS_LOCAL_RANK"])
if env.get("FAKE_IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"rank={rank} worker_id={env['DMLC_WORKER_ID']} local_rank={env['BYTEPS_LOCAL_RANK']} "
      f"local_size={local_size} num_worker={env['DMLC_NUM_WORKER']} "
      f"num_server={env['DMLC_NUM_SERVER']} pid={os.getpid()}", flush=True)
print("second line", flush=True)
if env.get("BPSTRAIN_RESTART"):
    print(f"restart={env['BPSTRAIN_RESTART']}", flush=True)
if env.get("FAKE_GRANDCHILD") == "1":
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"grandchild={sleeper.pid}", flush=True)
sync_dir = env.get("FAKE_SYNC_DIR")
if sync_dir:
    open(os.path.join(sync_dir, str(rank)), "w").close()
if env.get("FAKE_FAIL_RANK") == str(rank):
    deadline = time.monotonic() + 30
    while sync_dir and len(os.listdir(sync_dir)) < int(env["FAKE_SYNC_COUNT"]):
        if time.monotonic() > deadline:
            sys.exit("fake worker: the other ranks never started")
        time.sleep(0.01)
    print("failing on purpose", flush=True)
    sys.exit(int(env.get("FAKE_FAIL_CODE", "1")))
if env.get("FAKE_BLOCK") == "1":
    print("blocking", flush=True)
    while True:
        signal.pause()
time.sleep(float(env.get("FAKE_LINGER", "0")))
for _ in range(400):  # Wait for the fake scheduler's port; it has no other signal.
    try:
        address = (env["DMLC_PS_ROOT_URI"], int(env["DMLC_PS_ROOT_PORT"]))
        with socket.create_connection(address) as conn:
            conn.sendall(f"bye {rank}\n".encode())
        break
    except OSError:
        time.sleep(0.025)
sys.stdout.write("no newline at the end")
