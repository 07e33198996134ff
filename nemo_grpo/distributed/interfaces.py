"""Which network interface a worker's process groups bind: the one that holds this node's Ray address.

Unless told otherwise, gloo advertises to its peers the address this machine's hostname resolves to, and on many
clusters that is loopback (127.0.1.1 in /etc/hosts): ranks on other nodes then dial 127.0.0.1 and get
"Connection refused". NCCL picks its own interface (ib* first, then anything but docker* and lo), which need not
be one the other nodes reach. `bind_interface(backend)` therefore sets, for this process and before the process
group starts, GLOO_SOCKET_IFNAME (gloo; for NCCL too, since Megatron and the pipeline exchange make gloo groups
beside the NCCL ones) and NCCL_SOCKET_IFNAME (nccl) to the interface that holds the node's Ray address.

GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set in the worker's environment (by the user, e.g. exported before
`ray start`) always win: a variable that is set and not empty is never overridden. A group whose MASTER_ADDR is
loopback (WorkerGroup's on a one-node Ray cluster, whose node address Ray makes the machine's own IP all the same)
binds the loopback interface `lo`, as before. Where no interface holds the address, nothing is set (a debug line).

`process_group_report()` says what a worker bound and whom it talks to (the multi-node tests, the trainer's log).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Iterable, Mapping, Optional, Union

import psutil
import ray
import torch.distributed as dist

log = logging.getLogger(__name__)

# the variables each process-group backend reads, the backend's own first
IFNAME_VARIABLES = {"gloo": ("GLOO_SOCKET_IFNAME",), "nccl": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
NCCL_EXACT = "="  # NCCL_SOCKET_IFNAME is a list of name prefixes; "=eth0" matches eth0 only (not eth0.100)
_SET_HERE: dict[str, str] = {}  # the variables bind_interface set in this process, and their values


# ---------------------------------------------------------------------------------------------- pure
def _ip(text: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    """An address as psutil or Ray write it ("10.0.0.1", "fe80::1%eth0") -> ip_address; None if it is not one."""
    try:
        return ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None


def interface_holding(address: str, interfaces: Mapping[str, Iterable[str]]) -> Optional[str]:
    """The interface (of {name: [its addresses]}, e.g. psutil.net_if_addrs) that holds `address`, first by name
    where several do; a loopback address none holds (127.0.1.1) -> the loopback interface. None if none."""
    wanted = _ip(address)
    if wanted is None:
        return None
    held = {name: {ip for ip in map(_ip, addresses) if ip is not None} for name, addresses in interfaces.items()}
    for name in sorted(held):
        if wanted in held[name]:
            return name
    if wanted.is_loopback:
        for name in sorted(held):
            if any(ip.is_loopback and ip.version == wanted.version for ip in held[name]):
                return name
    return None


def group_address(master_addr: Optional[str], node_addr: Optional[str]) -> Optional[str]:
    """The address whose interface a process group binds: MASTER_ADDR when it is loopback (every rank on this
    machine: the group stays on loopback, like its store), else this node's address."""
    master = _ip(master_addr) if master_addr else None
    return master_addr if master is not None and master.is_loopback else node_addr


def ifname_settings(backend: str, interface: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set for `backend`'s process groups to bind `interface`: those unset (or empty) in
    `environ`; a set one wins. NCCL's names the interface exactly ("=eth0")."""
    values = {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": NCCL_EXACT + interface}
    return {var: values[var] for var in IFNAME_VARIABLES.get(backend, ()) if not environ.get(var)}


def bound_interface(backend: str, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """What `backend`'s own variable says its process groups bind (NCCL's exact-match "=" dropped); None if
    unset (the backend picks)."""
    variables = IFNAME_VARIABLES.get(backend)
    value = environ.get(variables[0]) if variables else None
    if value and backend == "nccl" and value.startswith(NCCL_EXACT):
        return value[len(NCCL_EXACT):]
    return value or None


def remote_ipv4_peers(connections: Iterable) -> list[str]:
    """Remote IPv4 addresses of the ESTABLISHED ones of psutil's TCP connections (IPv4-mapped IPv6 included),
    sorted, each once."""
    peers = set()
    for conn in connections:
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr:
            continue
        ip = _ip(conn.raddr[0])
        if ip is not None and ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip is not None and ip.version == 4:
            peers.add(ip)
    return [str(ip) for ip in sorted(peers)]


# ---------------------------------------------------------------------------------------------- this process
def interface_addresses() -> dict[str, list[str]]:
    """{interface name: its IPv4 and IPv6 addresses} of this machine."""
    families = (socket.AF_INET, socket.AF_INET6)
    return {name: [a.address for a in addrs if a.family in families] for name, addrs in psutil.net_if_addrs().items()}


def _route_source(host: str) -> Optional[str]:
    """The local address this machine reaches `host` from (a UDP connect sends nothing); None if unroutable."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError:
        return None


def node_address() -> Optional[str]:
    """This node's Ray address (in a Ray worker or driver); outside Ray (torchrun) the local address on the way
    to MASTER_ADDR; None if neither is known."""
    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    master = os.environ.get("MASTER_ADDR")
    return _route_source(master) if master else None


def bind_interface(backend: str, master_addr: Optional[str] = None) -> Optional[str]:
    """Before this process's `backend` process group starts: set its unset *_SOCKET_IFNAME variables
    (IFNAME_VARIABLES) to the interface holding this node's Ray address (loopback's where MASTER_ADDR is
    loopback: group_address). Variables already set win; those this function set for an earlier group of the
    process (a spare worker's previous rank, spare_workers.py) are decided again. Returns what the backend's
    variable says it binds (bound_interface), None where it picks itself. master_addr: the group's store
    address, where it is not $MASTER_ADDR (a weight-transfer group between a policy and an engine)."""
    variables = IFNAME_VARIABLES.get(backend, ())
    for var in variables:  # ours from an earlier rank: decided again, for this group's MASTER_ADDR
        if var in _SET_HERE and os.environ.get(var) == _SET_HERE.pop(var):
            del os.environ[var]
    if any(not os.environ.get(var) for var in variables):
        address = group_address(master_addr or os.environ.get("MASTER_ADDR"), node_address())
        interface = interface_holding(address, interface_addresses()) if address else None
        if interface is None:
            log.debug("no network interface holds this node's address %s: %s left unset", address,
                      ", ".join(variables))
        else:
            settings = ifname_settings(backend, interface, os.environ)
            os.environ.update(settings)
            _SET_HERE.update(settings)
            log.debug("process groups bind %s (holds %s): %s", interface, address, settings)
    return bound_interface(backend)


def process_group_report() -> dict:
    """Where this process's process groups are: {"hostname", "address": the node's Ray address, "interface":
    what the default group's backend binds (bound_interface; None: the backend picked), "peers": the remote
    IPv4 addresses of this process's established TCP connections (the gloo mesh's, Ray's own included)}."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    connections = psutil.Process().net_connections(kind="tcp")
    return {"hostname": socket.gethostname(), "address": node_address(), "interface": bound_interface(backend),
            "peers": remote_ipv4_peers(connections)}
