"""Which interface process groups bind (nemo_grpo/distributed/interfaces.py): the pure parts, on hand-made
interface tables, environments and connection lists (no Ray, no process group)."""

import os
from collections import namedtuple

import pytest

from nemo_grpo.distributed.interfaces import (bound_interface, group_address, ifname_settings, interface_holding,
                                              remote_ipv4_peers)

# a Slurm node: loopback, the cluster network, a docker bridge, an IPv6 link-local address with its scope
NODE = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.3.17", "fe80::1%eth0"], "docker0": ["172.17.0.1"],
        "ib0": ["192.168.8.17"]}


@pytest.mark.parametrize("address, interface", [
    ("10.0.3.17", "eth0"), ("192.168.8.17", "ib0"), ("127.0.0.1", "lo"), ("::1", "lo"), ("fe80::1", "eth0"),
    ("127.0.1.1", "lo"),  # a loopback address no interface lists (Debian's hostname entry): lo answers it
    ("10.0.3.18", None),  # another node's address
    ("node17", None),  # not an address
])
def test_the_interface_holding_the_address(address, interface):
    assert interface_holding(address, NODE) == interface


def test_several_interfaces_holding_the_address_first_by_name():
    assert interface_holding("10.0.0.5", {"vlan9": ["10.0.0.5"], "bond0": ["10.0.0.5"]}) == "bond0"
    assert interface_holding("127.0.0.1", {}) is None


def test_a_group_on_loopback_stays_there_others_bind_the_nodes_address():
    # WorkerGroup: MASTER_ADDR 127.0.0.1 on a one-node Ray cluster (whose node address is the machine's IP)
    assert group_address("127.0.0.1", "10.0.3.17") == "127.0.0.1"
    assert group_address("10.0.3.9", "10.0.3.17") == "10.0.3.17"  # rank 0's node is another one
    assert group_address("head-node", "10.0.3.17") == "10.0.3.17"
    assert group_address(None, "10.0.3.17") == "10.0.3.17" and group_address("10.0.3.9", None) is None


def test_gloo_sets_its_variable_only():
    assert ifname_settings("gloo", "eth0", {}) == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_nccl_sets_its_exact_name_and_gloos_for_the_gloo_groups_beside_it():
    assert ifname_settings("nccl", "eth0", {}) == {"NCCL_SOCKET_IFNAME": "=eth0", "GLOO_SOCKET_IFNAME": "eth0"}


def test_a_variable_the_user_set_wins():
    assert ifname_settings("gloo", "eth0", {"GLOO_SOCKET_IFNAME": "ib0"}) == {}
    assert ifname_settings("nccl", "eth0", {"NCCL_SOCKET_IFNAME": "^docker"}) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert ifname_settings("gloo", "eth0", {"GLOO_SOCKET_IFNAME": ""}) == {"GLOO_SOCKET_IFNAME": "eth0"}  # empty
    assert ifname_settings("fake", "eth0", {}) == {}  # a backend that binds nothing


def test_what_the_backends_variable_says_it_binds():
    env = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=ib0"}
    assert bound_interface("gloo", env) == "eth0"
    assert bound_interface("nccl", env) == "ib0"
    assert bound_interface("nccl", {"NCCL_SOCKET_IFNAME": "^docker,lo"}) == "^docker,lo"  # the user's, as is
    assert bound_interface("gloo", {}) is None and bound_interface("fake", env) is None


Conn = namedtuple("Conn", "status raddr")


def test_peers_are_the_remote_ipv4_addresses_of_established_connections():
    connections = [Conn("ESTABLISHED", ("10.0.3.18", 41000)), Conn("ESTABLISHED", ("10.0.3.18", 41001)),
                   Conn("ESTABLISHED", ("10.0.3.9", 6379)), Conn("LISTEN", ()), Conn("TIME_WAIT", ("10.0.3.20", 1)),
                   Conn("ESTABLISHED", ("::ffff:10.0.3.19", 2)), Conn("ESTABLISHED", ("fe80::2", 3))]
    assert remote_ipv4_peers(connections) == ["10.0.3.9", "10.0.3.18", "10.0.3.19"]  # numeric order, each once
    assert remote_ipv4_peers([]) == []


def test_bind_interface_sets_this_process_variables_and_keeps_the_users(monkeypatch):
    """In this process (no Ray: the address is MASTER_ADDR's), on this machine's own interfaces."""
    from nemo_grpo.distributed import interfaces

    monkeypatch.setattr(interfaces, "_SET_HERE", {})
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(var, "")  # empty: unset (and restored, as it was, after the test)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    loopback = interface_holding("127.0.0.1", interfaces.interface_addresses())  # "lo" on Linux
    assert loopback is not None
    assert interfaces.bind_interface("nccl") == loopback
    assert (os.environ["NCCL_SOCKET_IFNAME"], os.environ["GLOO_SOCKET_IFNAME"]) == ("=" + loopback, loopback)
    # a spare worker's next rank: what bind_interface set is decided again, what the user set wins
    monkeypatch.setattr(interfaces, "_SET_HERE", {"GLOO_SOCKET_IFNAME": "eth7"})
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert interfaces.bind_interface("gloo") == loopback
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert interfaces.bind_interface("gloo") == "eth7" and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
