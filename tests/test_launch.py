"""The launcher's lifetime guarantees: no rank outlives the launcher, results arrive whatever
they hold, ranks leave without crashing, nothing listens beyond loopback, and `RankError` names
the rank that failed first. Functions run in ranks are module-level (pickled by reference)."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import functional_shard as fs
from functional_shard._failures import first_cause, is_collective_error
from functional_shard.models import MLP
from _sockets import listeners

REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_for_pids(directory: Path, count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [p for p in directory.glob("rank*.pid") if p.read_text().strip()]
        if len(files) == count:
            return [int(p.read_text()) for p in files]
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not write their pids into {directory} within {timeout} s")


def _write_pid(directory: str) -> None:
    path = Path(directory) / f"rank{os.environ['RANK']}.pid"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)  # whole, or not at all


# --- failure kinds and the choice of the cause: no processes ------------------------------------


def test_the_cause_is_a_rank_that_died_or_raised_not_a_collective_casualty():
    killed = fs.Failure.of_exit(-signal.SIGKILL)
    assert killed.kind is fs.FailureKind.KILLED and killed.signal == signal.SIGKILL
    assert "killed by signal 9 (SIGKILL)" in killed.message
    exited = fs.Failure.of_exit(3)
    assert exited.kind is fs.FailureKind.EXITED and exited.signal is None
    casualty = fs.Failure(fs.FailureKind.COLLECTIVE, "RuntimeError: Connection closed by peer", "Traceback ...")
    own = fs.Failure(fs.FailureKind.RAISED, "ValueError: bad batch", "Traceback ...")
    stopped = fs.Failure(fs.FailureKind.STOPPED, "stopped by the launcher 10 s after rank 1 failed")
    # The survivor's report arrives first; the killed rank is still the cause.
    assert first_cause({0: casualty, 1: killed}) == 1
    assert first_cause({2: stopped, 0: casualty, 1: exited}) == 1
    # Among ranks with errors of their own, the first to report.
    assert first_cause({3: own, 1: killed}) == 3
    assert first_cause({0: casualty, 2: stopped}) == 0
    error = fs.RankError({0: casualty, 1: killed, 2: stopped})
    assert error.rank == 1 and error.remote_traceback == ""
    text = str(error)
    assert text.startswith("rank 1 failed: process killed by signal 9 (SIGKILL)")
    assert "\n  rank 0: RuntimeError: Connection closed by peer" in text and "\n  rank 2: stopped" in text


def test_gloo_errors_are_recognised_as_collective_failures():
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33666"
    )
    assert is_collective_error(gloo)
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise fs.StepError("the step failed") from inner
    except fs.StepError as wrapped:
        assert is_collective_error(wrapped)
    assert not is_collective_error(ValueError("mesh axes {'fsdp': 3} hold 3 ranks but the world has 4"))


def test_world_of_one_leaves_the_environment_alone_and_shutdown_is_idempotent():
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    before = dict(os.environ)
    fs.shutdown()  # no group: nothing to do
    with fs.init_mesh({"fsdp": 1}) as mesh:
        assert mesh.world_size == 1
        assert mesh.all_reduce_flat(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]
    assert not dist.is_initialized()
    fs.shutdown()
    assert dict(os.environ) == before


def one_step_more_on_rank_0():
    mesh = fs.init_mesh({"fsdp": 2})
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))
    step = fs.sharded_step(lambda p, b: apply_fn(p, b).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1))
    state = step.init(params)
    for _ in range(3 if mesh.rank == 0 else 2):  # uneven data: rank 1 returns while rank 0 steps
        state, _ = step(state, torch.randn(4, 5))
    return "done"


def test_a_rank_that_returns_early_fails_the_launch_at_once():
    """A launched rank that returns from `main` leaves the world (`shutdown`, which agrees first):
    the rank still in a step and the one shutting down both raise `MeshError` naming what each is
    in. Before, the returned rank idled and the other waited out the collective timeout (600 s)."""
    start = time.monotonic()
    with pytest.raises(fs.RankError, match=r"rank 0: .*; rank 1: fs\.shutdown"):
        fs.launch(one_step_more_on_rank_0, world_size=2)
    assert time.monotonic() - start < 60


# --- results arrive whatever they hold ----------------------------------------------------------


def returns_a_state_dict_and_many_tensors(n_tensors: int):
    mesh = fs.init_mesh({"fsdp": 2})
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=6))
    step = fs.sharded_step(
        lambda p, b: apply_fn(p, b).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=fs.Schedule(trace=False)
    )
    state, _ = step(step.init(params), torch.randn(4, 5))
    tensors = [torch.full((3,), float(i)) for i in range(n_tensors)]
    return fs.export(state), tensors


def _check_results(launches: int) -> None:
    for attempt in range(launches):
        state_dict, tensors = fs.launch(returns_a_state_dict_and_many_tensors, world_size=2, args=(2000,))
        assert len(state_dict) == 28 and state_dict["blocks.5.fc2.bias"].shape == (8,), f"launch {attempt}"
        assert len(tensors) == 2000 and all(t[0].item() == i for i, t in enumerate(tensors)), f"launch {attempt}"


def test_rank_zero_returns_a_state_dict_and_2000_tensors():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    _check_results(1)
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "launch must restore the signal handlers"


@pytest.mark.slow
def test_results_arrive_20_of_20_times():
    _check_results(20)


def mmapped_blocks_of_a_20_mib_tensor() -> int:
    """How many new `mmap`ed blocks glibc makes for a 20 MiB tensor (its `mallinfo2().hblks`)."""
    import ctypes
    import ctypes.util

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    before = mallinfo2().hblks
    tensor = torch.empty(20 * 2**20, dtype=torch.uint8)
    after = mallinfo2().hblks
    del tensor
    return after - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_launched_ranks_keep_freed_memory_unless_told_not_to():
    # With fs.keep_freed_memory() a 20 MiB block comes from the heap (reused when freed), not
    # from a fresh mmap that is returned to the OS when freed and page-faulted in again.
    assert fs.launch(mmapped_blocks_of_a_20_mib_tensor, world_size=1) == 0
    assert fs.launch(mmapped_blocks_of_a_20_mib_tensor, world_size=1, keep_freed_memory=False) == 1


# --- one call under either launcher ----------------------------------------------------------------

_EITHER_LAUNCHER = """
import json, os, sys
import torch, torch.distributed as dist
import functional_shard as fs
sys.path.insert(0, {tests!r})
from test_launch import mmapped_blocks_of_a_20_mib_tensor

