"""Tests for the data section of megatron_ext.training.feature_configs (PaddingConfig). Tier: Megatron on one rank
(its real argument parser, no process group)."""

import os
import subprocess
import sys

import pytest
from megatron.training.arguments import parse_args

from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args
from megatron_ext.training.feature_configs import PaddingConfig


def configs(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> PaddingConfig:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return configs_from_args(parse_args(extra_args_provider=add_megatron_ext_args))[PaddingConfig]


def test_flags_parse_into_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = configs(
        [
            "--pad-policy",
            "constant",
            "--pad-constant-id",
            "3",
            "--pad-to-seq-len",
            "--pack-documents",
            "--packing-algorithm",
            "sequential",
            "--packing-window",
            "50",
            "--pack-overlong-policy",
            "drop",
            "--pack-loss-mask-suffix",
            "_lm",
            "--multimodal-placeholder-ids",
            "7",
            "9",
            "--seq-length",
            "64",
        ],
        monkeypatch,
    )
    assert cfg == PaddingConfig(
        pad_policy="constant",
        pad_constant_id=3,
        pad_to_seq_len=True,
        pack_documents=True,
        packing_algorithm="sequential",
        packing_window=50,
        pack_overlong_policy="drop",
        pack_loss_mask_suffix="_lm",
        multimodal_placeholder_ids=[7, 9],
    )
    assert PaddingConfig().pad_policy == "self"  # the strictly better behaviour is the default


def test_pad_multiple_is_derived_from_the_run() -> None:
    cfg = PaddingConfig()
    assert cfg.pad_multiple() == 1
    assert cfg.pad_multiple(context_parallel_size=4) == 8
    assert cfg.pad_multiple(tensor_parallel_size=2, sequence_parallel=True) == 2
    assert cfg.pad_multiple(context_parallel_size=2, quantization_align=16) == 16
    assert cfg.pad_multiple(context_parallel_size=3, quantization_align=128) == 384
    assert PaddingConfig(pad_to_multiple_of=32).pad_multiple(context_parallel_size=2) == 32


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--pad-to-multiple-of", "6", "--context-parallel-size", "2"],
            r"--pad-to-multiple-of 6 conflicts with --context-parallel-size 2 .* multiple of 4",
        ),
        (
            ["--pad-to-multiple-of", "8", "--fp8-format", "e4m3"],
            r"--pad-to-multiple-of 8 conflicts with --fp8-format/--fp4-format \(the recipe needs 16\)",
        ),
        (
            [
                "--pad-to-multiple-of",
                "3",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ],
            r"conflicts with --sequence-parallel with --tensor-model-parallel-size 2",
        ),
        (
            ["--seq-length", "100", "--context-parallel-size", "4"],
            r"--seq-length 100 is not a multiple of the pack-length multiple 8",
        ),
    ],
)
def test_conflicts_with_megatron_flags_are_refused(argv, match, monkeypatch) -> None:
    with pytest.raises(ValueError, match=match):
        configs(argv, monkeypatch)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pad_policy": "zeros"}, "--pad-policy must be 'self' or 'constant'"),
        ({"pad_to_multiple_of": 0}, "--pad-to-multiple-of must be >= 1"),
        ({"packing_algorithm": "first_fit"}, "--packing-algorithm must be"),
        ({"packing_window": 0}, "--packing-window must be >= 1"),
        ({"pack_overlong_policy": "wrap"}, "--pack-overlong-policy must be"),
        ({"pad_constant_id": -1}, "--pad-constant-id must be >= 0"),
        (
            {"pad_constant_id": 7, "multimodal_placeholder_ids": [7]},
            "--pad-constant-id 7 is one of --multimodal-placeholder-ids",
        ),
        ({"pack_loss_mask_suffix": ""}, "--pack-loss-mask-suffix must not be empty"),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PaddingConfig(**kwargs)


def test_packing_flags_without_pack_documents_warn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.warns(UserWarning, match=r"\['--packing-window'\] have no effect without"):
        configs(["--packing-window", "5"], monkeypatch)


@pytest.fixture
def data_prefix(tmp_path) -> str:
    import numpy as np

    from megatron_ext.data.indexed_writer import write_documents

    write_documents(str(tmp_path / "d"), [np.arange(1, 5)])
    return str(tmp_path / "d")


#: (case, flags after the data prefix P, expected message). The dry run calls the same checks.
DRY_RUN_BAD_INPUTS = [
    ("missing --data-path", ["--data-path", "{P}_nope"], r"--data-path prefix .*d_nope: data file"),
    (
        "missing loss mask",
        ["--data-path", "{P}", "--pack-documents", "--pack-loss-mask-suffix", "_lm"],
        r"--pack-loss-mask-suffix sidecar file .*d_lm\.bin does not exist",
    ),
    ("NaN weight", ["--data-path", "nan", "{P}", "1", "{P}"], "weight nan for .* finite and > 0"),
    ("negative weight", ["--data-path", "-1", "{P}", "1", "{P}"], "weight -1.0 for"),
    ("zero weights", ["--data-path", "0", "{P}", "0", "{P}"], "--data-path weight 0.0 for .*> 0"),
    (  # Megatron's BlendedDataset asserted it only after building every index
        "one zero weight",
        ["--data-path", "1", "{P}", "0", "{P}"],
        "weight 0.0 for .* leave the prefix out",
    ),
    (
        "pad id beyond vocab",
        [
            "--data-path",
            "{P}",
            "--pad-policy",
            "constant",
            "--pad-constant-id",
            "500",
            "--vocab-size",
            "128",
            "--tokenizer-type",
            "NullTokenizer",
        ],
        "outside the vocabulary",
    ),
]


