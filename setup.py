"""Package definition. The C++ p2p-packing extension is added in megatron/csrc (see README)."""

from setuptools import find_packages, setup

setup(
    name="megatron-chimera",
    version="0.1.0",
    description="Megatron-LM-style GPT training with Chimera bidirectional pipelines",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.1", "numpy", "regex", "sentencepiece", "pybind11"],
    extras_require={"test": ["pytest"], "tensorboard": ["tensorboard"], "plot": ["matplotlib"]},
)
