"""Argument-time check that Megatron's evaluation has validation data (glue over Megatron's split math).

Megatron 0.19.2 evaluates whenever ``--eval-iters > 0`` or ``--full-validation``, even on an empty
validation split: the run trains and then crashes in its first evaluation. Example::

    --data-path /d/text --split 100,0,0 --eval-iters 10
    -> ValueError: --eval-iters 10 evaluates on the validation split, but --split 100,0,0 gives it
       no data: set --eval-iters 0 or give validation data (a non-zero validation weight in --split)
"""

import argparse
import json
import os

from megatron_ext.config.megatron_view import MegatronView


def empty_validation_source(args: argparse.Namespace) -> str | None:
    """The flag that leaves Megatron's validation split empty (``"--split 100,0,0"``), else None,
    exactly as Megatron's dataset builder decides it."""
    # A non-zero weight that rounds to no documents depends on the data: the datasets refuse it
    # when they are built (megatron_ext.data.empty_split).
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    view = MegatronView.from_args(args)
    if view.data_path or view.data_args_path:
        split = view.split
        if split is None:  # validate_args sets Megatron's legacy default "969, 30, 1"
            return None
        # A validation weight of 0 (100,0,0, 100, 99,0,1): the split matrix has no such range.
        if convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[1] is None:
            return f"--split {split}"
        return None
    if view.train_data_path or view.valid_data_path or view.test_data_path:
        return None if view.valid_data_path else "--train-data-path without --valid-data-path"
    per_split = view.per_split_data_args_path
    if per_split and os.path.isfile(per_split):  # a remote (msc://) file is left to Megatron
        with open(per_split) as f:
            valid = json.load(f).get("valid")
        return None if valid else f'--per-split-data-args-path {per_split} (no "valid" entry)'
    return None


def split_weights(split: str) -> list[float]:
    """``--split``'s weights, refusing what Megatron's ``parse_and_normalize_split`` would misread:
    NaN from ``0,0,0`` or ``abc`` (the run fails after the model is built), an assertion on four
    weights, negative weights normalised into another split.

    Raises:
        ValueError: Naming ``--split`` and what is wrong.
    """
    parts = [p.strip() for p in str(split).replace("/", ",").split(",")]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split}: weights must be numbers, e.g. 969,30,1") from None
    if len(weights) > 3:
        raise ValueError(f"--split {split}: at most three weights (train, validation, test)")
    if any(not (w >= 0) or w == float("inf") for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split}: weights must be finite, >= 0 and not all 0")
    return weights


def check_split(args: argparse.Namespace) -> None:
    """Refuses a ``--split`` Megatron would misread (:func:`split_weights`) or that leaves training
    nothing.

    Raises:
        ValueError: Naming ``--split`` and what is wrong.
    """
    view = MegatronView.from_args(args)
    split = view.split
    if split is None or not (view.data_path or view.data_args_path):
        return  # Megatron's default, or a per-split data path (--split is not used)
    weights = split_weights(split)
    # 0,100,0: the run would "train" 0 iterations and exit 0.
    training = (view.train_iters or view.train_samples or 0) > 0
    if weights[0] == 0 and training and not view.skip_train:
        raise ValueError(
            f"--split {split} gives the training split no data, so nothing would be trained: give "
            "it a non-zero first weight (or --skip-train to only evaluate)"
        )


def check_evaluation_data(args: argparse.Namespace) -> None:
    """Refuses an evaluation Megatron would run on an empty validation split.

    Raises:
        ValueError: Naming the evaluation flag, the data flag that empties the split and the fix.
    """
    view = MegatronView.from_args(args)
    # RL evaluates without these datasets; mock data (also without any data path) splits evenly.
    if view.perform_rl_step or view.mock_data:
        return
    eval_iters = view.eval_iters or 0
    full_validation = bool(view.full_validation)
    if eval_iters <= 0 and not full_validation:
        return
    # Every --eval-interval and once after training (under --skip-train too). An empty split
    # builds no data loader yet do_valid is set: forward_step gets no batch, and
    # --full-validation fails on len(None) while building the iterators.
    source = empty_validation_source(args)
    if source is None:
        return
    evaluating = f"--eval-iters {eval_iters}" if eval_iters > 0 else "--full-validation"
    default = (
        " (Megatron's default when not given)"
        if eval_iters == 100 and "--eval-iters" in evaluating
        else ""
    )
    fix = "set --eval-iters 0" + (" and drop --full-validation" if full_validation else "")
    raise ValueError(
        f"{evaluating}{default} evaluates on the validation split (every --eval-interval "
        f"iterations and once after training), but {source} gives it no data: {fix}, or give "
        "validation data (a non-zero validation weight in --split, or --valid-data-path)"
    )