@pytest.mark.parametrize(
    "flags, match", [c[1:] for c in DRY_RUN_BAD_INPUTS], ids=[c[0] for c in DRY_RUN_BAD_INPUTS]
)
def test_data_flags_are_checked_at_argument_time(monkeypatch, data_prefix, flags, match) -> None:
    argv = ["--seq-length", "64"] + [f.replace("{P}", data_prefix) for f in flags]
    with pytest.raises(ValueError, match=match):
        configs(argv, monkeypatch)


def test_existing_data_passes_and_flags_without_effect_warn(monkeypatch, data_prefix) -> None:
    configs(["--seq-length", "64", "--data-path", "1", data_prefix], monkeypatch)
    with pytest.warns(UserWarning, match=r"--pad-to-seq-len.* no effect without --pack-documents"):
        configs(["--seq-length", "64", "--pad-to-seq-len"], monkeypatch)


def test_data_listed_in_data_args_files_is_checked_too(monkeypatch, data_prefix, tmp_path) -> None:
    """--data-args-path / --per-split-data-args-path list the prefixes in a file (Megatron reads it
    when building the datasets): the same checks apply to them at argument time."""
    listed = tmp_path / "paths.txt"
    listed.write_text(f"1 {data_prefix}\n1 {tmp_path / 'nope'}\n")
    with pytest.raises(ValueError, match=r"--data-args-path .*paths\.txt prefix .*nope\.bin does"):
        configs(["--seq-length", "64", "--data-args-path", str(listed)], monkeypatch)
    per_split = tmp_path / "splits.json"
    per_split.write_text(f'{{"train": "{data_prefix}", "valid": ["{data_prefix}"], "test": null}}')
    lm = ["--pack-documents", "--pack-loss-mask-suffix", "_lm"]
    with pytest.raises(ValueError, match=r"\(train\) .*sidecar file .*d_lm\.bin does not exist"):
        configs(["--seq-length", "64", "--per-split-data-args-path", str(per_split), *lm],
                monkeypatch)  # fmt: skip
    configs(["--seq-length", "64", "--per-split-data-args-path", str(per_split)], monkeypatch)
    for bad, match in (("{", "is not valid JSON"), ('{"train": []}', 'needs "train", "valid"')):
        per_split.write_text(bad)
        with pytest.raises(ValueError, match=match):
            configs(["--seq-length", "64", "--per-split-data-args-path", str(per_split)],
                    monkeypatch)  # fmt: skip
    with pytest.raises(ValueError, match=r"--data-args-path .*gone\.txt: cannot read it"):
        configs(["--seq-length", "64", "--data-args-path", str(tmp_path / "gone.txt")], monkeypatch)


@pytest.mark.parametrize("documents", [0, 3], ids=["no documents", "empty documents"])
def test_an_empty_dataset_is_refused_at_argument_time(monkeypatch, tmp_path, documents) -> None:
    """No document, or documents without a token: an empty .bin, which Megatron's IndexedDataset
    cannot map (it failed at build, minutes in, after the dry run had said OK)."""
    import numpy as np

    from megatron_ext.data.indexed_writer import write_documents

    prefix = str(tmp_path / "empty")
    write_documents(prefix, [np.zeros(0, dtype=np.int64)] * documents)
    assert os.path.getsize(prefix + ".bin") == 0 and os.path.getsize(prefix + ".idx") > 0
    with pytest.raises(
        ValueError, match=rf"--data-path prefix {prefix}: data file .*empty\.bin is empty"
    ):
        configs(["--seq-length", "64", "--data-path", prefix], monkeypatch)


def test_the_dry_run_refuses_an_empty_dataset_in_one_line(tmp_path) -> None:
    """What the launch prints: one line, exit 2, none of the 'Exception ignored' tracebacks a
    half-built Megatron IndexedDataset leaves when it cannot map the file."""
    from megatron_ext.data.indexed_writer import write_documents
    from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS

    prefix = str(tmp_path / "empty")
    write_documents(prefix, [])
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "TORCHDYNAMO_DISABLE": "1"}
    argv = [*TINY_MOE_TEST_ARGS, "--data-path", prefix, "--train-iters", "2", "--dry-run"]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.pretrain_gpt", *argv],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == (
        f"megatron_ext: invalid arguments: --data-path prefix {prefix}: data file {prefix}.bin is "
        "empty: its documents hold no token (Megatron cannot open an empty .bin); leave the prefix "
        "out or rewrite it\n"
    )
