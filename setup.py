"""Packaging hook; the metadata lives in setup.cfg.

The CUDA sources stay at the top of the repository (cuda/), where the project's layout puts
them. A wheel has to carry them too, since kernels are compiled at run time: build_py copies
cuda/ into the built package as epserve/_cuda, where epserve/runtime/build.py looks when epserve is
installed rather than run from a checkout.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = ("*.cu", "*.cuh")


def copy_kernel_sources(source_root: Path, package_dir: Path) -> list[Path]:
    """Copy every .cu/.cuh under source_root to package_dir/_cuda, keeping the tree;
    returns the copies."""
    target = package_dir / "_cuda"
    if target.exists():
        shutil.rmtree(target)  # no stale file from an earlier build
    copies = []
    for pattern in KERNEL_SOURCES:
        for path in sorted(source_root.rglob(pattern)):
            copy = target / path.relative_to(source_root)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
            copies.append(copy)
    if not copies:
        raise SystemExit(f"epserve build: no kernel sources under {source_root}")
    return copies


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:  # an editable install reads cuda/ of the checkout itself
            copy_kernel_sources(HERE / "cuda", Path(self.build_lib) / "epserve")


setup(cmdclass={"build_py": BuildPyWithKernels})
