"""Tier: pure (argparse namespaces). ``check_split``: a ``--split`` Megatron would misread (NaN
weights, an assertion, negative weights normalised away) or that leaves training no data is
refused naming the flag; ordinary splits pass."""

import argparse
import re

import pytest

from megatron_ext.training.eval_args import check_split


def _args(split, **kw) -> argparse.Namespace:
    return argparse.Namespace(**{"split": split, "data_path": ["/d/text"], "train_iters": 4, **kw})


@pytest.mark.parametrize(
    "split, match",
    [
        ("0,0,0", "finite, >= 0 and not all 0"),
        ("-1,2,0", "finite, >= 0 and not all 0"),
        ("nan,1,0", "finite, >= 0 and not all 0"),
        ("abc", "weights must be numbers"),
        ("1,1,1,1", "at most three weights"),
        ("0,100,0", "gives the training split no data"),
    ],
)
def test_bad_splits_are_refused_naming_the_flag(split: str, match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)) as err:
        check_split(_args(split))
    assert str(err.value).startswith(f"--split {split}")


def test_ordinary_splits_and_where_split_is_not_read_pass() -> None:
    for split in ("969,30,1", "100", "99,1", "98/2/0", "100,0,0"):
        check_split(_args(split))
    check_split(_args("0,100,0", skip_train=True))  # evaluation only: training needs no data
    check_split(_args("0,0,0", data_path=None))  # per-split paths: Megatron ignores --split
    check_split(_args(None))  # Megatron's default
