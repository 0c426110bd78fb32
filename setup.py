"""Installs `torchtop_autostart.pth` beside the package (the rest is in pyproject.toml).

The .pth costs one environment lookup per interpreter start and does nothing unless TORCHTOP
is set; then it arms torchtop.agent.autostart (see there).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "torchtop_autostart.pth"


class build_py_with_pth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


cmdclass = {"build_py": build_py_with_pth}

try:  # PEP 660 editable installs: put the .pth into the editable wheel too
    from setuptools.command.editable_wheel import editable_wheel

    class editable_wheel_with_pth(editable_wheel):
        def _install_namespaces(self, installation_dir, pth_prefix):  # type: ignore[no-untyped-def]
            super()._install_namespaces(installation_dir, pth_prefix)
            self.copy_file(
                str(Path(__file__).parent / PTH), str(Path(installation_dir) / PTH), preserve_mode=0
            )

    cmdclass["editable_wheel"] = editable_wheel_with_pth
except ImportError:
    pass

setup(cmdclass=cmdclass)
