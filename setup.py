"""Hooks the proto stub generation into the build, so `pip install .` works from a clone."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProtos(build_py):
    def run(self) -> None:
        script = Path(__file__).parent / "scripts" / "gen_protos.py"
        spec = importlib.util.spec_from_file_location("gen_protos", script)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.generate()
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
