"""The tests' fork server (tests/zygote.py) gives a process what a fresh interpreter gets: the
same argv, working directory, environment, stdin, session, exit statuses and ending, compared on
one probe script started both ways."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests import zygote
from tests.helpers import NETWORK_GUARD, REPO

pytestmark = pytest.mark.backend


def _start(forked: bool, action: str, tmp_path, prefix=(), **kwargs):
    popen = zygote.ForkedPopen if forked else zygote.FreshPopen
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",  # the fork server's (tests/zygote.py)
        "PROBE_VARIABLE": "from the test",
        **kwargs.pop("env", {}),
    }
    process = popen(
        [*prefix, sys.executable, str(zygote.PROBE), action],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )
    assert getattr(process, "_forked", False) is forked, "the fork server did not take the probe"
    return process


def _both(action: str, tmp_path, **kwargs):
    """(fresh, forked): each process's (returncode, what it said of itself, the rest of stdout, stderr)."""
    results = []
    for forked in (False, True):
        process = _start(forked, action, tmp_path, **dict(kwargs))
        out, err = process.communicate(input="a line for stdin\n", timeout=60)
        first, _, rest = out.partition("\n")
        results.append((process.returncode, json.loads(first), rest, err))
    return results


def test_a_forked_process_sees_what_a_fresh_one_sees_and_ends_alike(tmp_path):
    fresh, forked = _both("exit:3", tmp_path, env={"PROBE_READS": "1"}, start_new_session=True)
    assert fresh[0] == forked[0] == 3
    assert fresh[1]["random"] != forked[1]["random"]
    for said in (fresh[1], forked[1]):
        said.pop("random")
        # The root namespace's interfaces are not the test's: other workers' tests add and remove
        # veth ends there (this file's namespace test, the silo hosts'), so two listings taken
        # moments apart may differ. The same namespace ("netns") is the check here; the test of a
        # namespace of its own below compares the interfaces it alone has.
        assert "lo" in said.pop("interfaces")
    assert (
        forked[1]
        == fresh[1]
        == {
            "argv": ["exit:3"],
            "cwd": str(tmp_path),
            "variable": "from the test",
            "leader": True,
            "read": "a line for stdin",
            "main": "__main__",
            "path0": str(REPO / "tests"),
            "netns": os.readlink("/proc/self/ns/net"),
            "cmdline": [sys.executable, str(zygote.PROBE), "exit:3"],  # what ps and /proc show
        }
    )
    # without a session of its own, a process stays in its parent's
    assert _both("exit:0", tmp_path)[1][1]["leader"] is False


def _network_namespace():
    """A new network namespace's name (only loopback, down), or None where the machine gives none."""
    import shutil
    import uuid

    name = f"pfa-zygote-{uuid.uuid4().hex[:6]}"
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return None
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True)
    return name if made.returncode == 0 else None


