"""Tier: pure (argparse namespaces) for ``check_split``; Megatron on one process (the entry's
``--dry-run`` in this process) for ``check_evaluation_data``.

``check_split``: a ``--split`` Megatron would misread (NaN weights, an assertion, negative weights
normalised away) or that leaves training no data is refused naming the flag; ordinary splits pass.
``check_evaluation_data``: an evaluation (``--eval-iters``, Megatron's default 100, or
``--full-validation``) on an empty validation split (a 0 validation weight in ``--split``,
``--train-data-path`` without ``--valid-data-path``) is refused by the dry run naming both flags;
validation data, no evaluation or mock data pass.
"""

import argparse
import re

import pytest

from megatron_ext.training.eval_args import check_split
from tests.training.entry_args import dry_run_main


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


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--split", "100,0,0", "--eval-iters", "5", "--eval-interval", "2"], ["--eval-iters 5"]),
        # Megatron's default --eval-iters 100 evaluates after training (and every interval).
        (["--split", "100,0,0", "--eval-interval", "9"], ["--eval-iters 100 (Megatron's default"]),
        (["--split", "99,0,1", "--eval-iters", "1", "--skip-train"], ["--split 99,0,1"]),
        (["--split", "100", "--eval-iters", "0", "--full-validation"], ["--full-validation"]),
    ],
)
def test_evaluation_on_an_empty_validation_split_is_refused_at_argument_time(
    flags, named, data_prefix, monkeypatch, capsys
) -> None:
    assert dry_run_main(["--data-path", data_prefix, *flags], monkeypatch) == 2
    err = capsys.readouterr().err
    assert "megatron_ext: invalid arguments:" in err
    assert "--split" in err and "--eval-iters 0" in err and "validation data" in err
    for text in named:
        assert text in err


def test_evaluation_without_valid_data_path_is_refused(data_prefix, monkeypatch, capsys) -> None:
    argv = ["--train-data-path", data_prefix, "--eval-iters", "1", "--eval-interval", "2"]
    assert dry_run_main(argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert "--eval-iters 1" in err and "--train-data-path without --valid-data-path" in err
    assert "set --eval-iters 0" in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--split", "99,1,0", "--eval-iters", "1", "--eval-interval", "2"],  # validation weight
        ["--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000"],  # no evaluation
        ["--mock-data", "--eval-iters", "1", "--eval-interval", "5"],  # mock data: an even split
    ],
)
def test_evaluation_with_validation_data_or_none_passes(
    flags, data_prefix, monkeypatch, capsys
) -> None:
    argv = flags if "--mock-data" in flags else ["--data-path", data_prefix, *flags]
    assert dry_run_main(argv, monkeypatch) == 0, capsys.readouterr().err
    assert "megatron_ext: dry run OK" in capsys.readouterr().out


def test_per_split_evaluation_with_valid_data_path_passes(data_prefix, monkeypatch, capsys) -> None:
    argv = ["--train-data-path", data_prefix, "--valid-data-path", data_prefix, "--eval-iters", "1"]
    argv += ["--eval-interval", "5"]
    assert dry_run_main(argv, monkeypatch) == 0, capsys.readouterr().err
