"""Each distribution declares exactly what its source imports, and its tests' siblings.

For every ``packages/recsdk-<name>``, the imports of every file under ``src`` (module level and
inside functions, parsed with :mod:`ast`) are mapped to distribution names: ``recsdk.<sub>`` to
``recsdk-<sub>``, third-party modules through :data:`IMPORT_TO_DISTRIBUTION`, the standard
library (``sys.stdlib_module_names``) left out. Those must equal ``[project].dependencies``, both
ways. Modules imported lazily by name (``importlib.import_module("torch_npu")``) must equal the
optional dependencies (every extra but ``test``). The recsdk siblings the package's tests import
must come with its dependencies or its ``test`` extra, since ``nox -s tests`` installs only those.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["data", "embedding", "sharding", "pipeline", "serving"]

# Top-level import name -> the distribution a package declares for it.
IMPORT_TO_DISTRIBUTION = {
    "torch": "torch",
    "torchrec": "torchrec",
    # `fbgemm_gpu` is shipped by fbgemm-gpu (CUDA) and by fbgemm-gpu-cpu under the same name.
    # The packages declare fbgemm-gpu, as torchrec does; the CPU install (README) puts
    # fbgemm-gpu-cpu in its place, with --no-deps.
    "fbgemm_gpu": "fbgemm-gpu",
    "numpy": "numpy",
    "pyarrow": "pyarrow",
    "tqdm": "tqdm",
    "safetensors": "safetensors",
    "torch_npu": "torch-npu",
    # recsdk-serving[server]: Ray Serve, and starlette, the HTTP layer that ray[serve] brings
    "ray": "ray",
    "starlette": "ray",
}

_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = _REQUIREMENT.match(requirement)
    assert match, f"unparsable requirement {requirement!r}"
    return _normalize(match.group(1))


def _project(name: str) -> dict:
    with open(ROOT / "packages" / f"recsdk-{name}" / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _declared(name: str) -> tuple[set[str], set[str], set[str]]:
    """(dependencies, optional dependencies of every extra but ``test``, the ``test`` extra)."""
    project = _project(name)
    required = {_requirement_name(r) for r in project.get("dependencies", [])}
    extras = project.get("optional-dependencies", {})
    optional = {_requirement_name(r) for extra, reqs in extras.items() if extra != "test" for r in reqs}
    test = {_requirement_name(r) for r in extras.get("test", [])}
    return required, optional, test


def _module_names(path: Path) -> tuple[list[str], list[str]]:
    """(modules imported by ``import`` statements, modules imported by ``import_module("...")``)."""
    imported: list[str] = []
    lazy: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.append(node.module)
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), (
                    f"{path.relative_to(ROOT)}:{node.lineno}: {called}() of a computed name; "
                    "this test can only check imports of literal names"
                )
                lazy.append(arg.value)
    return imported, lazy


def _distribution(module: str, own: str, only_recsdk: bool) -> str | None:
    """The distribution that provides ``module``; None for the standard library and ``own``.

    With ``only_recsdk``, None for everything outside the ``recsdk`` namespace too.
    """
    parts = module.split(".")
    if parts[0] in sys.stdlib_module_names or (only_recsdk and parts[0] != "recsdk"):
        return None
    if parts[0] == "recsdk":
        assert len(parts) > 1, "recsdk is a PEP 420 namespace: import one of its packages"
        dist = f"recsdk-{parts[1]}"
        return None if dist == own else dist
    if parts[0] not in IMPORT_TO_DISTRIBUTION:
        raise AssertionError(
            f"{own} imports {module!r}, which is not in IMPORT_TO_DISTRIBUTION: add the distribution that provides it"
        )
    return IMPORT_TO_DISTRIBUTION[parts[0]]


def _imports(name: str, folder: str, only_recsdk: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Distribution -> the files importing it, for ``import`` statements and for lazy imports."""
    own = f"recsdk-{name}"
    base = ROOT / "packages" / own / folder
    imported: dict[str, set[str]] = {}
    lazy: dict[str, set[str]] = {}
    for path in sorted(base.rglob("*.py")):
        statements, by_name = _module_names(path)
        for modules, found in ((statements, imported), (by_name, lazy)):
            for module in modules:
                dist = _distribution(module, own, only_recsdk)
                if dist is not None:
                    found.setdefault(dist, set()).add(str(path.relative_to(base)))
    return imported, lazy


def _difference(package: str, what: str, declared: set[str], imported: dict[str, set[str]]) -> str:
    unused = sorted(declared - set(imported))
    undeclared = {d: sorted(files) for d, files in sorted(imported.items()) if d not in declared}
    return (
        f"recsdk-{package}: {what} differ from what src imports: declared but never imported {unused}; "
        f"imported but not declared {undeclared} (distribution: importing files)"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_dependencies_are_what_the_source_imports(package: str) -> None:
    required, _, _ = _declared(package)
    imported, _ = _imports(package, "src")
    assert required == set(imported), _difference(package, "[project].dependencies", required, imported)


@pytest.mark.parametrize("package", PACKAGES)
def test_optional_dependencies_are_what_the_source_imports_lazily(package: str) -> None:
    required, optional, _ = _declared(package)
    _, lazy = _imports(package, "src")
    only_lazy = {d: files for d, files in lazy.items() if d not in required}
    assert optional == set(only_lazy), _difference(package, "optional dependencies (extras but test)", optional, lazy)


def _siblings_closure(names: set[str]) -> set[str]:
    """``names`` (recsdk distributions) and the recsdk distributions they depend on, transitively."""
    seen: set[str] = set()
    todo = sorted(names)
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        required, _, _ = _declared(dist.removeprefix("recsdk-"))
        todo += [d for d in required if d.startswith("recsdk-")]
    return seen


@pytest.mark.parametrize("package", PACKAGES)
def test_tests_import_only_declared_siblings(package: str) -> None:
    required, _, test = _declared(package)
    installed = _siblings_closure({d for d in required | test if d.startswith("recsdk-")} | {f"recsdk-{package}"})
    imported, lazy = _imports(package, "tests", only_recsdk=True)
    missing = {d: sorted(files) for d, files in {**imported, **lazy}.items() if d not in installed}
    assert missing == {}, (
        f"recsdk-{package}: its tests import recsdk packages that neither its dependencies nor its test extra "
        f"bring (nox -s tests installs only those): {missing}"
    )
