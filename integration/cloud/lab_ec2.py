#!/usr/bin/env python3
"""The VPC lab's hands on the EC2 model (integration/src/lab/vpc.rs): one
process per lab, run in the lab's VPC namespace, that makes the lab's own
EC2 calls through boto3 and tells the agents' calls from everyone else's.

Requests are JSON lines on stdin, one answer line each on stdout:
- {"op": "call", "method": "run_instances", "args": {...}}: a boto3 EC2
  call; answers {"ok": <response>} or {"error": "<Code>: <message>",
  "code": "<Code>"}.
- {"op": "enis"}: every interface, compact: id, mac, subnet, instance,
  device index, attachment status, primary address, secondary addresses,
  /28 prefixes.
- {"op": "model", "method": "GET"|"POST", "path": "/_rcni/...", "body":
  {...}}: the model's test controls (ec2_model.py).
- {"op": "agent_calls"}: the calls per EC2 Action the model received from
  anyone but this process and the IMDS stand-ins, i.e. from the agents.
- {"op": "reset_calls"}: zeroes the model's counts and ours.

The IMDS stand-ins (imds.py) read the model through `--proxy`, a counting
forwarder this process serves on the VPC's own address, so that their
Describe* calls are not taken for the agents'. The EC2 Query API is one
form-encoded POST per call; the forwarder passes it on byte for byte.

Usage: lab_ec2.py --ec2 URL [--proxy HOST:PORT]  (prints `ready`)
"""

import argparse
import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import boto3
import botocore.config
import botocore.exceptions

_lock = threading.Lock()
_own = {}
_proxied = {}


def _bump(counts, action):
    with _lock:
        counts[action] = counts.get(action, 0) + 1


def _count_own(event_name, **_):
    # before-send fires per HTTP attempt: a retried call counts as the
    # model counts it.
    _bump(_own, event_name.rsplit(".", 1)[-1])


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def forward(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        form = parse_qs((body or b"").decode("utf-8", "replace"))
        query = parse_qs(self.path.partition("?")[2])
        action = (form.get("Action") or query.get("Action") or [None])[0]
        if action:
            _bump(_proxied, action)
        headers = {
            k: v
            for k, v in self.headers.items()
            if k.lower() not in ("host", "connection", "content-length")
        }
        req = urllib.request.Request(
            self.server.upstream + self.path, data=body, headers=headers, method=self.command
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, rheaders, data = r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            status, rheaders, data = e.code, e.headers, e.read()
        except OSError as e:
            status, rheaders, data = 502, {}, str(e).encode()
        self.send_response(status)
        for k, v in rheaders.items():
            if k.lower() not in ("content-length", "connection", "transfer-encoding", "server", "date"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = forward
    do_POST = forward


def compact(eni):
    att = eni.get("Attachment") or {}
    ips = eni.get("PrivateIpAddresses", [])
    return {
        "id": eni["NetworkInterfaceId"],
        "mac": eni["MacAddress"].lower(),
        "subnet": eni["SubnetId"],
        "instance": att.get("InstanceId"),
        "device_index": att.get("DeviceIndex"),
        "status": att.get("Status"),
        "primary": next((a["PrivateIpAddress"] for a in ips if a.get("Primary")), None),
        "secondary": [a["PrivateIpAddress"] for a in ips if not a.get("Primary")],
        "prefixes": [p["Ipv4Prefix"] for p in eni.get("Ipv4Prefixes", [])],
    }


def model(upstream, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        upstream + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def handle(ec2, upstream, req):
    op = req.get("op")
    if op == "call":
        return getattr(ec2, req["method"])(**req.get("args", {}))
    if op == "enis":
        out = ec2.describe_network_interfaces()
        return [compact(e) for e in out["NetworkInterfaces"]]
    if op == "model":
        return model(upstream, req["method"], req["path"], req.get("body"))
    if op == "agent_calls":
        # Under the lock, so no forwarded call is counted while the two
        # are read. A forwarded call is counted before it is sent: one in
        # flight is subtracted before the model counts it (the IMDS
        # stand-ins make a few per agent start, none per pod).
        with _lock:
            total = model(upstream, "GET", "/_rcni/calls")
            for counts in (_own, _proxied):
                for k, v in counts.items():
                    total[k] = total.get(k, 0) - v
        # This very GET is not an Action; ours were counted before sending.
        return {k: v for k, v in total.items() if v}
    if op == "reset_calls":
        with _lock:
            model(upstream, "POST", "/_rcni/calls/reset")
            _own.clear()
            _proxied.clear()
        return {}
    raise ValueError(f"unknown op {op!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ec2", required=True, help="the EC2 model's URL")
    parser.add_argument("--proxy", help="HOST:PORT for the IMDS stand-ins' forwarder")
    parser.add_argument("--region", default="us-east-1")
    args = parser.parse_args()
    upstream = args.ec2.rstrip("/")
    ec2 = boto3.client(
        "ec2",
        endpoint_url=upstream,
        region_name=args.region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        # The lab's calls are not throttled (only mutating ones are, and
        # the lab makes those before a test turns throttling on): one try.
        config=botocore.config.Config(retries={"max_attempts": 1, "mode": "standard"}),
    )
    ec2.meta.events.register("before-send.ec2.*", _count_own)
    if args.proxy:
        host, _, port = args.proxy.rpartition(":")
        server = ThreadingHTTPServer((host, int(port)), Proxy)
        server.daemon_threads = True
        server.upstream = upstream
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            out = {"ok": handle(ec2, upstream, req)}
        except botocore.exceptions.ClientError as e:
            err = e.response.get("Error", {})
            out = {"error": f"{err.get('Code')}: {err.get('Message')}", "code": err.get("Code")}
        except Exception as e:  # reported to the test, which decides
            out = {"error": f"{type(e).__name__}: {e}", "code": None}
        sys.stdout.write(json.dumps(out, default=str) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
