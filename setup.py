"""Which files the wheel holds; the metadata is in pyproject.toml.

Besides the ``megatron_ext`` packages, the wheel ships the checkout's ``tools/*.py`` as
``megatron_ext/_tools`` and ``examples/*.sh`` as ``megatron_ext/_examples``, so ``megatron-ext demo`` and
``megatron-ext preprocess-data`` (etc.) run from an installed wheel; :mod:`megatron_ext.common.shipped_files`
finds them there or in the checkout.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["megatron_ext", "megatron_ext.*"]),
        "megatron_ext.assets",
        "megatron_ext._tools",
        "megatron_ext._examples",
    ],
    package_dir={"megatron_ext._tools": "tools", "megatron_ext._examples": "examples"},
)
