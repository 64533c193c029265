#!/usr/bin/env python3
"""The EC2 API the cloud tests run against: moto's server (PyPI
`moto[server]` 5.2.6, a model of EC2 nobody here wrote) with what it lacks
and what the tests need, marked "ours" below. The VPC lab also runs moto's
own server with none of this (integration/src/lab/vpc.rs, `Model::Stock`),
so that a test fails where moto and EC2 differ and the agent relied on the
side of it this file takes:

- IPv4 prefix delegation (/28 prefixes on ENIs): Ipv4PrefixCount and
  Ipv4Prefix.N on CreateNetworkInterface and Assign/UnassignPrivateIpAddresses,
  reported as EC2 does (`ipv4PrefixSet` in DescribeNetworkInterfaces,
  `assignedIpv4PrefixSet` in AssignPrivateIpAddresses' answer).
- Addresses as EC2 hands them out: unique in the subnet, never one of the
  five EC2 reserves, never inside a delegated prefix; moto draws them at
  random per interface and can give one address to two interfaces.
- EC2's limits and refusals moto lacks: addresses plus prefixes per interface
  (PrivateIpAddressLimitExceeded), interfaces per instance
  (AttachmentLimitExceeded), one interface per device index; an explicit
  address someone else has, and unassigning an interface's primary address,
  refused.
- AssignPrivateIpAddresses answers with the new addresses only, as EC2 does
  (moto lists all of the interface's).
- Throttling on demand: `POST /_rcni/throttle` with `{"every": N}` makes
  one mutating call (anything but Describe*/Get*) in N, on average, answer
  HTTP 503 with EC2's RequestLimitExceeded error (1: all of them; 0 turns
  it off). Drawn from a fixed-seed generator rather than strictly every
  Nth: a strict period locks step with a retry cycle of the same length
  (create, attach refused, delete: every attach refused forever), which
  EC2's token buckets never do. `GET /_rcni/throttle`
  shows the setting and how many were refused.
- `GET /_rcni/calls`: requests received per EC2 Action (refused ones too),
  `POST /_rcni/calls/reset` zeroes them.

Requests are served one at a time (moto's model is not thread-safe, and the
address allocator below relies on it).

Usage: ec2_model.py --listen HOST:PORT   (prints `ready` once listening)
"""

import argparse
import ipaddress
import json
import random
import sys
import threading
import uuid
from io import BytesIO
from urllib.parse import parse_qs

from moto.core.responses import ActionResult
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.models import ec2_backends
from moto.ec2.models import elastic_network_interfaces as moto_eni
from moto.ec2.models.instance_types import INSTANCE_TYPES
from moto.ec2.models.instances import Instance
from moto.ec2.models.subnets import Subnet
from moto.ec2.responses.elastic_network_interfaces import ElasticNetworkInterfaces
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    create_backend_app,
)
from werkzeug.serving import make_server

try:
    # moto's server serves with its own handler since 5.2.6 (S3 metadata
    # headers with underscores); serve as it does.
    from moto.moto_server.werkzeug_app import MotoRequestHandler as BaseHandler
except ImportError:
    from werkzeug.serving import WSGIRequestHandler as BaseHandler

PREFIX_LEN = 28

# --- ours: addresses and prefixes as EC2 allocates them -------------------

# Addresses drawn during the current request but not yet on an interface
# (moto draws several before it stores them): cleared per request.
_drawn: set = set()
_lock = threading.Lock()


def _backends():
    # dict.values: only the accounts and regions that exist (BackendDict's
    # own accessors create them on lookup).
    for account in dict.values(ec2_backends):
        yield from dict.values(account)


def _subnets_with(cidr):
    for backend in _backends():
        for subnets in backend.subnets.values():
            for subnet in subnets.values():
                if subnet.cidr_block == cidr:
                    yield backend, subnet


def _prefixes(eni):
    return getattr(eni, "ipv4_prefixes", None) or []


