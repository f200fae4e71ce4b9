from pathlib import Path

from recsdk.data.testing import build_wheel_files

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def test_wheel_holds_only_recsdk_embedding(tmp_path: Path) -> None:
    names = build_wheel_files(PACKAGE_DIR, tmp_path)
    payload = [n for n in names if ".dist-info/" not in n]
    assert "recsdk/__init__.py" not in names, "recsdk is a PEP 420 namespace: no recsdk/__init__.py"
    assert "recsdk/embedding/__init__.py" in payload
    assert "recsdk/embedding/py.typed" in payload
    assert "recsdk/embedding/slot_kernels.c" in payload  # compiled on first use
    assert "recsdk/embedding/slot_lookup.c" in payload
    outside = [n for n in payload if not n.startswith("recsdk/embedding/")]
    assert outside == [], f"files outside recsdk/embedding/: {outside}"


def test_source_tree_has_no_namespace_init() -> None:
    assert not (PACKAGE_DIR / "src" / "recsdk" / "__init__.py").exists()


def test_public_names_resolve() -> None:
    import recsdk.embedding as pkg

    missing = [n for n in pkg.__all__ if not hasattr(pkg, n)]
    assert missing == []
