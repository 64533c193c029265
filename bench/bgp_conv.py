#!/usr/bin/env python3
"""One convergence repetition of bench/bgp.sh (issue 30), timed from here.

Starts `rcni-node run` (the command after `--`) at t0 and polls, every
--poll-ms, until the node's pod prefix is in every simulated node's import
table (the simulating BIRD's control socket) and the N-1 simulated prefixes
are in the node's main table with proto 0x52; then rewrites the cluster
file without the node (the agent shuts BIRD down cleanly) at t1 and polls
until the prefix is gone from every simulated table. On the way it notes
when each stage was first seen, so that a slow total says where the time
went:
  ctl      the agent's BIRD answers on its control socket
  est      the route reflector sees the node's session Established
  sims     the node's prefix in all N-1 simulated tables
  k252     the N-1 learned routes in BIRD's kernel table (252, proto bird)
  main     the N-1 routes in main with proto 0x52 (the agent's mirror)
  down     (withdrawal) the reflector sees the session leave Established
  gone     (withdrawal) the prefix in no simulated table
and, from the agent's stderr (each line stamped as it arrives):
  started  "bgp: BIRD started"
  changed  (withdrawal) the agent saw the cluster file change
  shut     (withdrawal) "bgp: BIRD shut down" (BIRD has exited)
Prints one JSON object. The agent gets SIGTERM at the end (its routes are
flushed by the caller).
"""

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time


def birdc(sock, cmd):
    """One command over BIRD's control socket; the reply's text, or None."""
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(sock)
    except OSError:
        return None
    try:
        f = s.makefile("rwb")
        f.readline()  # greeting: 0001 BIRD x ready.
        f.write(cmd.encode() + b"\n")
        f.flush()
        out = []
        while True:
            line = f.readline()
            if not line:
                return None
            line = line.decode(errors="replace").rstrip("\n")
            if len(line) >= 5 and line[:4].isdigit() and line[4] in "- ":
                out.append(line[5:])
                if line[4] == " ":
                    return "\n".join(out)
            else:
                out.append(line[1:] if line.startswith(" ") else line)
    except OSError:
        return None
    finally:
        s.close()


def lines(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    return [l for l in r.stdout.splitlines() if l.strip()]


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--ns", required=True)
    a.add_argument("--n", type=int, required=True)
    a.add_argument("--prefix", required=True)
    a.add_argument("--sim-sock", required=True)
    a.add_argument("--rr-sock", required=True)
    a.add_argument("--rr-proto", required=True)
    a.add_argument("--node-sock", required=True)
    a.add_argument("--cluster", required=True)
    a.add_argument("--cluster-without", required=True)
    a.add_argument("--poll-ms", type=float, default=10)
    a.add_argument("--timeout", type=float, default=30)
    a.add_argument("--log", required=True)
    a.add_argument("cmd", nargs=argparse.REMAINDER)
    o = a.parse_args()
    cmd = o.cmd[1:] if o.cmd and o.cmd[0] == "--" else o.cmd
    want = o.n - 1
    polls = 0

    def sims_with_prefix():
        r = birdc(o.sim_sock, f"show route {o.prefix} table all")
        return -1 if r is None else r.count("Table t")

    def rr_established():
        r = birdc(o.rr_sock, f"show protocols {o.rr_proto}")
        return r is not None and "Established" in r

    res = {"n": o.n}
    log = open(o.log, "ab")
    stamps = {}
    t1 = None

    def reader(pipe, t0):
        for raw in pipe:
            now = time.monotonic()
            log.write(raw)
            log.flush()
            line = raw.decode(errors="replace")
            if "bgp: BIRD started" in line:
                stamps.setdefault("started", now - t0)
            elif t1 is not None and "changed" in line:
                stamps.setdefault("changed", now - t1)
            elif t1 is not None and "bgp: BIRD shut down" in line:
                stamps.setdefault("shut", now - t1)

    t0 = time.monotonic()
    agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE)
    th = threading.Thread(target=reader, args=(agent.stderr, t0), daemon=True)
    th.start()
    seen = {}
    tick = o.poll_ms / 1000
    try:
        while len(seen) < 5:  # ctl, est, sims, k252, main
            now = time.monotonic() - t0
            if now > o.timeout:
                res["error"] = f"up: not converged in {o.timeout} s (stages seen: {sorted(seen)})"
                break
            polls += 1
            if "ctl" not in seen and birdc(o.node_sock, "show status") is not None:
                seen["ctl"] = now
            if "est" not in seen and rr_established():
                seen["est"] = now
            if "sims" not in seen and sims_with_prefix() == want:
                seen["sims"] = now
            if "k252" not in seen and len(lines(
                    ["ip", "-n", o.ns, "route", "show", "table", "252", "proto", "bird"])) == want:
                seen["k252"] = now
            if "main" not in seen and len(lines(
                    ["ip", "-n", o.ns, "route", "show", "proto", "0x52"])) == want:
                seen["main"] = now
            if agent.poll() is not None:
                res["error"] = f"agent exited ({agent.returncode})"
                break
            nxt = t0 + now + tick
            time.sleep(max(0.0, nxt - time.monotonic()))
        if "started" in stamps:
            seen["started"] = stamps["started"]
        res["up"] = {k: round(v * 1000, 1) for k, v in seen.items()}
        if "error" not in res:
            res["up_ms"] = round(max(seen["sims"], seen["main"]) * 1000, 1)
            # Withdrawal: the node leaves the cluster (rename over: the
            # agent sees the whole new file or the old one).
            tmp = o.cluster + ".new"
            with open(o.cluster_without) as src, open(tmp, "w") as dst:
                dst.write(src.read())
            # Not right after the agent's pass that mirrored the routes:
            # its next look at the file would always be one tick away.
            time.sleep(random.uniform(0.2, 0.7))
            t1 = time.monotonic()
            os.rename(tmp, o.cluster)
            gone = {}
            while len(gone) < 2:
                now = time.monotonic() - t1
                if now > o.timeout:
                    res["error"] = f"down: prefix still at the simulated nodes after {o.timeout} s"
                    break
                polls += 1
                if "down" not in gone and not rr_established():
                    gone["down"] = now
                if "gone" not in gone and sims_with_prefix() == 0:
                    gone["gone"] = now
                nxt = t1 + now + tick
                time.sleep(max(0.0, nxt - time.monotonic()))
            time.sleep(0.05)  # the agent's last lines
            for k in ("changed", "shut"):
                if k in stamps:
                    gone[k] = stamps[k]
            res["down"] = {k: round(v * 1000, 1) for k, v in gone.items()}
            if "gone" in gone:
                res["down_ms"] = round(gone["gone"] * 1000, 1)
    finally:
        # (The loop that waits for the two withdrawal stages counts keys:
        # the stamps join only after it.)
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(5)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
    res["polls"] = polls
    print(json.dumps(res), flush=True)
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
