"""Helpers shared by the tests (fixtures live in conftest.py)."""

import os
import subprocess
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
MNIST_ROOT = os.environ.get("PERFEDAVG_MNIST_ROOT", str(REPO.parent / "shared" / "datasets"))
HF_YAML = str(REPO / "yaml_configs" / "mnist_tau10_alpha0.01_hf.yaml")
SILO_YAML = str(REPO / "yaml_configs" / "mnist_tau10_alpha0.01_hf_silo.yaml")
EXAMPLE = REPO / "examples" / "fedml_step_by_step"


def mnist_available() -> bool:
    return (Path(MNIST_ROOT) / "MNIST" / "raw" / "train-images-idx3-ubyte").exists()


needs_mnist = pytest.mark.skipif(not mnist_available(), reason=f"real MNIST not found under {MNIST_ROOT}")


def unshare_works() -> bool:
    """Whether this machine lets a test run a command in a network namespace with only loopback."""
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def offline(command):
    """``command`` inside a network namespace with only loopback up, where possible."""
    if unshare_works():
        return ["unshare", "-n", "sh", "-c", 'ip link set lo up 2>/dev/null; exec "$@"', "sh", *command]
    return list(command)


# Run inside the child: records every socket attempt that leaves loopback.
NETWORK_GUARD = r"""
import ipaddress, runpy, socket, sys
attempts = []
def hook(event, args):
    if event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
        address = args[1] if len(args) > 1 else None
        host = address[0] if isinstance(address, tuple) else None
        try:
            loopback = host is not None and ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback and not isinstance(address, (str, bytes)):
            attempts.append((event, address))
    elif event == "socket.getaddrinfo" and args[0] not in ("localhost", "127.0.0.1", "::1", None):
        attempts.append((event, args[0]))
sys.addaudithook(hook)
code = 0
if sys.argv[1] == "--script":
    script = sys.argv[2]
    sys.argv = sys.argv[2:]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code or 0
else:
    from fedml_perfedavg.run.cli import main
    code = main(sys.argv[1:])
sys.__stdout__.write(f"NETWORK_ATTEMPTS {attempts}\n"); sys.__stdout__.flush()  # FedML rewrites sys.stdout.write
sys.exit(code or (3 if attempts else 0))
"""


EXAMPLE_SETTINGS = {"comm_round": 3, "client_num_per_round": 2, "frequency_of_the_test": 1}


def example_yaml(tmp_path, name: str, mnist_root: str, run_name: str, output_dir, **edits) -> str:
    """One of examples/fedml_step_by_step/'s FedML YAMLs, short (3 rounds of 2 clients), with
    ``edits`` (key -> value, put in the section that already has the key, else the key's own)."""
    import yaml

    config = yaml.safe_load((EXAMPLE / name).read_text())
    config["data_args"]["data_cache_dir"] = mnist_root
    config["common_args"]["output_dir"] = str(output_dir)
    config["common_args"]["run_name"] = run_name
    if config["common_args"].get("training_type") == "cross_silo" and "tls_dir" not in edits:
        edits["tls_dir"] = make_tls(tmp_path / "tls", 2)
    from fedml_perfedavg.run.schema import BY_NAME

    for key, value in {**EXAMPLE_SETTINGS, **edits}.items():
        home = BY_NAME[key].metadata["section"] if key in BY_NAME else "train_args"
        section = next((s for s, keys in config.items() if key in keys), home)
        config.setdefault(section, {})[key] = value
    path = tmp_path / f"{run_name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def make_tls(out_dir, clients: int) -> str:
    """A run CA and certificates for ranks 0..clients, as ``fedml-perfedavg certs`` makes them."""
    from fedml_perfedavg.net.credentials import make_certificates

    if not (Path(out_dir) / "ca.pem").exists():
        make_certificates(str(out_dir), clients)
    return str(out_dir)


