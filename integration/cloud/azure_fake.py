#!/usr/bin/env python3
"""A fake of the two Azure APIs rcni-cloud's Azure provider calls: NOT Azure.

No emulator of Azure exists, so the Azure provider is tested against this:
one subscription, one resource group, one VM with one NIC in one VNet and
subnet, served as the published API documents them. What it follows:

- Instance Metadata Service (IMDS), `GET /metadata/instance?api-version=2021-02-01`
  with `Metadata: true` (a request without it, or with X-Forwarded-For, is
  refused with 400 as the docs say; a missing api-version is 400 too):
  https://learn.microsoft.com/en-us/azure/virtual-machines/instance-metadata-service
- A managed identity's token from IMDS,
  `GET /metadata/identity/oauth2/token?api-version=2018-02-01&resource=...`:
  https://learn.microsoft.com/en-us/entra/identity/managed-identities-azure-resources/how-to-use-vm-token
- Azure Resource Manager, `Authorization: Bearer <token>` (401 without a token
  this fake issued): Virtual Machines - Get (2024-07-01)
  https://learn.microsoft.com/en-us/rest/api/compute/virtual-machines/get ,
  Network Interfaces - Get / Create Or Update (2024-05-01)
  https://learn.microsoft.com/en-us/rest/api/virtualnetwork/network-interfaces/create-or-update ,
  Virtual Networks - Get, Subnets - Get
  https://learn.microsoft.com/en-us/rest/api/virtualnetwork/virtual-networks/get
- Optimistic concurrency: every resource carries an `etag`; a PUT whose
  `If-Match` is not the current one is refused with 412:
  https://learn.microsoft.com/en-us/azure/azure-resource-manager/management/optimistic-concurrency
- Long-running operations: a NIC PUT answers 200 with provisioningState
  `Updating` and an `Azure-AsyncOperation` URL whose status is `InProgress`
  until the update is done (--lro-seconds), then `Succeeded`; another PUT
  meanwhile is 409 AnotherOperationInProgress:
  https://learn.microsoft.com/en-us/azure/azure-resource-manager/management/async-operations
- Dynamic private addresses come from the subnet, lowest free first, never
  Azure's five reserved ones (the network address, .1 the gateway, .2 and .3
  DNS, the broadcast address); a subnet without room is 400 SubnetIsFull:
  https://learn.microsoft.com/en-us/azure/virtual-network/virtual-networks-faq#are-there-any-restrictions-on-using-ip-addresses-within-these-subnets
- At most --max-ipconfigs IP configurations per NIC (Azure's limit is 256:
  https://learn.microsoft.com/en-us/azure/azure-resource-manager/management/azure-subscription-service-limits#azure-resource-manager-virtual-networking-limits ;
  the docs give the limit, not the error code, so this fake's
  `NetworkInterfaceIpConfigurationCountExceedsLimit` is its own name).
- Throttling is HTTP 429 with Retry-After:
  https://learn.microsoft.com/en-us/azure/azure-resource-manager/management/request-limits-and-throttling

Test hooks, under /_rcni/ (never counted or throttled):
- `POST /_rcni/throttle {"every": N}`: every Nth request after this one is
  429 with `Retry-After: 1` (0 turns it off).
- `POST /_rcni/race {"puts": N}`: the next N NIC PUTs find the NIC changed
  by another writer just before (a new etag), so their If-Match is stale.
- `GET /_rcni/calls`: `{"total": n, "by": {"GET /metadata/instance": n, ...}}`.
- `GET /_rcni/state`: the NIC's IP configurations, `{name: address}`.

Usage: azure_fake.py --listen HOST:PORT --vm NAME --mac 00:0D:3A:.. \
         --subnet 10.1.0.0/24 --vnet 10.1.0.0/16 [--max-ipconfigs 256]
(prints `ready` once listening)
"""

import argparse
import ipaddress
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

NETWORK_API = "2024-05-01"
ARM_RESOURCE = "https://management.azure.com/"


