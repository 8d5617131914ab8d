"""Processes and exposure (issue 25, items 10, 11, 12, 14), on real processes:

- ranks that disagree are named within seconds, never paired: a rank that shuts down while
  another takes one step more, a rank that issues a collective of its own (an extra
  `torch.distributed.all_reduce`), which the others name (`fs.PeerError`, `RankError.rank`), and
  a rank that dies while the others wait for it;
- under torchrun, ranks die with their agent: SIGKILL it, and no rank is alive 5 s later;
- a world of one listens on loopback only (with a hostname that resolves to another
  interface), and not at all once it is shut down, whatever ends it; so do `fs.launch`'s worlds
  and the gloo sockets of a world whose `MASTER_ADDR` is 127.0.0.1;
- a run that ends with `torch.distributed.destroy_process_group()` instead of `fs.shutdown()`
  ends its process groups there (no gloo thread left for interpreter shutdown): no abort at exit
  (a handful of launches here; 100, beside DDP's count, in the `slow` soak).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import functional_shard as fs
from functional_shard.models import MLP
from _sockets import listeners

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


# --- helpers ---------------------------------------------------------------------------------


def _is_loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _non_loopback_address() -> str | None:
    """An IPv4 address of one of this machine's interfaces other than loopback, if any."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                address = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
            except OSError:
                continue
            if not address.startswith("127."):
                return address
    finally:
        probe.close()
    return None


def _can_rename_host() -> bool:
    """Whether `unshare` can give a child a hostname of its own (a user and UTS namespace)."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-Uur", "hostname", "fs-test"], capture_output=True).returncode == 0


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_ranks(script: Path, world_size: int, *args: str, timeout: float = 180.0) -> list[tuple[int, str]]:
    """Start `script` in `world_size` plain processes with torchrun's variables (rank 0 serves
    the store); every rank's (exit code, stderr)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world_size))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    results = []
    for process in processes:
        try:
            _, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
        results.append((process.returncode, err))
    return results


# --- 10. ranks that disagree are named in seconds --------------------------------------------------


def _join(timeout: float):
    return fs.init_mesh({"fsdp": 2}, timeout=timeout)


def _two_steps(mesh):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))
    step = fs.sharded_step(lambda p, b: apply_fn(p, b).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1))
    state = step.init(params)
    for _ in range(2):
        state, _ = step(state, torch.randn(2, 5))
    return step, state


def one_step_more_on_rank_zero(mesh):
    step, state = _two_steps(mesh)
    start = time.monotonic()
    try:
        if mesh.rank == 0:
            step(state, torch.randn(2, 5))  # one step more than rank 1
        else:
            fs.shutdown()
        outcome = "no error"
    except fs.MeshError as error:
        outcome = f"{type(error).__name__}: {error}"
    elapsed = time.monotonic() - start
    fs.shutdown(barrier=False)  # rank 1's group is gone: rank 0 leaves its own without waiting
    return outcome, elapsed


def test_a_rank_that_shuts_down_while_another_steps_is_named_in_seconds():
    with fs.WorkerPool(2, setup=_join, setup_args=(60.0,), start_timeout=120) as pool:
        (zero, t0), (one, t1) = pool.run(one_step_more_on_rank_zero, timeout=40)
    for outcome in (zero, one):
        assert outcome.startswith("MeshError: ranks entered different collective operations"), outcome
        assert "rank 0: a training step; rank 1: fs.shutdown" in outcome
        assert "rank 1 is shutting down (fs.shutdown)" in outcome
        assert "rank 0 is in a training step (its functional_shard call #4, its 3rd on its mesh)" in outcome
    assert t0 < 10 and t1 < 10, (t0, t1)


def warm(mesh) -> None:
    _two_steps(mesh)


def an_extra_collective_on_rank_one(mesh):
    step, state = _two_steps(mesh)
    if mesh.rank == 1:
        dist.all_reduce(torch.ones(3))  # the user's own, on rank 1 only
    step(state, torch.randn(2, 5))


def test_a_collective_of_the_users_on_one_rank_is_named_with_its_rank():
    with fs.WorkerPool(2, setup=_join, setup_args=(60.0,), exit_on_error=True, start_timeout=120) as pool:
        pool.run(warm)  # imports and a first trace, out of the timing
        start = time.monotonic()
        with pytest.raises(fs.RankError) as info:
            pool.run(an_extra_collective_on_rank_one, timeout=40)
        elapsed = time.monotonic() - start
    error = info.value
    assert error.rank == 1, str(error)  # the rank that issued it, though it failed only from rank 0's exit
    zero = error.failures[0]
    assert zero.message.startswith("PeerError: rank 1 issued a collective that rank 0 did not"), zero.message
    assert "after its last functional_shard call (a training step" in zero.message
    assert elapsed < 10, elapsed


