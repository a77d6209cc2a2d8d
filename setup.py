"""Package layout: three source roots mapped into one ``quantpatch`` package.

``find_packages`` runs once per root so that a new subpackage is never dropped from the
wheel (a hand-written list would be); ``tests/test_packaging.py`` checks the built wheel.
"""

from setuptools import find_packages, setup

ROOTS = {"quantpatch": "src/quantpatch", "quantpatch.kernels": "kernels", "quantpatch.patches": "patches"}

packages, package_dir = [], {}
for package, root in ROOTS.items():
    package_dir[package] = root
    packages.append(package)
    packages.extend(f"{package}.{sub}" for sub in find_packages(root))

setup(packages=packages, package_dir=package_dir)