def test_a_command_under_ip_netns_exec_runs_in_that_namespace_forked_as_fresh(tmp_path):
    """``ip netns exec NAME python ...`` is forked too: the child joins the namespace itself."""
    name = _network_namespace()
    if name is None:
        pytest.skip("needs root and ip netns")
    try:
        veth = f"v{name[-6:]}"  # an interface only that namespace has
        subprocess.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"p{name[-6:]}"], check=True)
        subprocess.run(["ip", "link", "set", veth, "netns", name], check=True)
        fresh, forked = _both("exit:0", tmp_path, prefix=("ip", "netns", "exec", name))
        assert fresh[0] == forked[0] == 0
        assert fresh[1]["netns"] == forked[1]["netns"] != os.readlink("/proc/self/ns/net")
        assert fresh[1]["interfaces"] == forked[1]["interfaces"] == ["lo", veth]
        # a namespace that is not there: ip's own error, from a fresh start
        gone = zygote.ForkedPopen(
            ["ip", "netns", "exec", f"{name}-gone", sys.executable, str(zygote.PROBE), "exit:0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = gone.communicate(timeout=60)
        assert gone._forked is False and out == "" and gone.returncode != 0 and f"{name}-gone" in err
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_two_forked_processes_do_not_share_a_random_sequence(tmp_path):
    """Python's and numpy's global generators, each seeded from the OS in a fresh interpreter."""
    first, second = (
        json.loads(_start(True, "exit:0", tmp_path).communicate(timeout=60)[0].splitlines()[0])["random"]
        for _ in range(2)
    )
    assert first[0] != second[0] and first[1] != second[1]


@pytest.mark.parametrize(
    "action, code, said",
    [
        ("raise", 1, "ValueError: the probe's own error"),
        ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ],
)
def test_an_uncaught_error_ends_a_forked_process_as_it_ends_a_fresh_one(tmp_path, action, code, said):
    fresh, forked = _both(action, tmp_path)
    assert fresh[0] == forked[0] == code
    assert said in fresh[3] and said in forked[3]
    assert fresh[3].splitlines()[-1] == forked[3].splitlines()[-1]


def test_non_daemon_threads_and_atexit_run_before_a_forked_process_ends(tmp_path):
    fresh, forked = _both("thread", tmp_path)
    assert fresh[0] == forked[0] == 0
    assert fresh[2] == forked[2] == "thread ended\natexit ran\n"


def _sleeping(forked: bool, tmp_path):
    process = _start(forked, "sleep", tmp_path)
    assert process.stdout.readline().startswith("{")
    assert process.poll() is None
    return process


@pytest.mark.parametrize("sent", [signal.SIGKILL, signal.SIGTERM])
def test_signals_reach_a_forked_process_and_its_status_says_so(tmp_path, sent):
    codes = []
    for forked in (False, True):
        process = _sleeping(forked, tmp_path)
        process.send_signal(sent)
        codes.append(process.wait(timeout=30))
    assert codes == [-sent] * 2


@pytest.mark.parametrize("ignored", [False, True])
def test_ctrl_c_is_taken_or_ignored_as_a_fresh_interpreter_would(tmp_path, ignored):
    """An exec'd interpreter keeps an ignored SIGINT (pytest-xdist's workers ignore it) and
    otherwise ends on KeyboardInterrupt; the server itself ignores Ctrl-C."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
    try:
        processes = [_sleeping(forked, tmp_path) for forked in (False, True)]
    finally:
        signal.signal(signal.SIGINT, before)
    for process in processes:
        process.send_signal(signal.SIGINT)
    if ignored:
        with pytest.raises(subprocess.TimeoutExpired):
            processes[1].wait(timeout=1)
        assert processes[0].poll() is None
        for process in processes:
            process.kill()
    codes = [process.wait(timeout=30) for process in processes]
    assert codes == ([-signal.SIGKILL] * 2 if ignored else [-signal.SIGINT] * 2)


def test_commands_the_server_does_not_take_start_fresh(tmp_path):
    process = zygote.ForkedPopen([sys.executable, "-c", "print(6 * 7)"], stdout=subprocess.PIPE, text=True)
    assert process.communicate(timeout=60)[0] == "42\n" and process.returncode == 0
    assert process._forked is False
    # an environment that differs in what is read while importing torch: fresh too
    other = _start(False, "exit:0", tmp_path, env={"OMP_NUM_THREADS": "7"})
    other.communicate(timeout=60)
    assert (
        zygote.forkable(
            [sys.executable, str(zygote.PROBE), "exit:0"],
            None,
            False,
            None,
            (),
            {**os.environ, "OMP_NUM_THREADS": "7"},
            None,
        )
        is None
    )


MPIRUN = __import__("shutil").which("mpirun", path=os.path.dirname(sys.executable))


def _ranks(forked: bool, action: str, tmp_path):
    """``unshare -n mpirun -n 2 python probe ACTION`` (the MPI tests' form), started fresh or forked."""
    from tests.helpers import unshare_works

    command = [MPIRUN, "-n", "2", sys.executable, str(zygote.PROBE), action]
    command = ["unshare", "-n", *command] if unshare_works() else command
    popen = zygote.ForkedPopen if forked else zygote.FreshPopen
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _said(out: str) -> list:
    """Every JSON object the ranks printed (mpirun interleaves their lines), those with a rank last, by rank."""
    decoder, found, at = json.JSONDecoder(), [], out.find("{")
    while at != -1:
        said, end = decoder.raw_decode(out, at)
        found.append(said)
        at = out.find("{", end)
    return sorted(found, key=lambda said: said.get("rank", -1))


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (PyPI mpich) not installed")
def test_mpi_ranks_forked_from_the_server_run_mpi_as_fresh_ones_do(tmp_path):
    """Under mpirun each rank is forked through its stand-in (tests/zygote_rank.py): MPI starts from
    the stand-in's PMI socket, in its network namespace, and the job's ranks talk to each other."""
    from tests.helpers import unshare_works

    results = {}
    for forked in (False, True):
        process = _ranks(forked, "mpi", tmp_path)
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, (forked, out[-2000:], err[-3000:])
        results[forked] = _said(out)
    python = os.path.basename(sys.executable)
    for forked, said in results.items():
        probes, ranks = said[:2], said[2:]  # each rank's probe line (no rank), then its MPI line
        assert [(r["rank"], r["size"], r["sum"]) for r in ranks] == [(0, 2, 3), (1, 2, 3)]
        for probe in probes:
            if unshare_works():  # unshare -n's namespace, with loopback only, as the stand-in's
                assert probe["netns"] != os.readlink("/proc/self/ns/net") and probe["interfaces"] == ["lo"]
        parents = [r["parent"][:1] if not forked else r["parent"] for r in ranks]  # the proxy's port varies
        assert parents == ([[python, "-m", "tests.zygote"]] * 2 if forked else [["hydra_pmi_proxy"]] * 2)
    # the probes' own lines (argv, working directory, variables, ...) are the same either way
    strip = lambda probe: {k: v for k, v in probe.items() if k not in ("random", "netns")}  # noqa: E731
    assert [strip(p) for p in results[True][:2]] == [strip(p) for p in results[False][:2]]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (PyPI mpich) not installed")
def test_a_forked_rank_ends_with_its_stand_in_and_mpirun_ends_the_job(tmp_path):
    """SIGKILL to a rank's stand-in (what mpirun's proxy does to a job it aborts) ends the rank."""
    import time

    process = _ranks(True, "mpi-sleep", tmp_path)
    from tests.helpers import processes_naming

    printed = ""
    while len([said for said in _said(printed) if "rank" in said]) < 2:
        line = process.stdout.readline()
        assert line, process.stderr.read()[-3000:]
        printed += line
    ranks = [said for said in _said(printed) if "rank" in said]

    def command_line(pid: int) -> list:
        return open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")

    def working_directory(pid: int) -> str:
        try:
            return os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            return ""

    # This job's stand-ins only: another test's MPI job may have its own running (CI run of 067e7bb).
    stand_ins = [
        pid
        for pid in processes_naming(str(zygote.RANK))
        if command_line(pid)[1:3] == ["-I", "-S"] and working_directory(pid) == str(tmp_path)
    ]
    assert len(stand_ins) == 2
    os.kill(stand_ins[0], signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode != 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{r['pid']}") for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{r['pid']}") for r in ranks)


@pytest.mark.parametrize("form", ["script", "-c --script"])
def test_a_users_script_is_forked_with_neither_the_plugin_nor_fedml_loaded_as_a_fresh_one_starts(tmp_path, form):
    """A user's script (FedML's examples, the one-file scripts, the network guard's ``--script``)
    is forked from the libraries' server: it sees what a fresh interpreter sees, and imports the
    plugin and FedML itself, in its own order."""
    script = tmp_path / "users" / "main_of_the_user.py"
    script.parent.mkdir()
    script.write_text(zygote.PROBE.read_text())
    command = [sys.executable, str(script), "imports"]
    if form != "script":
        command = [sys.executable, "-c", NETWORK_GUARD, "--script", str(script), "imports"]
    results = []
    for popen in (zygote.FreshPopen, zygote.ForkedPopen):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PROBE_VARIABLE": "v"}
        process = popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        said, loaded = [json.loads(line) for line in out.splitlines() if not line.startswith("NETWORK_ATTEMPTS")]
        said.pop("random")
        results.append((getattr(process, "_forked", False), said, loaded))
    (fresh_forked, fresh, fresh_loaded), (forked_forked, forked, forked_loaded) = results
    assert (fresh_forked, forked_forked) == (False, True)
    assert forked == fresh and fresh["argv"] == ["imports"]
    assert fresh["path0"] == (str(script.parent) if form == "script" else "")  # as `python -c` and runpy set it
    assert forked_loaded == fresh_loaded == []
    assert zygote.forkable(command, None, False, None, (), env, None)[2].path == zygote._Server.get("libraries").path


def _gone(pid: int, within: float) -> bool:
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stream:
                if stream.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_launchers_silo_is_forked_in_its_namespace_and_ends_when_the_launcher_is_killed(tmp_path):
    """The silo launcher's processes (started with PR_SET_PDEATHSIG) are forked by the server too,
    in the launcher's network namespace; when the launcher dies, even by SIGKILL, each gets SIGTERM,
    as the kernel sends it to a fresh one."""
    name = _network_namespace()
    prefix = ("ip", "netns", "exec", name) if name else ()
    try:
        for forked in (False, True):
            launcher = _start(forked, "launch", tmp_path, prefix=prefix)
            first = json.loads(launcher.stdout.readline())
            silo = json.loads(launcher.stdout.readline())
            assert silo["forked"] is forked and silo["argv"] == ["sleep"] and silo["leader"] is True
            assert silo["netns"] == first["netns"]
            if name:
                assert silo["netns"] != os.readlink("/proc/self/ns/net")
            assert not _gone(silo["pid"], 0.5)
            launcher.kill()
            launcher.communicate(timeout=60)
            assert _gone(silo["pid"], 20.0), f"the silo outlived its launcher (forked: {forked})"
    finally:
        if name:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
