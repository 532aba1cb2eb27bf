"""Where the command-line tools and example launch scripts are, in a checkout (``tools/*.py``,
``examples/*.sh``) or in an installed wheel (``megatron_ext/_tools``, ``_examples``: setup.py).
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # megatron_ext/
#: The ``megatron-ext`` subcommands that run a tool, and the script each runs (its own ``main()``).
TOOL_SCRIPTS = {
    "preprocess-data": "preprocess_data.py",
    "convert-routes": "convert_routes.py",
    "ingest-rollouts": "ingest_rollouts.py",
    "pack-stats": "pack_stats.py",
    "make-corpus": "make_corpus.py",
    "merge-datasets": "merge_datasets.py",
}


def shipped_file(kind: str, name: str) -> Path:
    """The path of ``tools/<name>`` (kind ``"tools"``) or ``examples/<name>`` (``"examples"``);
    FileNotFoundError when neither the installed package nor a checkout holds it."""
    assert kind in ("tools", "examples"), kind
    packaged = PACKAGE / f"_{kind}" / name
    # The copy inside the package wins: an installed wheel never reaches into whatever directory
    # it sits in.
    if packaged.is_file():
        return packaged
    checkout = PACKAGE.parent / kind / name
    if checkout.is_file() and (PACKAGE.parent / "pyproject.toml").is_file():
        return checkout
    raise FileNotFoundError(
        f"{kind}/{name} is neither in the installed package ({packaged.parent}) nor in a checkout "
        f"({checkout.parent}): reinstall megatron_ext"
    )
