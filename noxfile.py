"""recsdk's sessions: per-package tests, integration, the demo, lint, typecheck, benchmarks.

Every session installs the pinned CPU stack from ``requirements/constraints.txt``: torchrec
with ``--no-deps`` (its metadata asks for the CUDA ``fbgemm-gpu``) beside ``fbgemm-gpu-cpu``,
then local packages editable, also with ``--no-deps``: a package's ``tests`` session only the
recsdk packages its ``pyproject.toml`` declares (dependencies and ``test`` extra, transitively),
the other sessions all five. Virtual environments are reused, so a second run does not
reinstall torch.
"""

from __future__ import annotations

import re
from pathlib import Path

import nox

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10; nox itself requires tomli there
    import tomli as tomllib

ROOT = Path(__file__).parent
CONSTRAINTS = "requirements/constraints.txt"
PACKAGES = ["data", "embedding", "sharding", "pipeline", "serving"]  # a package imports only ones before it
# torchrec 1.8.0's own requirements, minus fbgemm-gpu (fbgemm-gpu-cpu replaces it).
STACK = ["torch", "fbgemm-gpu-cpu", "tensordict", "torchmetrics", "pyre-extensions", "iopath", "tqdm", "numpy"]
STACK += ["pyarrow", "safetensors"]  # recsdk-data's readers; published versions
TEST_TOOLS = ["pytest", "hypothesis", "hatchling", "torchdata"]  # torchdata: StatefulDataLoader (data position tests)
# A package's tests session also installs its extras' third-party packages: recsdk-serving[server]
# (Ray Serve), whose tests start the real server.
SESSION_EXTRAS = {"serving": ["ray[serve]"]}

nox.options.sessions = ["lint", "typecheck", "tests", "integration"]
nox.options.reuse_venv = "yes"
nox.options.default_venv_backend = "virtualenv"


def _declared_siblings(package: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The recsdk packages (``"data"``, ...) that ``recsdk-<package>`` requires, directly.

    Read from its ``pyproject.toml``: ``[project].dependencies`` and the named ``extras``.
    """
    with open(ROOT / "packages" / f"recsdk-{package}" / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    requirements = list(project.get("dependencies", []))
    for extra in extras:
        requirements += project.get("optional-dependencies", {}).get(extra, [])
    names = (re.match(r"\s*recsdk-([a-z]+)", r) for r in requirements)
    return {m.group(1) for m in names if m}


def _local_packages(package: str) -> list[str]:
    """``package`` and the recsdk packages its tests need: its dependencies and ``test`` extra, transitively."""
    needed: set[str] = set()
    todo = {package} | _declared_siblings(package, extras=("test",))
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo |= _declared_siblings(name)
    return [name for name in PACKAGES if name in needed]


def _install(session: nox.Session, local: list[str], extra: list[str] | None = None) -> None:
    """Install the pinned stack and the ``local`` recsdk packages (editable, ``--no-deps``).

    ``--no-compile``: pip would byte-compile every module of torch and the rest up front (about
    half of a fresh install's time here); Python compiles and caches the ones a session imports.
    """
    session.install("--no-compile", "-c", CONSTRAINTS, *STACK, *(extra or []))
    session.install("--no-compile", "--no-deps", "-c", CONSTRAINTS, "torchrec")
    editable = [arg for name in local for arg in ("-e", f"packages/recsdk-{name}")]
    session.install("--no-deps", *editable)


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, with only that package and the siblings it declares installed."""
    _install(session, _local_packages(package), TEST_TOOLS + SESSION_EXTRAS.get(package, []))
    session.run("pytest", "-q", f"packages/recsdk-{package}/tests", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """All five packages assembled: cross-package tests and the demo as a test.

    Only pytest of the test tools: no test here builds a wheel (hatchling) or draws examples
    (hypothesis); torchdata and matplotlib are the demo's.
    """
    _install(session, PACKAGES, ["pytest", "torchdata", "matplotlib"])
    session.run("pytest", "-q", "tests", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the little demo, 2 ranks on this machine (``-- --steps 100`` etc. pass flags on)."""
    _install(session, PACKAGES, ["matplotlib", "torchdata"])
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
    """mypy over the five packages as one ``recsdk`` namespace."""
    _install(session, PACKAGES, ["mypy"])
    sources = [f"packages/recsdk-{name}/src/recsdk" for name in PACKAGES]
    session.run("mypy", *sources, env={"MYPYPATH": ":".join(f"packages/recsdk-{n}/src" for n in PACKAGES)})


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in benchmarks/, each printing one JSON line per measurement.

    ``nox -s bench -- sharded_training.py --steps 10`` runs one script with its own flags.
    """
    # py-spy: host_stage.py samples the GIL its host stage holds (benchmarks/_gil_sampler.py).
    _install(session, PACKAGES, ["matplotlib", "torchdata", "py-spy"])
    if session.posargs:
        script, *flags = session.posargs
        session.run("python", str(Path("benchmarks") / Path(script).name), *flags)
        return
    for script in sorted((ROOT / "benchmarks").glob("[!_]*.py")):  # not _common.py: shared code
        session.run("python", str(script.relative_to(ROOT)))