class ApiError(Exception):
    def __init__(self, status, body, headers=None):
        super().__init__(status)
        self.status = status
        self.body = body
        self.headers = headers or {}


def arm_error(status, code, message, headers=None):
    return ApiError(status, {"error": {"code": code, "message": message, "details": []}}, headers)


def new_etag():
    return 'W/"%s"' % uuid.uuid4()


class IpConfig:
    def __init__(self, name, address, method, primary):
        self.name = name
        self.address = address
        self.method = method
        self.primary = primary


class Cloud:
    """The fake's whole state, behind one lock."""

    def __init__(self, args):
        self.lock = threading.Lock()
        self.sub = args.subscription
        self.rg = args.resource_group
        self.location = args.location
        self.vm = args.vm
        self.vm_size = args.vm_size
        self.vm_uuid = str(uuid.uuid4())
        self.nic = args.nic or f"{args.vm}-nic"
        self.vnet_name = args.vnet_name
        self.subnet_name = args.subnet_name
        hexmac = "".join(c for c in args.mac if c.isalnum()).upper()
        if len(hexmac) != 12:
            raise SystemExit(f"--mac {args.mac!r}: 12 hex digits")
        self.mac = hexmac
        self.subnet = ipaddress.IPv4Network(args.subnet)
        self.vnets = [ipaddress.IPv4Network(v) for v in args.vnet]
        if not any(self.subnet.subnet_of(v) for v in self.vnets):
            raise SystemExit(f"--subnet {self.subnet} is not inside --vnet {args.vnet}")
        self.max_ipconfigs = args.max_ipconfigs
        self.lro_seconds = args.lro_seconds
        self.retry_after = args.retry_after
        self.nic_guid = str(uuid.uuid4())
        self.nic_etag = new_etag()
        self.vnet_etag = new_etag()
        self.updating_until = 0.0
        self.ops = {}
        self.tokens = set()
        self.calls = {}
        self.total = 0
        self.throttle_every = 0
        self.throttle_seen = 0
        self.races = 0
        self.ipconfigs = [IpConfig("ipconfig1", self.allocate(set(), 1)[0], "Dynamic", True)]

    # Resource ids, as ARM spells them.
    @property
    def rg_id(self):
        return f"/subscriptions/{self.sub}/resourceGroups/{self.rg}"

    @property
    def vm_id(self):
        return f"{self.rg_id}/providers/Microsoft.Compute/virtualMachines/{self.vm}"

    @property
    def nic_id(self):
        return f"{self.rg_id}/providers/Microsoft.Network/networkInterfaces/{self.nic}"

    @property
    def vnet_id(self):
        return f"{self.rg_id}/providers/Microsoft.Network/virtualNetworks/{self.vnet_name}"

    @property
    def subnet_id(self):
        return f"{self.vnet_id}/subnets/{self.subnet_name}"

    def ops_prefix(self):
        return f"/subscriptions/{self.sub}/providers/Microsoft.Network/locations/{self.location}/operations/"

    def reserved(self):
        net = int(self.subnet.network_address)
        return {
            ipaddress.IPv4Address(net + i) for i in range(4)
        } | {self.subnet.broadcast_address}

    def allocate(self, used, n):
        """The n lowest free addresses of the subnet, or SubnetIsFull."""
        if n == 0:
            return []
        taken = used | self.reserved()
        out = []
        for a in self.subnet:
            if a not in taken:
                out.append(a)
                if len(out) == n:
                    return out
        raise arm_error(
            400,
            "SubnetIsFull",
            f"Subnet {self.subnet_name} with address prefix {self.subnet} does not have "
            f"enough capacity for {n} IP addresses.",
        )

    def provisioning(self):
        return "Updating" if time.monotonic() < self.updating_until else "Succeeded"

    # Bodies.
    def nic_body(self):
        state = self.provisioning()
        mac = "-".join(self.mac[i : i + 2] for i in range(0, 12, 2))
        return {
            "name": self.nic,
            "id": self.nic_id,
            "etag": self.nic_etag,
            "type": "Microsoft.Network/networkInterfaces",
            "location": self.location,
            "properties": {
                "provisioningState": state,
                "resourceGuid": self.nic_guid,
                "ipConfigurations": [
                    {
                        "name": c.name,
                        "id": f"{self.nic_id}/ipConfigurations/{c.name}",
                        "etag": self.nic_etag,
                        "type": "Microsoft.Network/networkInterfaces/ipConfigurations",
                        "properties": {
                            "provisioningState": state,
                            "privateIPAddress": str(c.address),
                            "privateIPAllocationMethod": c.method,
                            "subnet": {"id": self.subnet_id},
                            "primary": c.primary,
                            "privateIPAddressVersion": "IPv4",
                        },
                    }
                    for c in self.ipconfigs
                ],
                "dnsSettings": {"dnsServers": [], "appliedDnsServers": []},
                "macAddress": mac,
                "enableAcceleratedNetworking": False,
                "enableIPForwarding": False,
                "primary": True,
                "virtualMachine": {"id": self.vm_id},
                "hostedWorkloads": [],
                "tapConfigurations": [],
                "nicType": "Standard",
            },
        }

    def subnet_body(self):
        return {
            "name": self.subnet_name,
            "id": self.subnet_id,
            "etag": self.vnet_etag,
            "type": "Microsoft.Network/virtualNetworks/subnets",
            "properties": {
                "provisioningState": "Succeeded",
                "addressPrefix": str(self.subnet),
                "ipConfigurations": [
                    {"id": f"{self.nic_id}/ipConfigurations/{c.name}"} for c in self.ipconfigs
                ],
            },
        }

    def vnet_body(self):
        return {
            "name": self.vnet_name,
            "id": self.vnet_id,
            "etag": self.vnet_etag,
            "type": "Microsoft.Network/virtualNetworks",
            "location": self.location,
            "properties": {
                "provisioningState": "Succeeded",
                "addressSpace": {"addressPrefixes": [str(v) for v in self.vnets]},
                "subnets": [self.subnet_body()],
            },
        }

    def vm_body(self):
        return {
            "name": self.vm,
            "id": self.vm_id,
            "type": "Microsoft.Compute/virtualMachines",
            "location": self.location,
            "properties": {
                "vmId": self.vm_uuid,
                "hardwareProfile": {"vmSize": self.vm_size},
                "networkProfile": {
                    "networkInterfaces": [{"id": self.nic_id, "properties": {"primary": True}}]
                },
                "provisioningState": "Succeeded",
            },
        }

    def instance_body(self):
        return {
            "compute": {
                "azEnvironment": "AzurePublicCloud",
                "location": self.location,
                "name": self.vm,
                "osType": "Linux",
                "provider": "Microsoft.Compute",
                "resourceGroupName": self.rg,
                "resourceId": self.vm_id,
                "subscriptionId": self.sub,
                "tags": "",
                "vmId": self.vm_uuid,
                "vmScaleSetName": "",
                "vmSize": self.vm_size,
                "zone": "",
            },
            "network": {
                "interface": [
                    {
                        "ipv4": {
                            "ipAddress": [
                                {"privateIpAddress": str(c.address), "publicIpAddress": ""}
                                for c in self.ipconfigs
                            ],
                            "subnet": [
                                {
                                    "address": str(self.subnet.network_address),
                                    "prefix": str(self.subnet.prefixlen),
                                }
                            ],
                        },
                        "ipv6": {"ipAddress": []},
                        "macAddress": self.mac,
                    }
                ]
            },
        }

    # The NIC update (Network Interfaces - Create Or Update).
    def put_nic(self, body, if_match, host):
        if self.races > 0:
            self.races -= 1
            self.nic_etag = new_etag()
        if if_match is not None and if_match != "*" and if_match != self.nic_etag:
            raise arm_error(
                412,
                "PreconditionFailed",
                f"Precondition failed: etag {if_match} does not match the resource's {self.nic_etag}.",
            )
        if self.provisioning() != "Succeeded":
            raise arm_error(
                409,
                "AnotherOperationInProgress",
                f"Another operation on this or dependent resource is in progress. Resource {self.nic_id}.",
                {"Retry-After": str(self.retry_after)},
            )
        if not isinstance(body, dict):
            raise arm_error(400, "InvalidRequestFormat", "The request body is not a JSON object.")
        loc = body.get("location")
        if loc is not None and str(loc).replace(" ", "").lower() != self.location.lower():
            raise arm_error(400, "LocationNotAvailableForResourceType", f"location {loc!r}")
        configs = (body.get("properties") or {}).get("ipConfigurations")
        if not isinstance(configs, list) or not configs:
            raise arm_error(
                400,
                "NetworkInterfaceMustHaveAtLeastOneIpConfiguration",
                f"Network interface {self.nic_id} must have at least one IP configuration.",
            )
        if len(configs) > self.max_ipconfigs:
            raise arm_error(
                400,
                "NetworkInterfaceIpConfigurationCountExceedsLimit",
                f"Network interface {self.nic_id} has {len(configs)} IP configurations, "
                f"more than the limit of {self.max_ipconfigs}.",
            )
        old = {c.name.lower(): c for c in self.ipconfigs}
        names = set()
        keep = []  # (name, IpConfig or None for a new dynamic one, method, primary)
        for c in configs:
            if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
                raise arm_error(400, "InvalidRequestFormat", "An IP configuration needs a name.")
            name = c["name"]
            if name.lower() in names:
                raise arm_error(
                    400, "DuplicateResourceName", f"IP configuration name {name} is used twice."
                )
            names.add(name.lower())
            props = c.get("properties") or {}
            subnet = ((props.get("subnet") or {}).get("id") or "").lower()
            if subnet != self.subnet_id.lower():
                raise arm_error(
                    400,
                    "InvalidResourceReference",
                    f"Resource {subnet or '(none)'} referenced by {self.nic_id}/ipConfigurations/{name} "
                    "was not found.",
                )
            if props.get("privateIPAddressVersion", "IPv4") != "IPv4":
                raise arm_error(400, "InvalidRequestFormat", "only IPv4 in this fake")
            method = props.get("privateIPAllocationMethod", "Dynamic")
            if method not in ("Dynamic", "Static"):
                raise arm_error(
                    400, "InvalidRequestFormat", f"privateIPAllocationMethod {method!r}"
                )
            primary = bool(props.get("primary", False))
            want = props.get("privateIPAddress")
            prev = old.get(name.lower())
            if method == "Static":
                if not want:
                    raise arm_error(
                        400,
                        "PrivateIPAddressIsRequired",
                        f"A Static IP configuration {name} needs privateIPAddress.",
                    )
                addr = ipaddress.IPv4Address(want)
                if addr not in self.subnet or addr in self.reserved():
                    raise arm_error(
                        400,
                        "PrivateIPAddressInReservedRange",
                        f"Private static IP address {addr} falls within reserved IP range of "
                        f"subnet prefix {self.subnet}.",
                    )
                keep.append((name, addr, method, primary))
            elif prev is not None:
                keep.append((name, prev.address, method, primary))
            else:
                keep.append((name, None, method, primary))
        primaries = [k for k in keep if k[3]]
        if len(keep) > 1 and len(primaries) != 1:
            raise arm_error(
                400,
                "NetworkInterfaceMustHaveOnePrimaryIpConfiguration",
                f"Network interface {self.nic_id} must have exactly one primary IP configuration.",
            )
        used = [k[1] for k in keep if k[1] is not None]
        if len(used) != len(set(used)):
            raise arm_error(400, "PrivateIPAddressIsAllocated", "An address is used twice.")
        fresh = iter(self.allocate(set(used), sum(1 for k in keep if k[1] is None)))
        self.ipconfigs = [
            IpConfig(name, addr if addr is not None else next(fresh), method, primary or len(keep) == 1)
            for (name, addr, method, primary) in keep
        ]
        self.nic_etag = new_etag()
        self.updating_until = time.monotonic() + self.lro_seconds
        op = str(uuid.uuid4())
        self.ops[op] = self.updating_until
        headers = {
            "Azure-AsyncOperation": f"http://{host}{self.ops_prefix()}{op}?api-version={NETWORK_API}",
            "Retry-After": str(self.retry_after),
        }
        return 200, self.nic_body(), headers

    def operation(self, op):
        until = self.ops.get(op)
        if until is None:
            raise arm_error(404, "NotFound", f"Operation {op} not found.")
        if time.monotonic() < until:
            return {"status": "InProgress"}, {"Retry-After": str(self.retry_after)}
        return {"status": "Succeeded"}, {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    cloud = None  # set in main

    def log_message(self, fmt, *args):
        sys.stderr.write("azure_fake: " + (fmt % args) + "\n")

    def send(self, status, body, headers=None):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise arm_error(400, "InvalidRequestContent", "The request content is not valid JSON.")

    def do_GET(self):
        self.handle_any("GET")

    def do_PUT(self):
        self.handle_any("PUT")

    def do_POST(self):
        self.handle_any("POST")

    def do_DELETE(self):
        self.handle_any("DELETE")

    def do_PATCH(self):
        self.handle_any("PATCH")

    def handle_any(self, method):
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            body = self.body()
            if url.path.startswith("/_rcni/"):
                status, out, headers = self.hook(method, url.path, body)
            else:
                status, out, headers = self.api(method, url.path, query, body)
        except ApiError as e:
            status, out, headers = e.status, e.body, e.headers
        self.send(status, out, headers)

    def hook(self, method, path, body):
        c = self.cloud
        with c.lock:
            if method == "POST" and path == "/_rcni/throttle":
                c.throttle_every = int((body or {}).get("every", 0))
                c.throttle_seen = 0
                return 200, {"every": c.throttle_every}, {}
            if method == "POST" and path == "/_rcni/race":
                c.races = int((body or {}).get("puts", 1))
                return 200, {"puts": c.races}, {}
            if method == "GET" and path == "/_rcni/calls":
                return 200, {"total": c.total, "by": dict(c.calls)}, {}
            if method == "GET" and path == "/_rcni/state":
                return 200, {x.name: str(x.address) for x in c.ipconfigs}, {}
        raise ApiError(404, {"error": f"no hook {method} {path}"})

    def api(self, method, path, query, body):
        c = self.cloud
        lower = path.rstrip("/").lower()
        with c.lock:
            key = f"{method} {self.route(lower)}"
            c.calls[key] = c.calls.get(key, 0) + 1
            c.total += 1
            if c.throttle_every > 0:
                c.throttle_seen += 1
                if c.throttle_seen % c.throttle_every == 0:
                    raise arm_error(
                        429,
                        "TooManyRequests",
                        "The request is being throttled.",
                        {"Retry-After": "1"},
                    )
            if lower.startswith("/metadata/"):
                return self.imds(method, lower, query)
            return self.arm(method, lower, query, body)

    def route(self, lower):
        c = self.cloud
        if lower.startswith("/metadata/"):
            return lower
        for name, rid in (
            ("virtualMachines/{vm}", c.vm_id),
            ("networkInterfaces/{nic}", c.nic_id),
            ("subnets/{subnet}", c.subnet_id),
            ("virtualNetworks/{vnet}", c.vnet_id),
        ):
            if lower == rid.lower():
                return name
        if lower.startswith(c.ops_prefix().lower()):
            return "operations/{op}"
        return lower

    def imds(self, method, lower, query):
        c = self.cloud
        if self.headers.get("Metadata", "").lower() != "true" or "X-Forwarded-For" in self.headers:
            raise ApiError(400, {"error": "Bad request. Required metadata header not specified"})
        if method != "GET":
            raise ApiError(405, {"error": "Method not allowed"})
        if "api-version" not in query:
            raise ApiError(
                400,
                {"error": "Bad request. api-version was not specified in the request."},
            )
        if lower == "/metadata/instance":
            return 200, c.instance_body(), {}
        if lower == "/metadata/identity/oauth2/token":
            if "resource" not in query:
                raise ApiError(
                    400,
                    {
                        "error": "invalid_request",
                        "error_description": "Required query variable 'resource' is missing",
                    },
                )
            token = "fake-" + uuid.uuid4().hex
            c.tokens.add(token)
            now = int(time.time())
            return (
                200,
                {
                    "access_token": token,
                    "client_id": query.get("client_id", str(uuid.uuid5(uuid.NAMESPACE_URL, c.vm_id))),
                    "expires_in": "86399",
                    "expires_on": str(now + 86399),
                    "ext_expires_in": "86399",
                    "not_before": str(now),
                    "resource": query["resource"],
                    "token_type": "Bearer",
                },
                {},
            )
        raise ApiError(404, {"error": "Not found"})

    def arm(self, method, lower, query, body):
        c = self.cloud
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            raise arm_error(
                401,
                "AuthenticationFailed",
                "Authentication failed. The 'Authorization' header is missing.",
            )
        if auth[len("Bearer ") :] not in c.tokens:
            raise arm_error(
                401,
                "InvalidAuthenticationToken",
                "The access token is invalid.",
            )
        if "api-version" not in query:
            raise arm_error(
                400,
                "MissingApiVersionParameter",
                "The api-version query parameter (?api-version=) is required for all requests.",
            )
        route = self.route(lower)
        if route == "networkInterfaces/{nic}":
            if method == "GET":
                return 200, c.nic_body(), {"ETag": c.nic_etag}
            if method == "PUT":
                return c.put_nic(body, self.headers.get("If-Match"), self.headers.get("Host"))
        elif route in ("virtualMachines/{vm}", "virtualNetworks/{vnet}", "subnets/{subnet}"):
            if method == "GET":
                return (
                    200,
                    {
                        "virtualMachines/{vm}": c.vm_body,
                        "virtualNetworks/{vnet}": c.vnet_body,
                        "subnets/{subnet}": c.subnet_body,
                    }[route](),
                    {},
                )
        elif route == "operations/{op}":
            if method == "GET":
                out, headers = c.operation(lower[len(c.ops_prefix()) :])
                return 200, out, headers
        else:
            raise arm_error(
                404,
                "ResourceNotFound",
                f"The Resource '{self.path.split('?')[0]}' was not found.",
            )
        raise arm_error(405, "MethodNotAllowed", f"{method} is not allowed on this fake's {route}.")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT")
    p.add_argument("--vm", required=True, help="the VM's name")
    p.add_argument("--mac", required=True, help="the NIC's MAC, any separators")
    p.add_argument("--subnet", required=True, help="the NIC's subnet, e.g. 10.1.0.0/24")
    p.add_argument("--vnet", required=True, action="append", help="the VNet's prefixes")
    p.add_argument("--max-ipconfigs", type=int, default=256)
    p.add_argument("--nic", help="the NIC's name (default <vm>-nic)")
    p.add_argument("--subscription", default="00000000-0000-0000-0000-000000000000")
    p.add_argument("--resource-group", default="rcni")
    p.add_argument("--location", default="westeurope")
    p.add_argument("--vm-size", default="Standard_D4s_v5")
    p.add_argument("--vnet-name", default="rcni-vnet")
    p.add_argument("--subnet-name", default="nodes")
    p.add_argument("--lro-seconds", type=float, default=0.2, help="how long a NIC update runs")
    p.add_argument("--retry-after", type=int, default=1, help="Retry-After on long-running operations")
    args = p.parse_args()
    Handler.cloud = Cloud(args)
    host, _, port = args.listen.rpartition(":")
    server = ThreadingHTTPServer((host, int(port)), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