def main(scale, fail_on_rank=None):
    mesh = fs.init_mesh({{"fsdp": int(os.environ["WORLD_SIZE"])}})
    if mesh.rank == fail_on_rank:
        raise ValueError(f"rank {{mesh.rank}} says no")
    total = mesh.all_reduce_flat(torch.full((1,), float(mesh.rank + 1))).item()
    return {{"total": total * scale, "world": mesh.world_size, "rank": mesh.rank,
            "threads": torch.get_num_threads(), "mmapped_blocks": mmapped_blocks_of_a_20_mib_tensor()}}

if __name__ == "__main__":
    fail_on_rank = int(sys.argv[1]) if len(sys.argv) > 1 else None
    result = fs.launch(main, world_size=2, args=(10,), kwargs={{"fail_on_rank": fail_on_rank}})
    sys.stdout.write("RESULT " + json.dumps({{"rank": os.environ.get("RANK"), "result": result, "group_left": not dist.is_initialized()}}) + "\\n")  # one write: lines of two ranks never interleave
    sys.stdout.flush()
"""


def _results(stdout: str) -> list[dict]:
    return [json.loads(line[len("RESULT ") :]) for line in stdout.splitlines() if line.startswith("RESULT ")]


def _either_launcher(tmp_path: Path, *launcher: str, fail_on_rank: int | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "either.py"
    script.write_text(_EITHER_LAUNCHER.format(tests=str(REPO / "tests")))
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    environment["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    environment["GLOO_SOCKET_IFNAME"] = "lo" if sys.platform.startswith("linux") else "lo0"
    extra = [] if fail_on_rank is None else [str(fail_on_rank)]
    return subprocess.run(
        [sys.executable, *launcher, str(script), *extra], env=environment, capture_output=True, text=True, timeout=120
    )


_TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def test_one_call_runs_main_under_a_local_launch_and_under_torchrun(tmp_path):
    expected = {"total": 30.0, "world": 2, "rank": 0, "threads": max(1, (os.cpu_count() or 1) // 2)}
    if sys.platform.startswith("linux"):
        expected["mmapped_blocks"] = 0  # fs.keep_freed_memory() ran in the rank, under either launcher
    local = _either_launcher(tmp_path)
    assert local.returncode == 0, local.stderr[-12000:]
    [report] = _results(local.stdout)  # the launcher's process prints rank 0's result
    assert report["rank"] is None and report["group_left"]
    assert {k: report["result"][k] for k in expected} == expected

    torchrun = _either_launcher(tmp_path, *_TORCHRUN)
    assert torchrun.returncode == 0, torchrun.stderr[-12000:]
    reports = sorted(_results(torchrun.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == ["0", "1"]  # every rank ran main in the process torchrun made
    assert all(r["group_left"] for r in reports), "fs.launch under torchrun must end with fs.shutdown()"
    assert reports[1]["result"] is None  # rank 0's result on rank 0 only
    assert {k: reports[0]["result"][k] for k in expected} == expected


def test_under_torchrun_a_rank_that_raises_ends_the_run(tmp_path):
    started = time.monotonic()
    done = _either_launcher(tmp_path, *_TORCHRUN, fail_on_rank=1)
    assert done.returncode != 0 and "ValueError: rank 1 says no" in done.stderr, done.stderr[-3000:]
    assert not _results(done.stdout)
    assert time.monotonic() - started < 60  # torchrun stopped rank 0; nothing waited for a collective timeout


def iterates_a_dataloader_with_workers() -> tuple[list[list[int]], str]:
    import multiprocessing

    from torch.utils.data import DataLoader, TensorDataset

    batches = [batch[0].tolist() for batch in DataLoader(TensorDataset(torch.arange(10)), batch_size=5, num_workers=2)]
    return batches, multiprocessing.get_start_method()


def test_a_launched_rank_may_start_dataloader_workers():
    # As under torchrun. The pool starts its ranks as daemons, which may not have children, and
    # spawned, whose children would be spawned too (each worker importing torch and the script
    # again: 30 s for two workers on this machine under load, 0.4 s forked).
    batches, start_method = fs.launch(iterates_a_dataloader_with_workers, world_size=1)
    assert batches == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert start_method == multiprocessing.get_context().get_start_method()  # this platform's default


# --- a pool of ranks -----------------------------------------------------------------------------


def environment_variable(name: str) -> str | None:
    return os.environ.get(name)


def test_worker_pool_survives_own_errors_and_ranks_exit_cleanly():
    pool = fs.WorkerPool(2)
    try:
        assert pool.run(environment_variable, ("RANK",)) == ["0", "1"]
        with pytest.raises(fs.RankError) as info:
            pool.run(int, ("not a number",))
        assert set(info.value.failures) == {0, 1}  # both raised; the first to report is named
        assert all(f.kind is fs.FailureKind.RAISED and "ValueError" in f.message for f in info.value.failures.values())
        assert not pool.closed  # every rank raised its own error: still in step
        assert pool.run(environment_variable, ("WORLD_SIZE",)) == ["2", "2"]
        processes = list(pool._processes)
        pool.close()  # raises RankError unless every rank exits with code 0
        assert [p.exitcode for p in processes] == [0, 0] and pool.closed
    finally:
        pool.stop()


# --- nothing listens beyond loopback ------------------------------------------------------------


def reports_listening_sockets_then_shuts_down():
    with fs.init_mesh({"fsdp": 2}) as mesh:
        mesh.all_reduce_flat(torch.ones(4))  # gloo's pairs are connected
        mine = {f"rank {mesh.rank}": listeners(os.getpid())}
        everyone = [None] * mesh.world_size
        dist.all_gather_object(everyone, mine)
        everyone.append({"launcher": listeners(os.getppid())})
    left_by_with = not dist.is_initialized()
    fs.shutdown()  # again: nothing to do, and launch's own shutdown after `main` finds no group either
    fs.shutdown()
    return everyone, left_by_with


def test_a_local_launch_listens_on_loopback_only_and_ranks_may_shut_down_themselves():
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    parts, left_by_with = fs.launch(reports_listening_sockets_then_shuts_down, world_size=2)
    assert left_by_with, "leaving `with fs.init_mesh(...)` must end the process group"
    sockets = {name: addresses for part in parts for name, addresses in part.items()}
    assert set(sockets) == {"rank 0", "rank 1", "launcher"}
    assert sockets["launcher"], "the rendezvous store should listen in the launcher"
    assert sockets["rank 0"] or sockets["rank 1"], "gloo should listen in the ranks"
    loopback = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    for name, addresses in sockets.items():
        assert all(address in loopback for address, _ in addresses), f"{name} listens beyond loopback: {addresses}"


# --- no rank outlives the launcher --------------------------------------------------------------

_FOREVER = """
import sys, torch, functional_shard as fs
sys.path.insert(0, {tests!r})
from test_launch import _write_pid

