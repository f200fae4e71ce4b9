"""How long code holds the GIL, sampled from outside the process by py-spy.

``py-spy record --gil`` samples only the threads that hold the GIL at each tick, so the samples
whose stack passes through a given function, divided by the rate, are the seconds that function
held the GIL. Unlike a probe thread spinning in Python (which competes for the GIL and the cores
with what it measures, and reads high on a busy machine), the sampler reads the interpreter's
state from another process: it takes nothing from the GIL. Shared by the benchmarks (not a
recsdk dependency); where py-spy is not installed or may not attach (ptrace), :func:`sampler_or_why`
says why and the caller falls back to its probe.

Example::

    sampler, why = sampler_or_why()
    if sampler is not None:
        with sampler.sampling() as samples:
            work()
        held_s = samples.held_s("work")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

__all__ = ["GilSampler", "Samples", "sampler_or_why"]

RATE_HZ = 1000  # samples per second: 1 ms a sample (py-spy's ceiling is a few kHz)
_ATTACH_TIMEOUT_S = 20.0


class Samples:
    """The stacks py-spy recorded while they held the GIL (py-spy's raw format: one line per
    distinct stack, ``thread (tid): name;frame;...;frame count``).

    Args:
        lines (list[str]): the raw file's lines.
        rate_hz (int): the sampling rate.
    """

    def __init__(self, lines: list[str], rate_hz: int) -> None:
        self._stacks: list[tuple[str, int]] = []
        self._rate = rate_hz
        self.add(lines)

    def add(self, lines: list[str]) -> None:
        """Take in raw lines (py-spy's file, read once it has stopped)."""
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if stack and count.isdigit():
                self._stacks.append((stack, int(count)))

    def held_s(self, *functions: str) -> float:
        """Seconds the GIL was held by stacks that pass through one of ``functions``, each stack
        counted once. A name matches a frame's function or the end of its qualified name (py-spy
        names ``f`` nested in ``g`` ``g.<locals>.f``, a method ``Class.method``)."""
        wanted = set(functions)
        return sum(n for stack, n in self._stacks if any(_matches(f, wanted) for f in _functions(stack))) / self._rate

    def held_s_by(self, parts: dict[str, str], within: tuple[str, ...]) -> dict[str, float]:
        """:meth:`held_s` of the stacks through ``within``, split by part: each stack goes to the
        innermost of its functions named in ``parts`` (function -> part; ``"other"``: none).

        Returns:
            dict[str, float]: seconds per part.
        """
        wanted, out = set(within), defaultdict(float)
        for stack, n in self._stacks:
            functions = _functions(stack)
            if not any(_matches(f, wanted) for f in functions):
                continue
            part = next((p for f in reversed(functions) for p in _part_of(f, parts)), "other")
            out[part] += n / self._rate
        return dict(out)


def _functions(stack: str) -> list[str]:
    """The function names of a raw stack, outermost first (``name (file:line)`` frames)."""
    return [frame.rpartition(" (")[0] for frame in stack.split(";")[1:]]


def _matches(function: str, names: set[str]) -> bool:
    return function in names or function.rpartition(".")[2] in names


def _part_of(function: str, parts: dict[str, str]) -> list[str]:
    part = parts.get(function)
    return [part] if part is not None else []


class GilSampler:
    """Runs ``py-spy record --gil`` on this process while :meth:`sampling` is open.

    Args:
        exe (str): the py-spy executable.
        rate_hz (int): samples per second.
    """

    def __init__(self, exe: str, rate_hz: int = RATE_HZ) -> None:
        self._exe = exe
        self.rate_hz = rate_hz

    @contextlib.contextmanager
    def sampling(self) -> Iterator[Samples]:
        """Sample this process from entry to exit; the :class:`Samples` are filled at exit.

        Raises:
            RuntimeError: py-spy did not attach (its message).
        """
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "raw.txt"
            cmd = [self._exe, "record", "--pid", str(os.getpid()), "--gil", "--threads", "--rate", str(self.rate_hz)]
            cmd += ["--format", "raw", "--output", str(out), "--nonblocking"]
            # py-spy says on stdout when it samples ("py-spy> Sampling process ..."), errors too.
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            attached = threading.Event()
            said: list[str] = []

            def read_output() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    said.append(line)
                    if "Sampling process" in line:
                        attached.set()

            reader = threading.Thread(target=read_output, daemon=True)
            reader.start()
            deadline = time.monotonic() + _ATTACH_TIMEOUT_S
            while not attached.is_set() and proc.poll() is None and time.monotonic() < deadline:
                attached.wait(0.05)
            if not attached.is_set():
                proc.kill()
                proc.wait()
                raise RuntimeError(f"py-spy did not attach: {''.join(said).strip() or 'no message'}")
            samples = Samples([], self.rate_hz)
            try:
                yield samples
            finally:
                proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
                proc.wait(timeout=60)
                reader.join(timeout=5)
            if out.exists():
                samples.add(out.read_text().splitlines())


def sampler_or_why() -> tuple[GilSampler | None, str]:
    """A :class:`GilSampler` that attaches here, or None and why not (py-spy missing, or not
    allowed to attach: it needs ptrace on this process)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None, "py-spy not installed (pip install py-spy)"
    sampler = GilSampler(exe)
    try:
        with sampler.sampling():
            time.sleep(0.05)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return None, str(e).splitlines()[0]
    return sampler, f"py-spy --gil at {RATE_HZ} Hz"