def processes_naming(text: str) -> list:
    """The ids of the running processes (this one's children included) whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def launched_alive(run_dir) -> list:
    """The ranks launch-silo started (its silo_processes.json) that still run."""
    import json

    listing = Path(run_dir) / "silo_processes.json"
    if not listing.exists():  # a launch that measured nothing removes its directory: the command lines say
        return sorted(processes_naming(str(run_dir)))
    alive = []
    for rank, pid in json.loads(listing.read_text()).items():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(int(rank))
    return alive


def raw_send(address, data: bytes, tls_dir=None, as_rank=None, ca_dir=None, to_rank=0, timeout: float = 5.0):
    """Bytes sent straight to a cross-silo port (``address`` = (ip, port)), as an attacker would:
    plaintext (no ``ca_dir``), TLS without a client certificate (``ca_dir`` only), or TLS with
    ``as_rank``'s certificate from ``tls_dir``. Returns "delivered" or gRPC's status code."""
    import grpc
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2 as pb2
    from fedml.core.distributed.communication.grpc import grpc_comm_manager_pb2_grpc as pb2_grpc

    from fedml_perfedavg.net.credentials import rank_name

    target = "%s:%d" % tuple(address)
    if ca_dir is None:
        channel = grpc.insecure_channel(target)
    else:
        read = lambda folder, name: (Path(folder) / name).read_bytes()  # noqa: E731
        key = read(tls_dir, f"rank-{as_rank}.key") if as_rank is not None else None
        cert = read(tls_dir, f"rank-{as_rank}.pem") if as_rank is not None else None
        channel = grpc.secure_channel(
            target,
            grpc.ssl_channel_credentials(read(ca_dir, "ca.pem"), key, cert),
            options=[("grpc.ssl_target_name_override", rank_name(to_rank))],
        )
    try:
        pb2_grpc.gRPCCommManagerStub(channel).sendMessage(pb2.CommRequest(client_id=1, message=data), timeout=timeout)
        return "delivered"
    except grpc.RpcError as err:
        return err.code()
    finally:
        channel.close()


def lost_round_cost(summary: dict):
    """Cross-silo: (the lost silo's record, the deadline it was given, what its round took) from
    a summary.json with one lost silo."""
    import re

    [lost] = summary["lost_silos"]
    waited = float(re.search(r"(?:within|for) (\d+\.\d) s \(the round deadline", lost["why"]).group(1))
    wall = {e["round"]: e["wall_seconds"] for e in summary["history"]}
    return lost, waited, wall[lost["round"]] - wall[lost["round"] - 1]


def failure_tail(out: str, lines: int = 25) -> str:
    """What a failed launch's output says of each of its processes, for an assertion's message: the
    last ``lines`` lines of the server (``[server]``), of each silo (``[silo R]``) and of the
    launcher itself (which names every process's exit code), each under its own heading, without
    asyncio's "Task was destroyed but it is pending" pairs (a process stopped while the outsider
    held hundreds of connections prints one per connection). The whole output's tail alone once
    showed only the silos' retries, never why the server had ended."""
    noise = ("Task was destroyed but it is pending", "task: <Task pending")
    by_process: dict = {}
    for line in out.splitlines():
        if any(n in line for n in noise):
            continue
        prefix = line.split("] ", 1)[0] + "]" if line.startswith("[") and "] " in line else "[launcher]"
        by_process.setdefault(prefix, []).append(line)
    order = sorted(by_process, key=lambda name: (name != "[server]", name == "[launcher]", name))
    return "\n".join(
        f"--- {name}, its last {min(lines, len(by_process[name]))} of {len(by_process[name])} lines:\n"
        + "\n".join(by_process[name][-lines:])
        for name in order
    )


def drained(process) -> "Callable[[], str]":
    """Read ``process``'s output (stdout=PIPE, text) from now on in a thread, so that it never
    blocks on a full pipe while the test does something else; returns what was read so far, and
    all of it once the process has ended (``process.wait()`` first)."""
    import threading

    chunks: list = []

    def pump() -> None:
        for line in process.stdout:
            chunks.append(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()

    def text() -> str:
        if process.poll() is not None:
            thread.join(timeout=30)
        return "".join(chunks)

    return text


def launch_silo(run_dir, settings: dict, extra=(), loopback_only: bool = False, open_files=None):
    """``fedml-perfedavg launch-silo`` with 2 silos on the silo YAML and ``settings`` (key ->
    value, as --set), started as a subprocess (stdout and stderr together). With
    ``loopback_only``, inside a network namespace with only loopback when the machine allows it;
    with ``open_files``, every process's open-file limit (soft and hard) is that."""
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "fedml_perfedavg",
        "launch-silo",
        "--cf",
        SILO_YAML,
        "--clients",
        "2",
        "--run-dir",
        str(run_dir),
        *[a for k, v in settings.items() for a in ("--set", f"{k}={v}")],
        *extra,
    ]
    if loopback_only and unshare_works():  # only loopback exists in there, so nothing can leave the machine
        command = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
    if open_files is not None:
        command = ["prlimit", f"--nofile={open_files}:{open_files}", *command]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(Path(run_dir).parent / "home")}
    # its own process group, as a command typed in a terminal is: a test can Ctrl-C it (killpg) alone
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


