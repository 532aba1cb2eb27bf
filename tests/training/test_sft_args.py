"""Tier: Megatron's argument parser on one process (``parse_args``, then megatron_ext's one validation
path): what ``--sft`` needs and what it refuses, in one line, before anything is built."""

import sys
import warnings

import pytest

from tests.training.entry_args import BASE_ARGS


def _args(monkeypatch, sft_data, *extra: str, tokenizer: tuple[str, ...] | None = None):
    from megatron.training.arguments import parse_args

    from megatron_ext.training.arguments import add_megatron_ext_args

    base = list(BASE_ARGS)
    at = base.index("--tokenizer-type")
    del base[at : at + 4]  # --tokenizer-type NullTokenizer --vocab-size 256
    if tokenizer is None:
        tokenizer = ("--tokenizer-type", "SFTTokenizer", "--tokenizer-model", sft_data[0])
    argv = [
        "pretrain_gpt", *base, *tokenizer, "--cpu", "--distributed-backend", "gloo",
        "--expert-model-parallel-size", "1", "--sft", "--data-path", sft_data[1], *extra,
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    return parse_args(extra_args_provider=add_megatron_ext_args)


def _validate(args):
    from megatron_ext.training.launch_rules import validate

    return validate(args)


def test_sft_is_accepted_with_its_tokenizer_and_jsonl(monkeypatch, sft_data) -> None:
    from megatron_ext.training.feature_configs import PaddingConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configs = _validate(_args(monkeypatch, sft_data, "--sft-packing", "megatron"))
    assert configs[PaddingConfig].sft_packing == "megatron"
    assert not [w for w in caught if "no effect" in str(w.message)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--pack-documents",), "--sft cannot be combined with --pack-documents: --sft packs"),
        (
            ("--route-replay-mode", "record", "--route-record-path", "/tmp/r"),
            "--sft cannot be combined with --route-replay-mode",
        ),
        (("--sft-tokenizer-prompt-format", "chatml"), "chatml is not one Megatron's SFTTokenizer"),
    ],
)
def test_refused_combinations(monkeypatch, sft_data, extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        _validate(_args(monkeypatch, sft_data, *extra))


def test_refused_without_the_sft_tokenizer(monkeypatch, sft_data) -> None:
    args = _args(
        monkeypatch, sft_data, tokenizer=("--tokenizer-type", "NullTokenizer", "--vocab-size", "9")
    )
    with pytest.raises(ValueError, match="--sft needs --tokenizer-type SFTTokenizer .* NullTok"):
        _validate(args)


def test_refused_without_datasets_saying_what_to_install(monkeypatch, sft_data) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "datasets" else find_spec(name, *a),
    )
    with pytest.raises(ValueError, match=r"pip install 'megatron_ext\[sft\]'") as err:
        _validate(_args(monkeypatch, sft_data))
    assert "\n" not in str(err.value)


def test_a_missing_jsonl_is_named(monkeypatch, sft_data, tmp_path) -> None:
    args = _args(monkeypatch, sft_data)
    args.data_path = [str(tmp_path / "nowhere.jsonl")]
    with pytest.raises(ValueError, match="--data-path .*nowhere.jsonl: no such JSONL file"):
        _validate(args)


def test_flags_without_effect_warn(monkeypatch, sft_data) -> None:
    with pytest.warns(UserWarning, match=r"\['--pad-to-seq-len'\] have no effect with --sft"):
        _validate(_args(monkeypatch, sft_data, "--pad-to-seq-len"))
    with pytest.warns(UserWarning, match=r"'--packing-window'\] have no effect with --sft --sft-p"):
        _validate(
            _args(monkeypatch, sft_data, "--sft-packing", "megatron", "--packing-window", "9")
        )