def rank_one_dies_before_its_step(mesh):
    step, state = _two_steps(mesh)
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    step(state, torch.randn(2, 5))


def test_a_rank_that_dies_while_the_others_wait_to_agree_is_named_in_seconds():
    with fs.WorkerPool(2, setup=_join, setup_args=(60.0,), exit_on_error=True, start_timeout=120) as pool:
        pool.run(warm)
        start = time.monotonic()
        with pytest.raises(fs.RankError) as info:
            pool.run(rank_one_dies_before_its_step, timeout=40, grace=20)
        elapsed = time.monotonic() - start
    error = info.value
    assert error.rank == 1 and error.failures[1].kind is fs.FailureKind.KILLED, str(error)
    # Its heartbeat stopped: after 3 s rank 0 met it in an all-gather, which failed at once.
    assert error.failures[0].message.startswith("PeerError: rank 1 was not heard from"), error.failures[0].message
    assert elapsed < 10, elapsed


def abort_in_a_named_function():
    os.abort()  # what glibc does on a corrupted heap ("malloc(): unaligned tcache chunk detected")


def test_a_rank_killed_by_a_fatal_signal_prints_where_it_was(capfd):
    """A rank that dies by SIGABRT (or SIGSEGV) prints its Python stack to stderr before it goes
    (faulthandler in every rank), so a crash in CI says where it happened; the parent still
    reports the rank killed by the signal."""
    with fs.WorkerPool(1, start_timeout=120) as pool:
        with pytest.raises(fs.RankError) as info:
            pool.run(abort_in_a_named_function, timeout=60, grace=10)
    failure = info.value.failures[0]
    assert failure.kind is fs.FailureKind.KILLED and "SIGABRT" in failure.message, failure.message
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "abort_in_a_named_function" in err, err[-2000:]


# --- 11. ranks die with torchrun's agent -----------------------------------------------------------

TRAINS_FOREVER = """
import os, sys, pathlib, torch
import functional_shard as fs
from functional_shard.models import MLP

torch.set_num_threads(1)
mesh = fs.init_mesh({"fsdp": 2})
torch.manual_seed(0)
apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=1))
step = fs.sharded_step(lambda p, b: apply_fn(p, b).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1))
state = step.init(params)
state, _ = step(state, torch.randn(2, 5))
pathlib.Path(sys.argv[1], f"rank{mesh.rank}.pid").write_text(str(os.getpid()))
while True:
    state, _ = step(state, torch.randn(2, 5))
"""