LIAR = REPO / "tests" / "backends" / "lying_silo.py"


def rank_command(entry, yaml, run_dir, sets: dict, rank: int, run_id: str) -> list:
    """The command line of one rank of a cross-silo run started by hand (``--rank R --role``):
    ``entry`` (``[python, "-m", "fedml_perfedavg"]`` or a script), the YAML, ``sets`` as --set."""
    return [
        *entry,
        "--cf",
        str(yaml),
        "--run-dir",
        str(run_dir),
        *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
        "--rank",
        str(rank),
        "--role",
        "server" if rank == 0 else "client",
        "--run_id",
        run_id,
    ]


def start_by_hand(tmp_path, settings: dict, ranks: int, per_rank=None, liars=None, yaml=None, run_id="by-hand"):
    """A cross-silo run started as a user starts one on each host (``--rank R --role``), on
    loopback with mutual TLS: ``settings`` for every process (key -> value, as --set),
    ``per_rank`` {rank: {key: value}} for some, ``liars`` {rank: what it lies about} (run through
    tests/backends/lying_silo.py instead of the plain command line). Returns {rank: Popen}."""
    import sys

    ipconfig = tmp_path / "ip.csv"
    if not ipconfig.exists():
        from fedml_perfedavg.net.addresses import write_ipconfig

        write_ipconfig(str(ipconfig), ranks + 1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    processes = {}
    for rank in range(ranks + 1):
        sets = {
            **settings,
            "grpc_ipconfig_path": str(ipconfig),
            "tls_dir": make_tls(tmp_path / "tls", ranks),
            **(per_rank or {}).get(rank, {}),
        }
        entry = [str(LIAR), (liars or {})[rank]] if rank in (liars or {}) else ["-m", "fedml_perfedavg"]
        command = rank_command([sys.executable, *entry], yaml or SILO_YAML, tmp_path / "run", sets, rank, run_id)
        processes[rank] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
    return processes


def finish_all(processes, timeout=240):
    """Each process's output once it ends; all killed after ``timeout``, failing with the end of
    every process's output (what a hung one last said is what explains it)."""
    import subprocess

    outs = {}
    try:
        for rank, process in processes.items():
            outs[rank] = process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        for process in processes.values():
            process.kill()
        hung = [rank for rank in processes if rank not in outs]
        tails = {rank: (outs.get(rank) or processes[rank].communicate()[0] or "")[-3000:] for rank in processes}
        raise AssertionError(f"rank {hung[0]} still ran after {timeout} s; each rank's output ends:\n{tails}") from None
    finally:
        for process in processes.values():
            process.kill()
    return outs


def wait_for_text(path, text: str, alive, seconds: float = 120):
    """Until ``path`` holds ``text``; fails if ``alive()`` turns false or ``seconds`` pass."""
    import time

    deadline = time.monotonic() + seconds
    while not (Path(path).exists() and text in Path(path).read_text()):
        assert alive() and time.monotonic() < deadline, f"never saw {text!r} in {path}"
        time.sleep(0.05)


def reencode(data: bytes, edit) -> bytes:
    """A wire message with its JSON header changed by ``edit`` (the tensors kept), as an attacker
    who holds a valid message would change it."""
    import json
    import struct

    from fedml_perfedavg.net import wire

    (length,) = struct.unpack_from(">I", data, len(wire.MAGIC))
    start = len(wire.MAGIC) + 4
    header = json.loads(data[start : start + length])
    edit(header)
    raw = json.dumps(header).encode()
    return wire.MAGIC + struct.pack(">I", len(raw)) + raw + data[start + length :]


def certificate_from(ca_dir, out, usages, rank: int = 1) -> bytes:
    """Rank ``rank``'s certificate (and key) in ``out`` with the extended key usages ``usages``
    (None: no extension), signed by the CA in ``ca_dir``; returns the certificate's PEM."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_dir, out = Path(ca_dir), Path(out)
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"r{rank}")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(f"rank-{rank}.fedml-perfedavg")]), critical=False)
    )
    if usages is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / f"rank-{rank}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def launched_threads(clients: int) -> int:
    """The torch threads of each process that launch-silo starts for ``clients`` silos here."""
    from fedml_perfedavg.run.launch_silo import threads_per_process

    return int(os.environ.get("OMP_NUM_THREADS") or threads_per_process(clients + 1))


def single_process_at(threads: int, config, run_dir):
    """sp's run of ``config`` with ``threads`` torch threads, those of the processes it is compared
    with: MKL splits a small matrix product's sum over its threads (docs/backends.md), so only the
    same count promises the same bits."""
    import torch

    from fedml_perfedavg.run.runner import run

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run(config, str(run_dir))
    finally:
        torch.set_num_threads(before)


def assert_same_bits(model: dict, reference: dict) -> None:
    """Every tensor of ``reference`` equal to ``model``'s, bit for bit (the worst gap named)."""
    import torch

    assert model.keys() >= reference.keys(), sorted(reference.keys() - model.keys())
    gaps = {k: float((model[k] - v).abs().max()) for k, v in reference.items() if not torch.equal(model[k], v)}
    assert not gaps, gaps


def silo_draw_secrets(run_dir, silos: int) -> dict:
    """Each data owner's silo's run secret (kept in its progress.pt), by user: the key beside
    (seed, round, user) of the minibatches it drew under secure aggregation or DP-SGD."""
    import torch

    secrets = {}
    for rank in range(1, silos + 1):
        saved = torch.load(Path(run_dir) / f"silo-rank-{rank}" / "progress.pt", weights_only=True)
        secrets[rank - 1] = bytes.fromhex(saved["run_secret"])
    return secrets


class drawing_with:
    """Within it, every algorithm built in this process draws each user's minibatches with that
    user's secret of ``secrets`` (:func:`silo_draw_secrets`), as the silos did: an sp run then
    trains on the same batches as the secure run it is compared with."""

    def __init__(self, secrets: dict) -> None:
        self.secrets = dict(secrets)

    def __enter__(self) -> None:
        import dataclasses

        from fedml_perfedavg.algorithms.base import AlgorithmSettings

        self.original = AlgorithmSettings.__dict__["from_config"]
        original, secrets = self.original.__func__, self.secrets

        def keyed(cls, config, own_settings=None):
            return dataclasses.replace(original(cls, config, own_settings), draw_secrets=secrets)

        AlgorithmSettings.from_config = classmethod(keyed)

    def __exit__(self, *exc) -> None:
        from fedml_perfedavg.algorithms.base import AlgorithmSettings

        AlgorithmSettings.from_config = self.original


def transport_args(**values):
    """FedML's args of a cross-silo process as the plugin's ``fedml.init`` leaves them: ``values``,
    and the transport's comm_args values checked from them by the run's rules."""
    from argparse import Namespace

    from fedml_perfedavg.fedml_bridge.bootstrap import TRANSPORT_VALUES
    from fedml_perfedavg.run.fedml_args import transport_values

    args = Namespace(**values)
    setattr(args, TRANSPORT_VALUES, transport_values(args))
    return args
