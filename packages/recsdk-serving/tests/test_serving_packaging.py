from pathlib import Path

from recsdk.data.testing import build_wheel_files

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def test_wheel_holds_only_recsdk_serving(tmp_path: Path) -> None:
    names = build_wheel_files(PACKAGE_DIR, tmp_path)
    payload = [n for n in names if ".dist-info/" not in n]
    assert "recsdk/__init__.py" not in names, "recsdk is a PEP 420 namespace: no recsdk/__init__.py"
    assert "recsdk/serving/__init__.py" in payload
    assert "recsdk/serving/py.typed" in payload
    outside = [n for n in payload if not n.startswith("recsdk/serving/")]
    assert outside == [], f"files outside recsdk/serving/: {outside}"


def test_source_tree_has_no_namespace_init() -> None:
    assert not (PACKAGE_DIR / "src" / "recsdk" / "__init__.py").exists()


def test_public_names_resolve() -> None:
    import recsdk.serving as pkg

    missing = [n for n in pkg.__all__ if not hasattr(pkg, n)]
    assert missing == []


def test_importing_recsdk_serving_imports_no_engine() -> None:
    """The server's engine (Ray Serve, the ``server`` extra) is imported only when a server starts."""
    import subprocess
    import sys

    code = (
        "import sys, recsdk.serving; print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'starlette')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