def _taken(cidr):
    """Addresses of the subnet (every subnet with this CIDR: conservative)
    that are assigned, reserved by EC2, inside a delegated prefix, or drawn
    in this request."""
    net = ipaddress.IPv4Network(cidr)
    base = int(net.network_address)
    # EC2 reserves the network address, the next three (router, DNS,
    # future use) and the broadcast address.
    taken = {ipaddress.IPv4Address(base + i) for i in range(4)}
    taken.add(net.broadcast_address)
    taken |= {ipaddress.IPv4Address(a) for a in _drawn}
    for backend, subnet in _subnets_with(cidr):
        taken |= {ipaddress.IPv4Address(a) for a in subnet._subnet_ips}
        for eni in backend.enis.values():
            if eni.subnet.id != subnet.id:
                continue
            for item in eni.private_ip_addresses:
                a = item.get("PrivateIpAddress")
                if a:
                    taken.add(ipaddress.IPv4Address(a))
            for p in _prefixes(eni):
                taken |= set(ipaddress.IPv4Network(p["Ipv4Prefix"]))
    return taken


def _free_ip(cidr=None, ipv6=False):
    """Replaces moto's random_private_ip for interfaces: a random free
    address of the subnet."""
    if ipv6 or cidr is None:
        return _moto_random_private_ip(cidr, ipv6)
    net = ipaddress.IPv4Network(cidr)
    taken = _taken(cidr)
    free = [a for a in net if a not in taken]
    if not free:
        raise EC2ClientError(
            "InsufficientFreeAddressesInSubnet",
            f"The specified subnet {cidr} does not have enough free addresses to satisfy the request.",
        )
    ip = str(random.choice(free))
    _drawn.add(ip)
    return ip


def _free_prefixes(subnet, count):
    taken = _taken(subnet.cidr_block)
    net = ipaddress.IPv4Network(subnet.cidr_block)
    if net.prefixlen > PREFIX_LEN:
        candidates = []
    else:
        candidates = [
            p for p in net.subnets(new_prefix=PREFIX_LEN) if not any(a in taken for a in p)
        ]
    if len(candidates) < count:
        raise EC2ClientError(
            "InsufficientCidrBlocks",
            "The specified subnet does not have enough free cidr blocks to satisfy the request.",
        )
    return [str(p) for p in random.sample(candidates, count)]


def _check_slots(eni, more):
    """EC2 counts the primary, each secondary address and each prefix
    against the instance type's Ipv4AddressesPerInterface."""
    if eni.instance is None:
        return
    limit = INSTANCE_TYPES.get(eni.instance.instance_type, {}).get("NetworkInfo", {}).get(
        "Ipv4AddressesPerInterface"
    )
    if limit and len(eni.private_ip_addresses) + len(_prefixes(eni)) + more > limit:
        raise EC2ClientError(
            "PrivateIpAddressLimitExceeded",
            "Number of private addresses will exceed limit.",
        )


def _add_prefixes(eni, explicit, count):
    _check_slots(eni, len(explicit) + count)
    new = []
    taken = _taken(eni.subnet.cidr_block)
    for p in explicit:
        net = ipaddress.IPv4Network(p)
        if any(a in taken for a in net):
            raise EC2ClientError(
                "InvalidParameterValue", f"Prefix {p} is in use or reserved."
            )
        new.append(str(net))
    if count:
        new += _free_prefixes(eni.subnet, count)
    eni.ipv4_prefixes = _prefixes(eni) + [{"Ipv4Prefix": p} for p in new]
    return new


_moto_random_private_ip = moto_eni.random_private_ip
moto_eni.random_private_ip = _free_ip

_moto_get_available_subnet_ip = Subnet.get_available_subnet_ip


def _get_available_subnet_ip(self, instance):
    # An instance's primary address (moto's own sequential allocator) must
    # not be one an interface or a prefix already has.
    taken = _taken(self.cidr_block)
    skipped = []
    while True:
        ip = _moto_get_available_subnet_ip(self, instance)
        if ipaddress.IPv4Address(ip) not in taken:
            break
        skipped.append(ip)
    for other in skipped:
        self._subnet_ips.pop(other, None)
    return ip


Subnet.get_available_subnet_ip = _get_available_subnet_ip

_moto_attach_eni = Instance.attach_eni


