"""Maps the repository's top-level folders onto one import package, `tokenyard`.

shared/ -> tokenyard, services/ -> tokenyard.services, kernels/ -> tokenyard.kernels.
Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = {"tokenyard": "shared", "tokenyard.services": "services", "tokenyard.kernels": "kernels"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for name, folder in ROOTS.items():
        package_dir[name] = folder
        packages.append(name)
        for sub in find_packages(folder):
            packages.append(f"{name}.{sub}")
            package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return packages, package_dir


packages, package_dir = _packages()
# NOTE: package data lives in pyproject.toml: there it replaced a package_data given here,
# and a non-editable install (the image) went without the CPU kernels' sources.
setup(packages=packages, package_dir=package_dir)