def test_ranks_die_with_a_sigkilled_torchrun_agent(tmp_path):
    script = tmp_path / "trains_forever.py"
    script.write_text(TRAINS_FOREVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = open(tmp_path / "torchrun.log", "w")
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
         str(script), str(tmp_path)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and agent.poll() is None:
            pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid")) if p.read_text()]
            time.sleep(0.2)
        assert len(pids) == 2, f"the ranks did not start: {(tmp_path / 'torchrun.log').read_text()[-2000:]}"
        agent.kill()  # SIGKILL: the agent can neither stop its ranks nor forward a signal
        agent.wait()
        killed = time.monotonic()
        while any(_alive(pid) for pid in pids) and time.monotonic() - killed < 5:
            time.sleep(0.1)
        alive = [pid for pid in pids if _alive(pid)]
        assert not alive, f"ranks {alive} outlived their torchrun agent by 5 s"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()
        log.close()


# --- 12. nothing listens beyond loopback ---------------------------------------------------------


def reports_its_listeners_and_its_launchers():
    return {"rank": listeners(), "launcher": listeners(os.getppid())}


LISTENERS = """
import json, os, socket, sys
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import functional_shard as fs
from functional_shard.models import MLP
from test_reliability_process import _launch_ranks, listeners, reports_its_listeners_and_its_launchers

if __name__ == "__main__" and "RANK" in os.environ:  # a rank of a world whose MASTER_ADDR is 127.0.0.1
    mesh = fs.init_mesh({"fsdp": 2})
    store = int(os.environ["MASTER_PORT"])  # rank 0 serves torch's env:// store there (every interface)
    print("RANK-REPORT " + json.dumps([(a, p) for a, p in listeners() if p != store]), file=sys.stderr)
    fs.shutdown()
elif __name__ == "__main__":
    report = {"hostname": socket.gethostname()}
    mesh = fs.init_mesh({"fsdp": 1})
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=1))
    step = fs.sharded_step(lambda p, b: apply_fn(p, b).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1))
    state, _ = step(step.init(params), torch.randn(2, 5))
    report["world of one"] = listeners()
    fs.shutdown()
    report["after fs.shutdown"] = listeners()
    mesh = fs.init_mesh({"fsdp": 1})
    dist.destroy_process_group()  # not fs's: the mesh is still alive
    report["after destroy_process_group"] = listeners()
    report["fs.launch"] = fs.launch(reports_its_listeners_and_its_launchers, world_size=2)
    ranks = _launch_ranks(Path(__file__), 2, sys.argv[1])
    report["MASTER_ADDR=127.0.0.1"] = [
        found for _, err in ranks for line in err.splitlines() if line.startswith("RANK-REPORT ")
        for found in json.loads(line.removeprefix("RANK-REPORT "))
    ]
    print("REPORT " + json.dumps(report))
"""


def test_a_world_of_one_and_local_launches_listen_on_loopback_only(tmp_path):
    address = _non_loopback_address()
    if address is None or not _can_rename_host():
        pytest.skip("needs an interface other than loopback and `unshare -Uur` (to name the host after it)")
    script = tmp_path / "listeners.py"
    script.write_text(LISTENERS)
    # The hostname resolves to a non-loopback address (it is one): gloo's default.
    command = f"hostname {address} && exec {sys.executable} {script} {HERE}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("GLOO_SOCKET_IFNAME", None)
    done = subprocess.run(["unshare", "-Uur", "sh", "-c", command], env=env, capture_output=True, text=True, timeout=180)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, done.stderr[-12000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    assert report["hostname"] == address
    assert report["world of one"], "gloo should listen (on loopback) while the group exists"
    launch, env = report["fs.launch"], report["MASTER_ADDR=127.0.0.1"]
    assert env, "gloo should listen in the ranks of a MASTER_ADDR=127.0.0.1 world"
    named = {"world of one": report["world of one"], "rank": launch["rank"], "launcher": launch["launcher"]}
    for name, found in (*named.items(), ("MASTER_ADDR=127.0.0.1 ranks", env)):
        beyond = [(a, p) for a, p in found if not _is_loopback(a)]
        assert not beyond, f"{name} listens beyond loopback: {beyond}"
    assert report["after fs.shutdown"] == [] and report["after destroy_process_group"] == [], report


# --- 14. no abort at exit, whatever ends the run -----------------------------------------------------

ENDS_WITH = """
import sys, torch, torch.distributed as dist
import functional_shard as fs
from functional_shard.models import MLP
torch.set_num_threads(1)
how = sys.argv[1]
if how == "ddp":
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(MLP(8, 16, 4, n_blocks=2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
else:
    mesh = fs.init_mesh({"fsdp": dist.get_world_size() if dist.is_initialized() else int(sys.argv[2])})
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(8, 16, 4, n_blocks=2))
    schedule = fs.Schedule(trace=sys.argv[3] == "traced")
    step = fs.sharded_step(lambda p, b: apply_fn(p, b).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=schedule)
    state = step.init(params)
    for _ in range(3):
        state, metrics = step(state, torch.randn(4, 8))
    if how == "weakref":  # the group object, to see whether destroy_process_group ends it
        import gc, weakref
        group = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        gc.collect()
        print("ENDED" if group() is None else "ALIVE", flush=True)
        sys.exit(0)
dist.destroy_process_group()  # not fs.shutdown(): the user's own ending
"""


def _aborts(script: Path, how: str, launches: int, mode: str = "traced") -> tuple[int, list[str]]:
    """How many of `launches` two-rank runs of `script` ended with a rank that failed."""
    failed, why = 0, []
    for _ in range(launches):
        results = _launch_ranks(script, 2, how, "2", mode)
        if any(code != 0 for code, _ in results):
            failed += 1
            why.append("; ".join(f"exit {code}: {err.strip().splitlines()[-1] if err.strip() else ''}" for code, err in results))
    return failed, why


def test_destroy_process_group_ends_the_group_while_the_mesh_lives(tmp_path):
    script = tmp_path / "ends_with.py"
    script.write_text(ENDS_WITH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, str(script), "weakref", "1", "eager"], env=env, capture_output=True, text=True, timeout=120
    )
    # Ended there, its gloo threads joined: none is left to release a collective's tensors
    # during interpreter shutdown, which aborted the process ("terminate called without an
    # active exception").
    assert "ENDED" in done.stdout, done.stdout + done.stderr[-2000:]
    failed, why = _aborts(script, "fs", 2, "eager")
    assert failed == 0, why


@pytest.mark.slow
def test_100_launches_ending_with_destroy_process_group_never_abort(tmp_path):
    script = tmp_path / "ends_with.py"
    script.write_text(ENDS_WITH)
    launches = int(os.environ.get("FS_TEARDOWN_LAUNCHES", "100"))
    fs_failed, why = _aborts(script, "fs", launches)
    ddp_failed, _ = _aborts(script, "ddp", launches)
    print(f"\nlaunches ending with destroy_process_group(): functional_shard {fs_failed}/{launches} failed, "
          f"DDP {ddp_failed}/{launches}")  # fmt: skip
    assert fs_failed == 0, why
