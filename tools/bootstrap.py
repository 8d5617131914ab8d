#!/usr/bin/env python3
"""Set up a virtual environment and run the example, the tests or the docs build: one command each.

    python3 tools/bootstrap.py example     # set up, then train the small GPT on 2 local CPU processes
    python3 tools/bootstrap.py test        # set up, then python -m pytest -q -n auto ... (the docs build is a test)
    python3 tools/bootstrap.py hf-example  # set up, then train the small Hugging Face Llama
    python3 tools/bootstrap.py docs        # set up, then mkdocs build --strict into site/
    python3 tools/bootstrap.py setup       # only the set-up

`make example`, `make test`, ... run exactly these. Needs only Python >= 3.10 with its `venv`
module; everything else is installed into `.venv/` at the repository root:

1. `.venv` is created if it is missing;
2. torch is installed first, pinned (`TORCH_REQUIREMENT`): a plain `torch` requirement resolved
   on a machine without it would pull several GB of CUDA packages. Set `TORCH_PIP_ARGS` to pass
   pip more arguments for that one install (e.g. `--index-url` of PyTorch's CPU wheel index);
3. then the package itself, editable, with the `dev` extra (tests, examples, Hugging Face, docs).

The set-up is recorded in `.venv/.functional_shard-setup`, keyed on a hash of pyproject.toml,
the torch requirement and the Python version: when those have not changed, set-up is skipped
(well under a second). Delete `.venv` to start over. Nothing is downloaded at run time: no model
weights, no data sets.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
STAMP = VENV / ".functional_shard-setup"
TORCH_REQUIREMENT = "torch==2.13.0"
EXTRAS = "dev"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")

COMMANDS = {
    "setup": [],
    "example": [str(PYTHON), "examples/train_gpt.py"],
    "hf-example": [str(PYTHON), "examples/train_hf_llama.py"],
    # Test files spread over up to 4 worker processes (pytest-xdist), one per core: most of a test's
    # time is one single-threaded Python process (tracing, planning) or ranks waiting on each other.
    "test": [str(PYTHON), "-m", "pytest", "-q", "-n", "auto", "--maxprocesses", "4", "--dist", "loadfile"],
    "docs": [str(PYTHON), "-m", "mkdocs", "build", "--strict", "--site-dir", "site"],
}


def say(message: str) -> None:
    print(f"[bootstrap] {message}", flush=True)


def run(command: list[str]) -> None:
    say("$ " + " ".join(shlex.quote(part) for part in command))
    subprocess.run(command, cwd=ROOT, check=True)


def setup_key() -> str:
    digest = hashlib.sha256()
    digest.update((ROOT / "pyproject.toml").read_bytes())
    digest.update(f"{TORCH_REQUIREMENT}|{EXTRAS}|{os.environ.get('TORCH_PIP_ARGS', '')}|{sys.version}".encode())
    return digest.hexdigest()


def setup() -> None:
    key = setup_key()
    if PYTHON.exists() and STAMP.exists() and STAMP.read_text().strip() == key:
        say(f"set-up is current ({VENV.relative_to(ROOT)}; delete it to start over)")
        return
    began = time.monotonic()
    if not PYTHON.exists():
        if sys.version_info < (3, 10):  # noqa: UP036 - this runs on whatever python3 there is
            sys.exit(f"functional_shard needs Python >= 3.10; this is {sys.version.split()[0]} ({sys.executable})")
        say(f"creating {VENV.relative_to(ROOT)} with {sys.executable} ({sys.version.split()[0]})")
        try:
            run([sys.executable, "-m", "venv", str(VENV)])
        except subprocess.CalledProcessError:
            sys.exit(
                "could not create a virtual environment: Python's venv module (with ensurepip) is missing. "
                "On Debian/Ubuntu: apt-get install python3-venv"
            )
    pip = [str(PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    say(f"installing {TORCH_REQUIREMENT} first (the CPU build where pip can find it)")
    run(pip + [TORCH_REQUIREMENT, *shlex.split(os.environ.get("TORCH_PIP_ARGS", ""))])
    say(f"installing functional_shard (editable) with the [{EXTRAS}] extra")
    # The pin again, as a constraint of this install: nothing may replace the torch just installed.
    run(pip + ["-e", f".[{EXTRAS}]", TORCH_REQUIREMENT])
    versions = (
        "import torch, functional_shard as fs; "
        "print('[bootstrap] torch', torch.__version__, '| functional_shard', fs.__version__)"
    )
    run([str(PYTHON), "-c", versions])
    STAMP.write_text(key + "\n")
    say(f"set-up done in {time.monotonic() - began:.0f} s")


def main(argv: list[str]) -> int:
    if len(argv) < 1 or argv[0] not in COMMANDS:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    what, extra = argv[0], argv[1:]
    os.chdir(ROOT)
    began = time.monotonic()
    setup()
    if COMMANDS[what]:
        try:
            run(COMMANDS[what] + extra)
        except subprocess.CalledProcessError as error:
            return error.returncode
        say(f"{what}: done in {time.monotonic() - began:.0f} s (set-up included)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
