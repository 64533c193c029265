"""The request/response client and server of the pod-to-pod benches
(bench/crossnode.sh, bench/k8s-flannel.sh): one TCP connection, 1 byte each
way, TCP_NODELAY; the client prints the median round trip in microseconds.

    python3 bench/rr.py server            (listens on port 5301, says "ready")
    python3 bench/rr.py client ADDRESS N  (N round trips after 200 to warm up)
"""
import socket, sys, time
if sys.argv[1] == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5301)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = c.recv(1)
        if not b:
            break
        c.sendall(b)
else:
    n = int(sys.argv[3])
    c = socket.create_connection((sys.argv[2], 5301), timeout=5)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(200):  # warm-up: caches, neighbour resolution
        c.sendall(b"x"); c.recv(1)
    t = []
    for _ in range(n):
        a = time.perf_counter_ns(); c.sendall(b"x"); c.recv(1)
        t.append(time.perf_counter_ns() - a)
    t.sort()
    print(f"{t[len(t) // 2] / 1000:.1f}")
