"""The ports launch-silo writes in the address file: free, distinct, and outside the kernel's
ephemeral range, so no outgoing connection on the machine can take one before its rank binds it
(an outsider's hundreds of connections once took a silo's port: "in use")."""

import socket

from fedml_perfedavg.fedml_bridge.cross_silo.addresses import ephemeral_range, free_ports, read_ipconfig, write_ipconfig


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


def test_a_port_in_use_is_not_chosen_and_a_full_range_falls_back_to_the_kernels_choice():
    window = (10010, 65535)  # leaves ten ports outside: 10000-10009
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 10003))
        for _ in range(30):
            (port,) = free_ports(1, ephemeral=window)
            assert 10000 <= port <= 10009 and port != 10003
        assert free_ports(2, ephemeral=(1024, 65535))[0] != 10003  # nothing outside: the kernel's choice
    assert ephemeral_range("/nonexistent") is None