def _attach_eni(self, eni, device_index):
    device_index = int(device_index)
    nics = getattr(self, "nics", None)
    # prep_nics attaches the instance's own interfaces while it builds
    # them: only later attachments are checked.
    if nics:
        limit = INSTANCE_TYPES.get(self.instance_type, {}).get("NetworkInfo", {}).get(
            "MaximumNetworkInterfaces"
        )
        if device_index in nics:
            raise EC2ClientError(
                "InvalidParameterValue",
                f"Instance '{self.id}' already has an interface attached at device index '{device_index}'.",
            )
        if limit and len(nics) >= limit:
            raise EC2ClientError(
                "AttachmentLimitExceeded",
                f"Interface count {len(nics) + 1} exceeds the limit for {self.instance_type}",
            )
    if eni.instance is not None and eni.instance is not self:
        raise EC2ClientError(
            "InvalidParameterValue", f"Interface {eni.id} is already attached."
        )
    return _moto_attach_eni(self, eni, device_index)


Instance.attach_eni = _attach_eni

_moto_create_network_interface = ElasticNetworkInterfaces.create_network_interface


def _create_network_interface(self):
    explicit = [p["Ipv4Prefix"] for p in self._get_param("Ipv4Prefixes", []) or []]
    count = self._get_int_param("Ipv4PrefixCount", 0) or 0
    result = _moto_create_network_interface(self)
    if explicit or count:
        eni = result.result["NetworkInterface"]
        try:
            _add_prefixes(eni, explicit, count)
        except EC2ClientError:
            # EC2 creates nothing when it cannot delegate the prefixes.
            self.ec2_backend.delete_network_interface(eni.id)
            raise
    return result


def _assign_private_ip_addresses(self):
    eni_id = self._get_param("NetworkInterfaceId")
    count = self._get_int_param("SecondaryPrivateIpAddressCount", 0) or 0
    explicit_ips = self._get_param("PrivateIpAddresses", []) or []
    explicit_prefixes = self._get_param("Ipv4Prefixes", []) or []
    prefix_count = self._get_int_param("Ipv4PrefixCount", 0) or 0
    eni = self.ec2_backend.get_network_interface(eni_id)
    if (count or explicit_ips) and (prefix_count or explicit_prefixes):
        raise EC2ClientError(
            "InvalidParameterCombination",
            "Addresses and prefixes cannot be assigned in one request.",
        )
    result = {"NetworkInterfaceId": eni.id}
    if prefix_count or explicit_prefixes:
        new = _add_prefixes(eni, explicit_prefixes, prefix_count)
        result["AssignedIpv4Prefixes"] = [{"Ipv4Prefix": p} for p in new]
        return ActionResult(result)
    _check_slots(eni, len(explicit_ips) + count)
    before = {item.get("PrivateIpAddress") for item in eni.private_ip_addresses}
    # EC2 refuses an address someone has (without AllowReassignment, which
    # nothing here uses), one it reserves, or one outside the subnet; moto
    # takes any.
    taken = _taken(eni.subnet.cidr_block)
    for ip in explicit_ips:
        addr = ipaddress.IPv4Address(ip)
        if addr not in ipaddress.IPv4Network(eni.subnet.cidr_block) or (
            addr in taken and ip not in before
        ):
            raise EC2ClientError(
                "InvalidParameterValue",
                f"Address {ip} is in use, reserved or not in subnet {eni.subnet.cidr_block}.",
            )
    self.ec2_backend.assign_private_ip_addresses(eni_id, explicit_ips, count)
    result["AssignedPrivateIpAddresses"] = [
        {"PrivateIpAddress": item["PrivateIpAddress"]}
        for item in eni.private_ip_addresses
        if item.get("PrivateIpAddress") not in before
    ]
    return ActionResult(result)