def main(directory):
    mesh = fs.init_mesh({{"fsdp": 2}})
    _write_pid(directory)
    while True:
        mesh.all_reduce_flat(torch.ones(16))

if __name__ == "__main__":
    try:
        fs.launch(main, world_size=2, args=({directory!r},))
    except KeyboardInterrupt:
        sys.exit(3)
"""


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.slow)], ids=lambda s: s.name
)
def test_killing_the_launcher_leaves_no_rank_alive(tmp_path, signum):
    script = tmp_path / "forever.py"
    script.write_text(_FOREVER.format(tests=str(REPO / "tests"), directory=str(tmp_path)))
    environment = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    launcher = subprocess.Popen([sys.executable, str(script)], env=environment, stderr=subprocess.PIPE)
    try:
        ranks = _wait_for_pids(tmp_path, 2, timeout=120)
        time.sleep(0.5)  # the ranks are in their all-reduce loop
        assert all(_alive(pid) for pid in ranks)
        launcher.send_signal(signum)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(pid) for pid in ranks):
            time.sleep(0.05)
        assert not [pid for pid in ranks if _alive(pid)], f"ranks alive 5 s after {signum.name} to the launcher"
        code = launcher.wait(timeout=10)
        # SIGTERM keeps its meaning (the launcher dies of it), SIGINT its KeyboardInterrupt.
        assert code == {signal.SIGTERM: -signal.SIGTERM, signal.SIGKILL: -signal.SIGKILL, signal.SIGINT: 3}[signum]
    finally:
        launcher.kill()
        launcher.wait()
        for pid_file in tmp_path.glob("rank*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


# --- a rank killed mid-training is named, and nothing is left ------------------------------------

_COLLECTIVE_TIMEOUT = 10.0


def trains_until_killed(directory: str, victim: int, kill_at_step: int, kill_delay: float, trace: bool):
    """A few sharded steps on a tiny MLP; rank `victim` SIGKILLs itself during step `kill_at_step`."""
    mesh = fs.init_mesh({"fsdp": 2}, timeout=_COLLECTIVE_TIMEOUT)
    _write_pid(directory)
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2), schedule=fs.Schedule(trace=trace))
    state = step.init(params)
    batch = (torch.randn(4, 5), torch.randint(0, 3, (4,)))
    if mesh.rank == victim:
        def kill() -> None:
            Path(directory, "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        timer = None
    for index in range(kill_at_step + 1000):
        if mesh.rank == victim and index == kill_at_step:
            timer = threading.Timer(kill_delay, kill)  # lands anywhere: in a collective, in compute
            timer.start()
        state, _ = step(state, batch)
    return "never reached: the victim dies first"


def _inject_fault(tmp_path: Path, seed: int, trace: bool) -> float:
    """One launch in which a random rank is killed at a random moment; returns the seconds from
    the kill until the launcher had raised and every rank was gone."""
    chance = random.Random(seed)
    victim, kill_at_step, delay = chance.randrange(2), chance.randrange(4), chance.uniform(0.0, 0.05)
    directory = tmp_path / f"run{seed}"
    directory.mkdir()
    with pytest.raises(fs.RankError) as info:
        fs.launch(trains_until_killed, world_size=2, args=(str(directory), victim, kill_at_step, delay, trace), grace=30.0)
    ended = time.time()
    error = info.value
    assert error.rank == victim, f"seed {seed}: blamed rank {error.rank}, killed {victim}: {error}"
    assert error.failures[victim].kind is fs.FailureKind.KILLED and error.failures[victim].signal == signal.SIGKILL
    assert "rank %d failed: process killed by signal 9 (SIGKILL)" % victim in str(error)
    pids = [int(p.read_text()) for p in directory.glob("rank*.pid")]
    assert len(pids) == 2 and not [pid for pid in pids if _alive(pid)]
    taken = ended - float((directory / "killed_at").read_text())
    assert taken < _COLLECTIVE_TIMEOUT + 5, f"seed {seed}: {taken:.1f} s from the kill to the end"
    return taken


def test_a_rank_killed_mid_training_is_named(tmp_path):
    _inject_fault(tmp_path, seed=int(time.time()) % 1000, trace=False)


@pytest.mark.slow
def test_a_rank_killed_mid_training_is_named_20_of_20(tmp_path):
    base = int(time.time()) % 10_000
    taken = [_inject_fault(tmp_path, seed=base + i, trace=i % 2 == 0) for i in range(20)]
    print(f"kill -> all gone: max {max(taken):.2f} s, mean {sum(taken) / len(taken):.2f} s (seeds {base}..{base + 19})")
