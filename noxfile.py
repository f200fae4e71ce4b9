"""recsdk's sessions: per-package tests, integration, the demo, lint, typecheck, benchmarks.

Every session installs the pinned CPU stack from ``requirements/constraints.txt``: torchrec
with ``--no-deps`` (its metadata asks for the CUDA ``fbgemm-gpu``) beside ``fbgemm-gpu-cpu``,
then the local packages editable, in dependency order, also with ``--no-deps``. Virtual
environments are reused, so a second run does not reinstall torch.
"""

from __future__ import annotations

from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = "requirements/constraints.txt"
PACKAGES = ["data", "embedding", "sharding", "pipeline"]  # dependency order
# torchrec 1.8.0's own requirements, minus fbgemm-gpu (fbgemm-gpu-cpu replaces it).
STACK = ["torch", "fbgemm-gpu-cpu", "tensordict", "torchmetrics", "pyre-extensions", "iopath", "tqdm", "numpy"]
STACK += ["pyarrow"]  # recsdk-data's readers
TEST_TOOLS = ["pytest", "hypothesis", "hatchling"]

nox.options.sessions = ["lint", "typecheck", "tests", "integration"]
nox.options.reuse_venv = "yes"
nox.options.default_venv_backend = "virtualenv"


def _install(session: nox.Session, upto: str, extra: list[str] | None = None) -> None:
    """Install the pinned stack and the local packages up to ``upto`` (inclusive)."""
    session.install("-c", CONSTRAINTS, *STACK, *(extra or []))
    session.install("--no-deps", "-c", CONSTRAINTS, "torchrec")
    local = PACKAGES[: PACKAGES.index(upto) + 1]
    editable = [arg for name in local for arg in ("-e", f"packages/recsdk-{name}")]
    session.install("--no-deps", *editable)


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, with only that package and the siblings it depends on installed."""
    _install(session, package, TEST_TOOLS)
    session.run("pytest", "-q", f"packages/recsdk-{package}/tests", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """All four packages assembled: cross-package tests and the demo as a test."""
    _install(session, "pipeline", [*TEST_TOOLS, "matplotlib"])
    session.run("pytest", "-q", "tests", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the little demo, 2 ranks on this machine (``-- --steps 100`` etc. pass flags on)."""
    _install(session, "pipeline", ["matplotlib"])
    out = Path(session.create_tmp()) / "little_demo"  # summary.json and training.png; a later --out wins
    session.run("python", "examples/little_demo/main.py", "--world-size", "2", "--out", str(out), *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("-c", CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the four packages as one ``recsdk`` namespace."""
    _install(session, "pipeline", ["mypy"])
    sources = [f"packages/recsdk-{name}/src/recsdk" for name in PACKAGES]
    session.run("mypy", *sources, env={"MYPYPATH": ":".join(f"packages/recsdk-{n}/src" for n in PACKAGES)})


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in benchmarks/, each printing one JSON line per measurement.

    ``nox -s bench -- sharded_training.py --steps 10`` runs one script with its own flags.
    """
    _install(session, "pipeline", ["matplotlib"])
    if session.posargs:
        script, *flags = session.posargs
        session.run("python", str(Path("benchmarks") / Path(script).name), *flags)
        return
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        session.run("python", str(script.relative_to(ROOT)))