def _unassign_private_ip_addresses(self):
    eni_id = self._get_param("NetworkInterfaceId")
    ips = self._get_param("PrivateIpAddresses", []) or []
    prefixes = self._get_param("Ipv4Prefixes", []) or []
    eni = self.ec2_backend.get_network_interface(eni_id)
    have = {p["Ipv4Prefix"] for p in _prefixes(eni)}
    for p in prefixes:
        if str(ipaddress.IPv4Network(p, strict=False)) not in have:
            raise EC2ClientError(
                "InvalidParameterValue", f"Prefix {p} is not assigned to {eni_id}."
            )
    if eni.private_ip_address in ips:
        # moto would drop the interface's primary address; EC2 refuses.
        raise EC2ClientError(
            "InvalidParameterValue",
            f"The primary address {eni.private_ip_address} of {eni_id} cannot be unassigned.",
        )
    gone = {str(ipaddress.IPv4Network(p, strict=False)) for p in prefixes}
    eni.ipv4_prefixes = [p for p in _prefixes(eni) if p["Ipv4Prefix"] not in gone]
    if ips:
        self.ec2_backend.unassign_private_ip_addresses(eni_id, ips)
    return ActionResult({})


ElasticNetworkInterfaces.create_network_interface = _create_network_interface
ElasticNetworkInterfaces.assign_private_ip_addresses = _assign_private_ip_addresses
ElasticNetworkInterfaces.unassign_private_ip_addresses = _unassign_private_ip_addresses

# --- ours: the test controls (throttling, call counts) ------------------------


class Model:
    def __init__(self, app):
        self.app = app
        self.calls = {}
        self.every = 0
        self.mutating = 0
        self.throttled = 0
        self.rng = random.Random(31)

    def __call__(self, environ, start_response):
        with _lock:
            _drawn.clear()
            try:
                return self.handle(environ, start_response)
            finally:
                _drawn.clear()

    def handle(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "GET")
        if path.startswith("/_rcni/"):
            return self.control(method, path, environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        environ["wsgi.input"] = BytesIO(body)
        action = self.action(environ, body)
        if action:
            self.calls[action] = self.calls.get(action, 0) + 1
            if not action.startswith(("Describe", "Get")):
                self.mutating += 1
                if self.every and self.rng.randrange(self.every) == 0:
                    self.throttled += 1
                    return self.throttle(start_response)
        return self.app(environ, start_response)

    @staticmethod
    def action(environ, body):
        query = parse_qs(environ.get("QUERY_STRING", ""))
        if "Action" in query:
            return query["Action"][0]
        ctype = environ.get("CONTENT_TYPE", "")
        if body and "x-www-form-urlencoded" in ctype:
            form = parse_qs(body.decode("utf-8", "replace"))
            if "Action" in form:
                return form["Action"][0]
        return None

    @staticmethod
    def throttle(start_response):
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            "<Response><Errors><Error><Code>RequestLimitExceeded</Code>"
            "<Message>Request limit exceeded.</Message></Error></Errors>"
            f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
        ).encode()
        start_response(
            "503 Service Unavailable",
            [("Content-Type", "text/xml"), ("Content-Length", str(len(body)))],
        )
        return [body]

    def control(self, method, path, environ, start_response):
        def answer(status, obj):
            data = json.dumps(obj).encode()
            start_response(
                status,
                [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
            )
            return [data]

        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        if path == "/_rcni/calls" and method == "GET":
            return answer("200 OK", self.calls)
        if path == "/_rcni/calls/reset" and method == "POST":
            self.calls = {}
            return answer("200 OK", {})
        if path == "/_rcni/throttle" and method == "GET":
            return answer("200 OK", {"every": self.every, "throttled": self.throttled})
        if path == "/_rcni/throttle" and method == "POST":
            try:
                every = int(json.loads(body or b"{}").get("every", 0))
                if every < 0:
                    raise ValueError("every < 0")
            except (ValueError, AttributeError, TypeError) as e:
                return answer("400 Bad Request", {"error": str(e)})
            self.every = every
            self.mutating = 0
            self.rng = random.Random(31)
            return answer("200 OK", {"every": self.every})
        return answer("404 Not Found", {"error": f"no {method} {path}"})


class QuietHandler(BaseHandler):
    # A line per request on stderr would bury the test's own output.
    def log_request(self, *args, **kwargs):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    host = host.strip("[]")
    app = Model(DomainDispatcherApplication(create_backend_app))
    server = make_server(host, int(port), app, threaded=False, request_handler=QuietHandler)
    print("ready", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
