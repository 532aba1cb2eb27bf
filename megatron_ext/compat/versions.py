"""The megatron-core versions megatron_ext supports, and which of them a running Megatron counts as.

An untested version (run with ``--allow-untested-megatron``) takes the rows of the nearest tested
version at or below it: ``0.19.1 -> 0.18.2``, ``0.20.0 -> 0.19.2``. Megatron is imported only to
read the running version.
"""

import re

#: The megatron-core versions the table was checked on, oldest first (the package's pin admits
#: exactly these: pyproject.toml).
TESTED_MEGATRON = ("0.18.2", "0.19.2")


def installed_megatron() -> str:
    """The version of the Megatron-Core this process imports, without a checkout's ``+<commit>``."""
    # package_info, not the distribution's metadata: it is in the megatron-core wheel and in a
    # Megatron-LM source checkout on PYTHONPATH alike, with or without a distribution beside it.
    from megatron.core import package_info

    major, minor, patch, pre_release = package_info.VERSION
    return f"{major}.{minor}.{patch}{pre_release}"


def _release(version: str) -> tuple[int, ...]:
    """``"0.20.0rc1"`` -> ``(0, 20, 0)``: a pre-release counts as its release."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def table_version(version: str | None = None) -> str:
    """The tested version whose rows apply on ``version`` (default: the running Megatron's):
    itself when tested, else the newest tested version at or below it, else the oldest."""
    version = installed_megatron() if version is None else version
    if version in TESTED_MEGATRON:
        return version
    # Older than every tested version: the oldest tested one's rows.
    below = [v for v in TESTED_MEGATRON if _release(v) <= _release(version)]
    return max(below, key=_release) if below else TESTED_MEGATRON[0]
