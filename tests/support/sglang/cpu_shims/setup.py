"""Installs the CPU test shims for SGLang (sgl_kernel stand-in, torchvision op schemas).

The .pth file must land at the top of site-packages to run at interpreter start; setuptools has
no option for that, so build_py copies it next to the modules (as setuptools does for its own
distutils-precedence.pth).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "pdc_sglang_cpu_shims.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))


setup(
    name="pdc-sglang-cpu-shims",
    version="0.0.1",
    description="pdc test support: let SGLang 0.5.23 run on a CPU-only machine",
    packages=["sgl_kernel"],
    py_modules=["pdc_torchvision_cpu_shim", "pdc_sglang_cpu_paths"],
    cmdclass={"build_py": BuildPyWithPth},
)
