"""The ports launch-silo writes in the address file: free, distinct, and outside the kernel's
ephemeral range, so no outgoing connection on the machine can take one before its rank binds it
(an outsider's hundreds of connections once took a silo's port: "in use")."""

import os
import random
import socket

import pytest

from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.net.addresses import (
    PORTS_VARIABLE,
    _bindable,
    allowed_ports,
    ephemeral_range,
    free_ports,
    read_ipconfig,
    write_ipconfig,
)


def test_chosen_ports_are_free_distinct_and_outside_the_ephemeral_range(tmp_path):
    ephemeral = ephemeral_range()
    assert ephemeral is not None and ephemeral[0] <= ephemeral[1]  # Linux: the file is there
    for _ in range(20):
        ports = free_ports(5)
        assert len(set(ports)) == 5
        assert not any(ephemeral[0] <= p <= ephemeral[1] for p in ports), (ports, ephemeral)
        for port in ports:  # free now: each can be bound
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    path = write_ipconfig(str(tmp_path / "grpc_ipconfig.csv"), 3)
    assert all(not ephemeral[0] <= port <= ephemeral[1] for _, port in read_ipconfig(path, 3).values())


def test_a_port_in_use_is_not_chosen_and_a_full_range_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.delenv(PORTS_VARIABLE, raising=False)  # the ephemeral window alone decides here
    window = (10010, 65535)  # leaves ten ports outside: 10000-10009
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 10003))
        for _ in range(30):
            (port,) = free_ports(1, ephemeral=window)
            assert 10000 <= port <= 10009 and port != 10003
        assert free_ports(2, ephemeral=(1024, 65535))[0] != 10003  # nothing outside: the kernel's choice
    assert ephemeral_range("/nonexistent") is None


def _taken_port_with_three_free_after_it() -> "tuple[socket.socket, int]":
    """A bound socket on a port p whose next three ports are free, p from this test worker's own
    range (or one below the kernel's ephemeral range): no outgoing connection of the machine can
    take p + 1 .. p + 3 meanwhile (a port next to a kernel-chosen one once was, in a full suite)."""
    low, high = allowed_ports(os.environ.get(PORTS_VARIABLE)) or (20000, 29999)
    for port in random.sample(range(low, high - 2), min(200, high - 2 - low)):
        taken = socket.socket()
        try:
            taken.bind(("127.0.0.1", port))
        except OSError:
            taken.close()
            continue
        if _bindable(list(range(port + 1, port + 4)), 3, "127.0.0.1") is not None:
            return taken, port
        taken.close()
    raise AssertionError(f"no four free ports in {low}-{high}")


def test_the_ports_variable_keeps_every_choice_in_its_range(monkeypatch):
    """A firewall's open range, or a test worker's own: nothing outside it, a taken port never."""
    taken, port = _taken_port_with_three_free_after_it()
    with taken:
        monkeypatch.setenv(PORTS_VARIABLE, f"{port}-{port + 3}")
        for _ in range(10):
            ports = free_ports(3)
            assert len(set(ports)) == 3 and all(port < p <= port + 3 for p in ports), ports
        monkeypatch.setenv(PORTS_VARIABLE, f"{port}-{port}")
        with pytest.raises(ConfigError, match=rf"{PORTS_VARIABLE}='{port}-{port}': fewer than 1 free ports in it"):
            free_ports(1)


@pytest.mark.parametrize("value", ["20000", "30000-20000", "80-90", "a-b", "20000-70000"])
def test_a_malformed_ports_variable_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv(PORTS_VARIABLE, value)
    with pytest.raises(ConfigError, match=rf"{PORTS_VARIABLE}='{value}': must be LOW-HIGH"):
        free_ports(1)


def test_the_address_file_is_never_seen_half_written(tmp_path, monkeypatch):
    """A reader meanwhile sees the earlier file whole (or none), never the first rows alone: a
    silo's test once read a file with no row for rank 0 yet."""
    import csv

    from fedml_perfedavg.net import addresses

    path = str(tmp_path / "grpc_ipconfig.csv")
    write_ipconfig(path, 3, ports=[12001, 12002, 12003])
    seen, plain_writer = [], csv.writer

    class Watching:
        def __init__(self, stream):
            self.inner = plain_writer(stream)

        def writerow(self, row):
            self.inner.writerow(row)
            seen.append(read_ipconfig(path, 3))  # while the new file is being written

    monkeypatch.setattr(addresses.csv, "writer", Watching)
    write_ipconfig(path, 3, ports=[12011, 12012, 12013])
    assert len(seen) == 4 and all(s == {r: ("127.0.0.1", 12001 + r) for r in range(3)} for s in seen)
    monkeypatch.undo()
    assert read_ipconfig(path, 3) == {r: ("127.0.0.1", 12011 + r) for r in range(3)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grpc_ipconfig.csv"]  # no temporary file left
