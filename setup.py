"""Package definition, with the optional C++ p2p-packing extension (megatron/csrc/packing.cpp).

The same library also holds A2SGD's fused CPU passes (megatron/csrc/a2sgd.cpp, registered as the
torch operators torch.ops.megatron_a2sgd.*; megatron/core/distributed/a2sgd_kernel.py). They are
only in the setup.py build: the packing module's compile-on-first-use builds packing.cpp alone, and
without the operators A2SGD uses its torch passes.

The extension is built when torch is importable at build time, which needs
`pip install --no-build-isolation -e .` (an isolated build environment has no torch). Without torch,
or when compilation fails, the package installs without it: megatron.core.pipeline_parallel.execution.packing
then compiles it on first use, or falls back to its byte-identical pure-Python implementation.
Set MEGATRON_SKIP_CPP_EXTENSION=1 to skip the build on purpose.
"""

import os
import sys

from setuptools import find_packages, setup

PACKING_SOURCE = "megatron/csrc/packing.cpp"
# A2SGD's fused CPU passes, registered as torch operators by the same library (see a2sgd.cpp).
A2SGD_SOURCE = "megatron/csrc/a2sgd.cpp"


def packing_extension():
    """(ext_modules, cmdclass) for the packing extension, or empty ones when it cannot be built."""
    if os.environ.get("MEGATRON_SKIP_CPP_EXTENSION") == "1":
        print("megatron-chimera: MEGATRON_SKIP_CPP_EXTENSION=1, not building the C++ packing "
              "extension", file=sys.stderr)
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("megatron-chimera: torch is not importable at build time, so the C++ packing "
              "extension is not built (it is compiled on first use instead); to build it now, "
              "install torch first and use `pip install --no-build-isolation -e .`",
              file=sys.stderr)
        return [], {}

    class OptionalBuildExtension(BuildExtension):
        """Warns instead of failing the install when the optional extension does not compile."""

        # torch checks the compiler in build_extensions before building anything, so the whole
        # step is guarded, not only build_extension.
        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as error:  # compiler problems surface as several exception types
                if not all(getattr(ext, "optional", False) for ext in self.extensions):
                    raise
                print(f"megatron-chimera: building the C++ packing extension failed "
                      f"({type(error).__name__}: {error}); installing without it, it will be "
                      f"compiled on first use if possible, else the Python implementation is used",
                      file=sys.stderr)

    extension = CppExtension(
        name="megatron._packing_cpp",
        sources=[PACKING_SOURCE, A2SGD_SOURCE],
        extra_compile_args=["-O3"],
        optional=True,
    )
    return [extension], {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = packing_extension()

setup(
    name="megatron-chimera",
    version="0.1.0",
    description="Megatron-LM-style GPT training with Chimera bidirectional pipelines",
    packages=find_packages(include=["megatron", "megatron.*"]),
    # The C++ source ships with the package so that compilation on first use works after a
    # non-editable install too.
    package_data={"megatron": ["csrc/*.cpp"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.1", "numpy", "regex", "sentencepiece", "pybind11"],
    extras_require={"test": ["pytest", "matplotlib", "transformers", "safetensors",
                             "tensorboard", "wandb", "ruff==0.17.5", "mypy==2.4.1", "isal"],
                    "fast-crc": ["isal"],  # checkpoint CRC-32s with ISA-L (else zlib's)
                    "tensorboard": ["tensorboard"], "wandb": ["wandb"], "plot": ["matplotlib"],
                    "hf": ["safetensors", "transformers"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
