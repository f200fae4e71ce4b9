"""The five distributions assembled into one ``recsdk`` namespace, with one-way dependencies."""

import ast
from pathlib import Path

import recsdk
import recsdk.data
import recsdk.embedding
import recsdk.pipeline
import recsdk.serving
import recsdk.sharding

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["data", "embedding", "sharding", "pipeline", "serving"]


def test_namespace_spans_the_five_distributions() -> None:
    assert not hasattr(recsdk, "__file__") or recsdk.__file__ is None, "recsdk must be a PEP 420 namespace"
    parts = sorted(Path(p).parent.parent.name for p in recsdk.__path__)
    assert parts == sorted(f"recsdk-{n}" for n in ORDER)


def _imported_subpackages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        found |= {n.split(".")[1] for n in names if n.startswith("recsdk.") and n.count(".") >= 1}
    return found


def test_dependencies_point_one_way() -> None:
    wrong = []
    for i, name in enumerate(ORDER):
        allowed = set(ORDER[: i + 1])
        for path in (ROOT / "packages" / f"recsdk-{name}" / "src").rglob("*.py"):
            bad = _imported_subpackages(path) - allowed
            if bad:
                wrong.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert wrong == []
