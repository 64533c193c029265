#!/usr/bin/env python3
"""EC2's instance metadata service (IMDSv2 only) for one instance of the EC2
model (ec2_model.py), as the tests' stand-in for 169.254.169.254.

IMDSv2: `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`
(1..21600) answers a token; every GET must carry it in
`X-aws-ec2-metadata-token` (401 without it, or with an unknown or expired
one). What the instance and its interfaces look like is read from the EC2
model through boto3 on every request, so attachments and addresses made
through the API show here at once (EC2's own IMDS lags by seconds).

Usage: imds.py --listen HOST:PORT --ec2 URL --instance-id ID [--region R]
(prints `ready` once listening)
"""

import argparse
import secrets
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3

MAX_TTL = 21600


def metadata_tree(ec2, instance_id):
    """The meta-data tree: dicts are directories, strings files."""
    reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    inst = reservations[0]["Instances"][0]
    enis = ec2.describe_network_interfaces(
        Filters=[{"Name": "attachment.instance-id", "Values": [instance_id]}]
    )["NetworkInterfaces"]
    vpc_cidrs = {}
    macs = {}
    primary_mac = None
    for eni in enis:
        mac = eni["MacAddress"].lower()
        vpc_id = eni["VpcId"]
        if vpc_id not in vpc_cidrs:
            vpc = ec2.describe_vpcs(VpcIds=[vpc_id])["Vpcs"][0]
            blocks = [a["CidrBlock"] for a in vpc.get("CidrBlockAssociationSet", [])]
            vpc_cidrs[vpc_id] = blocks or [vpc["CidrBlock"]]
        subnet = ec2.describe_subnets(SubnetIds=[eni["SubnetId"]])["Subnets"][0]
        index = eni["Attachment"]["DeviceIndex"]
        if index == 0:
            primary_mac = mac
        # The primary address first, as EC2's local-ipv4s lists them.
        ips = sorted(
            eni.get("PrivateIpAddresses", []), key=lambda a: not a.get("Primary")
        )
        entry = {
            "device-number": str(index),
            "interface-id": eni["NetworkInterfaceId"],
            "mac": mac,
            "local-ipv4s": "\n".join(a["PrivateIpAddress"] for a in ips),
            "subnet-id": eni["SubnetId"],
            "subnet-ipv4-cidr-block": subnet["CidrBlock"],
            "vpc-id": vpc_id,
            "vpc-ipv4-cidr-block": vpc_cidrs[vpc_id][0],
            "vpc-ipv4-cidr-blocks": "\n".join(vpc_cidrs[vpc_id]),
            "security-group-ids": "\n".join(g["GroupId"] for g in eni.get("Groups", [])),
            "owner-id": eni.get("OwnerId", ""),
        }
        prefixes = [p["Ipv4Prefix"] for p in eni.get("Ipv4Prefixes", [])]
        if prefixes:
            entry["ipv4-prefix"] = "\n".join(prefixes)
        macs[mac] = entry
    placement = inst.get("Placement", {})
    az = placement.get("AvailabilityZone", "")
    region = ec2.meta.region_name
    return {
        "instance-id": inst["InstanceId"],
        "instance-type": inst["InstanceType"],
        "ami-id": inst.get("ImageId", ""),
        "local-ipv4": inst.get("PrivateIpAddress", ""),
        "mac": primary_mac or "",
        "placement": {"region": region, "availability-zone": az},
        "network": {"interfaces": {"macs": macs}},
    }


def lookup(tree, parts):
    node = tree
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, dict):
        return "\n".join(k + "/" if isinstance(v, dict) else k for k, v in node.items())
    return node


class Handler(BaseHTTPRequestHandler):
    server_version = "EC2ws"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def reply(self, code, text="", headers=()):
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.path != "/latest/api/token":
            return self.reply(404, "Not Found")
        try:
            ttl = int(self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
        except ValueError:
            return self.reply(400, "Bad Request")
        if not 1 <= ttl <= MAX_TTL:
            return self.reply(400, "Bad Request")
        token = secrets.token_urlsafe(32)
        self.server.tokens[token] = time.monotonic() + ttl
        self.reply(200, token, [("X-aws-ec2-metadata-token-ttl-seconds", str(ttl))])

    def do_GET(self):
        token = self.headers.get("X-aws-ec2-metadata-token")
        expiry = self.server.tokens.get(token) if token else None
        if expiry is None or expiry < time.monotonic():
            return self.reply(401, "Unauthorized")
        path = self.path.split("?")[0]
        if not path.startswith("/latest/meta-data"):
            return self.reply(404, "Not Found")
        parts = [p for p in path[len("/latest/meta-data") :].split("/") if p]
        try:
            tree = metadata_tree(self.server.ec2, self.server.instance_id)
        except Exception as e:  # the EC2 model down or the instance gone
            return self.reply(500, f"metadata unavailable: {e}")
        text = lookup(tree, parts)
        if text is None:
            return self.reply(404, "Not Found")
        self.reply(200, text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--ec2", required=True, help="the EC2 model's URL")
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--region", default="us-east-1")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    host = host.strip("[]")
    server = ThreadingHTTPServer((host, int(port)), Handler)
    server.tokens = {}
    server.instance_id = args.instance_id
    server.ec2 = boto3.client(
        "ec2",
        endpoint_url=args.ec2,
        region_name=args.region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    print("ready", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
