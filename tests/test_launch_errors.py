"""The launcher's two user mistakes fail before any rank is spawned, in one line that names the
fix: a call outside `if __name__ == "__main__":` (every spawned rank imports the script again
and would launch again) and a `main` or argument that cannot be pickled (a lambda). Each case
runs a small script in a fresh interpreter, with process starts reported, as a user would."""

from __future__ import annotations

import ast
import multiprocessing.process
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import functional_shard as fs
from functional_shard._launch import _guarded

REPO = Path(__file__).resolve().parents[1]
GUARD_FIX = 'put the call under `if __name__ == "__main__":`'

# Every script starts with this: a process start prints SPAWNED, so the test sees whether any rank started.
_PROLOGUE = """
import multiprocessing.process
_start = multiprocessing.process.BaseProcess.start
def _reporting_start(self):
    print("SPAWNED", flush=True)
    return _start(self)
multiprocessing.process.BaseProcess.start = _reporting_start
import functional_shard as fs

def main(x=1):
    return x + 1
"""

SCRIPTS = {
    "unguarded": "print(fs.launch(main, world_size=2))\n",
    "unguarded_through_a_function": "def run():\n    return fs.launch(main, world_size=2)\n\nrun()\n",
    "lambda": 'if __name__ == "__main__":\n    fs.launch(lambda: 1, world_size=2)\n',
    "nested_function": (
        'def outer():\n    def inner():\n        return 1\n    return fs.launch(inner, world_size=2)\n\n'
        'if __name__ == "__main__":\n    outer()\n'
    ),
    "unpicklable_argument": (
        'import threading\nif __name__ == "__main__":\n    fs.launch(main, world_size=2, args=(threading.Lock(),))\n'
    ),
}


def _environment() -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    environment["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return environment


def _run(path: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *arguments, str(path)], env=_environment(), capture_output=True, text=True, timeout=120
    )


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_a_launch_mistake_fails_before_any_rank_starts_in_one_line(tmp_path, case):
    script = tmp_path / f"{case}.py"
    script.write_text(_PROLOGUE + SCRIPTS[case])
    done = _run(script)
    assert done.returncode == 1, done.stderr
    assert "SPAWNED" not in done.stdout, "a rank was spawned before the mistake was reported"
    assert "freeze_support" not in done.stderr and "without a report" not in done.stderr, done.stderr
    last = _last_line(done.stderr)
    if case.startswith("unguarded"):
        line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if text.startswith(("print(fs", "run()")))
        assert last == (
            f"RuntimeError: fs.launch is called at the top level of {script.name}:{line}, which every spawned rank "
            f"runs again when it imports the script: {GUARD_FIX}"
        )
    elif case == "unpicklable_argument":
        assert last.startswith("TypeError: fs.launch cannot send args[0] (a lock) to the ranks"), last
        assert last.endswith("pass values that pickle (tensors, numbers, strings, containers, module-level classes)")
    else:
        name = {"lambda": "<lambda>", "nested_function": "outer.<locals>.inner"}[case]
        assert last.startswith(f"TypeError: fs.launch cannot send main {name} ({script.name}:"), last
        assert last.endswith("define it with `def` at the top level of a module (not a lambda, not inside a function)")


def test_a_guard_the_check_cannot_read_is_caught_by_the_spawned_ranks(tmp_path):
    # `__name__ in (...)` reads `__name__`, so the parent takes it for a guard; the ranks, importing
    # the script as `__mp_main__`, reach the call and exit with the code the parent turns into the message.
    script = tmp_path / "fooled.py"
    script.write_text(_PROLOGUE + 'if __name__ in ("__main__", "__mp_main__"):\n    fs.launch(main, world_size=2)\n')
    done = _run(script)
    assert done.returncode == 1
    assert "freeze_support" not in done.stderr, done.stderr
    assert _last_line(done.stderr) == (
        "RuntimeError: fs.launch is called when the script is imported, and every spawned rank imports it again: "
        + GUARD_FIX
    )


def test_a_main_defined_without_a_script_file_is_refused_before_spawning():
    # `python -c`: the spawned ranks do not run this code again, so they could not find `main`.
    code = _PROLOGUE + "fs.launch(main, world_size=2)\n"
    done = subprocess.run([sys.executable, "-c", code], env=_environment(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "SPAWNED" not in done.stdout
    assert _last_line(done.stderr).startswith("TypeError: fs.launch cannot send main main (<string>:") and (
        "defined in an interactive session" in done.stderr
    ), done.stderr


def test_the_guard_check_reads_the_script():
    source = """
import functional_shard as fs
fs.launch(main)
if __name__ == "__main__":
    fs.launch(main)
if "__main__" == __name__ and True:
    x = 1
else:
    fs.launch(main)
if other:
    fs.launch(main)
"""
    tree = ast.parse(source)
    lines = {i: text for i, text in enumerate(source.splitlines())}
    calls = [i for i, text in lines.items() if "fs.launch" in text]
    assert [_guarded(tree, line) for line in calls] == [False, True, True, False]


def _refuse_spawning(self):
    raise AssertionError("a rank was spawned")


def test_unpicklable_keyword_arguments_are_named(monkeypatch):
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse_spawning)
    with pytest.raises(TypeError) as info:
        fs.launch(int, world_size=2, kwargs={"base": threading.Lock()})
    message = str(info.value)
    assert "\n" not in message and message.startswith("fs.launch cannot send kwargs['base'] (a lock) to the ranks")
