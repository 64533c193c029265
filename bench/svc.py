"""The connection client and server of bench/k8s-services.sh, run in a
pod's network namespace. Each connection is closed with a reset
(SO_LINGER 0): no TIME_WAIT piles up over tens of thousands of them.

    python3 bench/svc.py server PORT
        accepts and closes; says "ready" once listening
    python3 bench/svc.py connect FILE PASSES
        FILE: "ADDRESS PORT" per line; PASSES times over them in a shuffled
        order, one new connection each; prints JSON: each connect()'s
        time in microseconds ("us") and the ones that failed ("failed");
        fails itself when most did
    python3 bench/svc.py cps FILE SECONDS
        new connections over FILE's targets in turn for SECONDS; prints
        connections made per second and how many failed
    python3 bench/svc.py until ADDRESS PORT TIMEOUT
        tries until the address refuses (the Service is known, without an
        endpoint: prints "known"), then reads a line from stdin (the driver
        writes the endpoints meanwhile) and tries until a connection is
        made; prints time.monotonic_ns() at that moment (or "timeout")
"""
import errno
import json
import random
import socket
import struct
import sys
import time

LINGER0 = struct.pack("ii", 1, 0)


def attempt(addr, port, timeout=2.0):
    """connect()'s time in ns, or the errno it failed with (negative)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER0)
    s.settimeout(timeout)
    try:
        a = time.perf_counter_ns()
        s.connect((addr, port))
        return time.perf_counter_ns() - a
    except socket.timeout:
        return -errno.ETIMEDOUT
    except OSError as e:
        return -(e.errno or errno.EIO)
    finally:
        s.close()


def targets(path):
    with open(path) as f:
        return [(a, int(p)) for a, p in (line.split() for line in f if line.strip())]


def main():
    cmd = sys.argv[1]
    if cmd == "server":
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", int(sys.argv[2])))
        s.listen(4096)
        print("ready", flush=True)
        while True:
            c, _ = s.accept()
            c.close()
    elif cmd == "connect":
        ts = targets(sys.argv[2])
        out, failed = [], []
        for _ in range(int(sys.argv[3])):
            random.shuffle(ts)
            for a, p in ts:
                t = attempt(a, p)
                if t < 0:
                    failed.append(f"{a}:{p} {errno.errorcode.get(-t, -t)}")
                else:
                    out.append(t / 1000)
        # Most failed: not answered yet (the driver waits on that).
        if len(failed) * 2 > len(out):
            sys.exit(f"{len(failed)} connections failed: {failed[:3]}")
        print(json.dumps({"us": out, "failed": failed}))
    elif cmd == "cps":
        ts = targets(sys.argv[2])
        end = time.monotonic() + float(sys.argv[3])
        n = failed = 0
        start = time.monotonic()
        while time.monotonic() < end:
            for a, p in ts[n % len(ts):n % len(ts) + 64] or ts[:64]:
                if attempt(a, p) < 0:
                    failed += 1
                n += 1
        # A rare failure (a reused port meeting its predecessor's state)
        # is counted, not fatal: the driver reports it.
        print(f"{(n - failed) / (time.monotonic() - start):.0f} {failed}")
    elif cmd == "until":
        addr, port, timeout = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
        end = time.monotonic() + timeout
        while attempt(addr, port, 0.05) != -errno.ECONNREFUSED:
            if time.monotonic() > end:
                print("timeout", flush=True)
                return
            time.sleep(0.01)
        print("known", flush=True)
        sys.stdin.readline()
        while time.monotonic() < end:
            if attempt(addr, port, 0.05) >= 0:
                print(time.monotonic_ns(), flush=True)
                return
            time.sleep(0.0002)
        print("timeout", flush=True)
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
