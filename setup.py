"""Package discovery (the rest of the metadata is in pyproject.toml).

The import name differs from the folder name (python/ is `radixgen`, its kernels/ `radixgen.kernels`), which
pyproject's own `packages.find` cannot express, so every folder under them is found here instead of listed by
hand: a new subpackage ships in the wheel without anyone remembering to add it.
"""

from setuptools import find_namespace_packages, setup

# Files that are not Python but belong to a package: the C kernels' sources (compiled on first use), the web
# console's static files, templates and small data files.
PACKAGE_DATA = ["*.c", "*.h", "*.html", "*.js", "*.css", "*.svg", "*.png", "*.json", "*.jinja", "*.txt", "LICENSE*"]


def packages_under(folder: str, name: str) -> dict[str, str]:
    """{import name: folder} for `folder` and every folder below it (namespace folders included: csrc/ holds
    only C sources)."""
    found = {name: folder}
    for sub in find_namespace_packages(folder, exclude=["*__pycache__*"]):
        found[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return found


PACKAGES = packages_under("python", "radixgen")

setup(
    packages=sorted(PACKAGES),
    package_dir={"radixgen": "python"},
    package_data={name: PACKAGE_DATA for name in PACKAGES},
)
