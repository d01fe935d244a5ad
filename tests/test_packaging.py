"""pyproject.toml installs every package of the library: a sub-package missing from its list works in an
editable install (the source tree is on the path) but is absent from a wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent


def _settings() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_on_disk() -> set[str]:
    """Every directory with an `__init__.py` under each package root, named as it is installed."""
    roots = {"hf_paged_cache": ROOT / "hf_paged_cache"}
    roots |= {name: ROOT / folder for name, folder in _settings()["package-dir"].items()}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(folder).parts]))
    return found


def test_every_package_directory_is_installed():
    listed = set(_settings()["packages"])
    on_disk = _packages_on_disk()
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "pyproject.toml lists packages that do not exist"


def test_the_kernels_are_installed_from_their_folder():
    assert _settings()["package-dir"] == {"hf_paged_cache.kernels": "kernels/src"}


def test_the_top_level_kernels_folder_is_no_package():
    """With an `__init__.py`, `kernels/` would shadow HF's `kernels` package from the repository root."""
    assert (ROOT / "kernels").is_dir() and not (ROOT / "kernels" / "__init__.py").exists()


def test_the_kernels_c_plus_plus_sources_are_installed():
    """The CPU attention kernel is compiled from its source where it runs: a wheel without the .cpp falls back silently."""
    patterns = _settings()["package-data"]["hf_paged_cache.kernels"]
    sources = sorted(path.name for path in (ROOT / "kernels" / "src").glob("*.cpp"))
    assert sources and all(any(Path(name).match(pattern) for pattern in patterns) for name in sources)
