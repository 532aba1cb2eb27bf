"""The megatron-core versions megatron_ext supports, and which of them a running Megatron counts as.

Each supported version has its own rows and fingerprints in the table (a row names the versions it
applies on: ``Patch.versions``). A version outside :data:`TESTED_MEGATRON` is refused at startup
unless ``--allow-untested-megatron``; it then runs with the rows of the nearest tested version at
or below it (the oldest tested one below all of them): ``0.19.1 -> 0.18.2``, ``0.20.0 -> 0.19.2``.

Pure: Megatron is imported only to read the running version.
"""

import re

#: The megatron-core versions the table was checked on, oldest first (the package's pin admits
#: exactly these: pyproject.toml).
TESTED_MEGATRON = ("0.18.2", "0.19.2")


def installed_megatron() -> str:
    """The version of the Megatron-Core this process imports, from ``megatron.core.package_info``
    (in the megatron-core wheel and in a Megatron-LM source checkout on ``PYTHONPATH`` alike, with
    or without an installed distribution beside it), without a checkout's ``+<commit>`` suffix."""
    from megatron.core import package_info

    major, minor, patch, pre_release = package_info.VERSION
    return f"{major}.{minor}.{patch}{pre_release}"


def _release(version: str) -> tuple[int, ...]:
    """``"0.20.0rc1"`` -> ``(0, 20, 0)``: the release numbers (a pre-release counts as its
    release)."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def table_version(version: str | None = None) -> str:
    """The tested version whose rows apply on ``version`` (default: the running Megatron's):
    itself when tested, else the newest tested version at or below it, else the oldest."""
    version = installed_megatron() if version is None else version
    if version in TESTED_MEGATRON:
        return version
    below = [v for v in TESTED_MEGATRON if _release(v) <= _release(version)]
    return max(below, key=_release) if below else TESTED_MEGATRON[0]
