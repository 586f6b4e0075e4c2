"""Maps the repository's top-level folders onto the `pdc.*` import namespace.

Note [Package layout]: the source tree keeps one folder per stage (compiler/, runtime/,
generated/) at the top level, but code imports them as pdc.compiler, pdc.runtime and
pdc.generated so that no bare `compiler` or `runtime` module ever lands on sys.path.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOTS = {"pdc": "pdc", "pdc.compiler": "compiler", "pdc.runtime": "runtime", "pdc.generated": "generated",
         "pdc.integrations": "integrations"}

packages, package_dir = [], {}
for name, folder in ROOTS.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(where=folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = str(Path(folder, *sub.split(".")))

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"pdc.compiler": ["templates/*.j2"]},
    include_package_data=False,
)
