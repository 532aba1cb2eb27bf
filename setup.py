"""Packaging for megatron_ext. Exact pins for development live in requirements/lock.txt (``make setup``)."""

from setuptools import find_packages, setup

setup(
    name="megatron_ext",
    version="0.1.0",
    description=(
        "Megatron-Core extensions for MoE training: self-token padding, fp8 grouped-GEMM alignment "
        "after dispatch, route-replay buffers"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    package_data={"megatron_ext": ["assets/*.jsonl"]},
    # psutil: Megatron's torch_dist checkpoint writer needs it (filesystem_async) but does not declare it.
    install_requires=["torch>=2.6", "megatron-core>=0.19.2,<0.20", "numpy", "psutil"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "hypothesis>=6"],
        # tokenizers: tools/preprocess_data.py --tokenizer-file; transformers: Megatron's
        # --tokenizer-type HuggingFaceTokenizer (AutoTokenizer) on a local tokenizer directory.
        "tools": ["tqdm", "matplotlib", "tokenizers>=0.21", "transformers>=4.51"],
        # GPU users only: importing a transformer-engine that cannot find CUDA raises RuntimeError and takes
        # `import megatron.core` down with it, so never install this extra on a CPU machine.
        "te": ["transformer-engine[pytorch]>=2.6"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:main"]},
    classifiers=["Programming Language :: Python :: 3.12", "Topic :: Scientific/Engineering"],
)
