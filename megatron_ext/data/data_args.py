"""Checks of Megatron's data flags at argument time, so ``--dry-run`` checks the data too (glue).

Megatron opens ``--data-path`` files only when it builds datasets, minutes into a launch::

    --data-path 0.3 /d/a nan /d/b   ->  ValueError: --data-path weight 'nan' for /d/b must be ...
"""

import argparse
import os

from megatron.core.datasets.utils import get_blend_from_list

from megatron_ext.config.megatron_view import MegatronView

DATA_PATH_ARGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def data_prefixes(args: argparse.Namespace) -> list[tuple[str, list[str], list[float] | None]]:
    """``[(flag, prefixes, weights or None)]`` of every data-path flag that is set, including the
    prefixes listed in a local ``--data-args-path`` / ``--per-split-data-args-path`` file (one
    missing or not what Megatron expects: ValueError naming it)."""
    found = []
    view = MegatronView.from_args(args)
    for name in DATA_PATH_ARGS:
        value = getattr(view, name)
        if value:
            prefixes, weights = get_blend_from_list(list(value))
            found.append(("--" + name.replace("_", "-"), prefixes, weights))
    for flag, entries in _listed_data_paths(view):
        prefixes, weights = get_blend_from_list(entries)
        found.append((flag, prefixes, weights))
    return found


def _listed_data_paths(view: MegatronView) -> list[tuple[str, list[str]]]:
    """The data paths inside ``--data-args-path`` (whitespace-separated) and
    ``--per-split-data-args-path`` (JSON ``{"train": ..., "valid": ..., "test": ...}``)."""
    import json

    # Read as Megatron's get_blend_and_blend_per_split reads them.
    listed = []
    path = view.data_args_path
    if path and not _is_remote(path):
        entries = _read_list_file(path, "--data-args-path").split()
        listed.append((f"--data-args-path {path}", entries))
    path = view.per_split_data_args_path
    if path and not _is_remote(path):
        flag = "--per-split-data-args-path"
        try:
            splits = json.loads(_read_list_file(path, flag))
        except json.JSONDecodeError as err:
            raise ValueError(f"{flag} {path} is not valid JSON ({err})") from err
        if not isinstance(splits, dict) or not {"train", "valid", "test"} <= splits.keys():
            raise ValueError(f'{flag} {path} needs "train", "valid" and "test" entries')
        for split in ("train", "valid", "test"):
            value = splits[split]
            entries = value.split() if isinstance(value, str) else list(value or [])
            if entries:
                listed.append((f"{flag} {path} ({split})", [str(e) for e in entries]))
    return listed


def _is_remote(path: str) -> bool:
    return "://" in path  # msc:// and other object storage: Megatron opens it itself


def _read_list_file(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot read it ({err.strerror})") from err


def check_data_args(
    args: argparse.Namespace, loss_mask_suffix: str | None, *, jsonl: bool = False
) -> None:
    """Refuses missing or empty data files and unusable blend weights, naming the flag and prefix.

    ``jsonl``: the paths are JSONL files (Megatron's ``--sft``), not IndexedDataset prefixes.
    """
    if MegatronView.from_args(args).mock_data:  # Megatron's synthetic data: no files to check
        return
    for flag, prefixes, weights in data_prefixes(args):
        if weights is not None:
            from megatron_ext.data.indexed_checks import check_blend_weights

            check_blend_weights(flag, prefixes, weights)
        for prefix in prefixes:
            if jsonl:
                if not os.path.isfile(prefix):
                    raise ValueError(f"{flag} {prefix}: no such JSONL file (--sft reads JSONL)")
                continue
            suffixes = [("", "data")]
            if loss_mask_suffix:
                suffixes.append((loss_mask_suffix, "--pack-loss-mask-suffix sidecar"))
            for suffix, what in suffixes:
                for ext in (".bin", ".idx"):
                    path = prefix + suffix + ext
                    if not os.path.isfile(path):
                        raise ValueError(
                            f"{flag} prefix {prefix}: {what} file {path} does not exist"
                        )
                    # Megatron cannot map an empty .bin, and it holds nothing to train on.
                    if ext == ".bin" and os.path.getsize(path) == 0:
                        from megatron_ext.data.indexed_checks import empty_bin_reason

                        raise ValueError(f"{flag} prefix {prefix}: {empty_bin_reason(path, what)}")
