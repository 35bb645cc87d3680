"""A folder where the repository's top-level folders appear under their package names.

The package `tokenyard` is spread over shared/, services/ and kernels/ (setup.py maps them);
an editable install resolves that at import time, but mypy cannot follow an import hook, so
it would read every `tokenyard.*` import as Any. This builds, out of symbolic links,

    DEST/tokenyard/           <- a real folder holding a link to each entry of shared/
    DEST/tokenyard/services   -> services/
    DEST/tokenyard/kernels    -> kernels/

so that ``MYPYPATH=DEST mypy DEST/tokenyard`` (or ``-p tokenyard...``) type-checks across the
packages; `make typecheck` runs it.

    python scripts/package_view.py DEST
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The same mapping as setup.py's ROOTS: package -> folder.
SUBPACKAGES = {"services": "services", "kernels": "kernels"}
TOP = "shared"


def build(dest: Path, root: Path = ROOT) -> Path:
    """(Re)build the view under ``dest``; returns the folder to put on MYPYPATH."""
    package = dest / "tokenyard"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    for entry in sorted((root / TOP).iterdir()):
        if entry.name in SUBPACKAGES:
            raise RuntimeError(f"{TOP}/{entry.name} would hide the {entry.name} package")
        (package / entry.name).symlink_to(entry)
    for name, folder in SUBPACKAGES.items():
        (package / name).symlink_to(root / folder)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    build(parser.parse_args().dest)


if __name__ == "__main__":
    main()
