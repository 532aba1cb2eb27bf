"""Tests for megatron_ext.training.policy_config (PolicyLossConfig) and the policy sidecars at
dataset build. Tier: Megatron on one rank (its real argument parser and dataset builder, no
process group); the dry run calls the same checks.

Refused in one line at argument time: --rl-loss without --pack-documents or
--calculate-per-token-loss, under CP, a sidecar missing, without a header, of another token file
(its digest) or not float32, and --rl-record-logprobs outside record mode or over existing data. A
NaN in a sidecar is refused when the dataset is built, naming the file, document and token.
"""

import shutil
import sys

import numpy as np
import pytest
import torch
from megatron.training.arguments import parse_args

from megatron_ext.training.arguments import add_megatron_ext_args, configs_from_args
from megatron_ext.training.policy_config import PolicyLossConfig
from tests.training.rl_data import write_rl_data, write_sidecar

MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--seq-length", "128",
       "--micro-batch-size", "1"]  # fmt: skip
RL = ["--pack-documents", "--rl-loss", "ppo", "--calculate-per-token-loss"]


def configs(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> PolicyLossConfig:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MOE, *argv])
    args = parse_args(extra_args_provider=add_megatron_ext_args)
    return configs_from_args(args)[PolicyLossConfig]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("rl") / "rl")
    write_rl_data(prefix, num_docs=8, logprobs=True)
    return prefix


def test_a_complete_rl_launch_is_accepted(monkeypatch, prefix) -> None:
    cfg = configs(["--data-path", prefix, *RL, "--rl-clip-high", "0.3"], monkeypatch)
    assert (cfg.rl_loss, cfg.rl_clip_low, cfg.rl_clip_high) == ("ppo", 0.2, 0.3)
    assert (cfg.rl_advantages_suffix, cfg.rl_logprobs_suffix) == ("_advantages", "_logprobs")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--rl-loss", "ppo", "--calculate-per-token-loss"], r"^--rl-loss reads .*--pack-documents"),
        (["--rl-loss", "ppo", "--pack-documents"], r"^--rl-loss is a token-level mean .*"
         r"add --calculate-per-token-loss"),
        ([*RL, "--rl-logprobs-suffix", "_nope"],
         r"^--rl-logprobs-suffix _nope: sidecar file .*rl_nope\.bin for --data-path prefix"),
        ([*RL, "--rl-clip-low", "1.5"], r"^--rl-clip-low must be in \[0, 1\)"),
        ([*RL, "--rl-advantages-suffix", "_logprobs"], r"two non-empty suffixes"),
        (["--rl-record-logprobs", "{dir}/lp"], r"^--rl-record-logprobs records through "
         r"--route-replay-mode record"),
        (["--pack-documents", "--route-replay-mode", "record", "--route-record-path",
          "{dir}/routes", "--rl-record-logprobs", "{P}_advantages"],
         r"--rl-record-logprobs .*rl_advantages\.bin already exists"),
    ],
)  # fmt: skip
def test_refused_in_one_line_naming_the_flag(monkeypatch, prefix, argv, match) -> None:
    directory = prefix.rsplit("/", 1)[0]
    argv = [a.replace("{P}", prefix).replace("{dir}", directory) for a in argv]
    with pytest.raises(ValueError, match=match) as err:
        configs(["--data-path", prefix, *argv], monkeypatch)
    assert "\n" not in str(err.value)


def test_a_sidecar_of_another_token_file_is_refused(monkeypatch, tmp_path, prefix) -> None:
    """Same lengths, other tokens: only the header's digest tells (a sidecar left beside
    rewritten tokens); a header-less sidecar and an int sidecar are refused too."""
    other = str(tmp_path / "other")
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, other + ext)
    tokens = np.fromfile(other + ".bin", dtype=np.int32)
    tokens[3] += 1  # same lengths, one token changed
    tokens.tofile(other + ".bin")
    for suffix in ("_loss_mask", "_advantages", "_logprobs"):
        for ext in (".bin", ".idx", ".sidecar.json"):
            shutil.copy(prefix + suffix + ext, other + suffix + ext)
    with pytest.raises(ValueError, match=r"sidecar .*other_advantages was written for other "
                       r"token data than .*other \(its tokens_digest differs\)"):  # fmt: skip
        configs(["--data-path", other, *RL], monkeypatch)
    docs = [np.zeros(n, np.float32) for n in np.full(8, 100)]
    write_sidecar(other, "_advantages2", docs, np.float32, "completion", other)
    (tmp_path / "other_advantages2.sidecar.json").unlink()
    with pytest.raises(ValueError, match=r"sidecar .*other_advantages2 has no header"):
        configs(["--data-path", other, *RL, "--rl-advantages-suffix", "_advantages2"], monkeypatch)
    ints = [np.zeros(n, np.int32) for n in np.full(8, 100)]
    write_sidecar(prefix, "_ints", ints, np.int32, "completion", prefix)
    with pytest.raises(ValueError, match=r"--rl-logprobs-suffix _ints: .* holds int32, not float"):
        configs(["--data-path", prefix, *RL, "--rl-logprobs-suffix", "_ints"], monkeypatch)


def test_a_nan_is_refused_when_the_dataset_is_built_naming_file_and_document(tmp_path) -> None:
    from megatron_ext.data.packed_dataset import PackedDataset, PackedDatasetConfig
    from megatron_ext.training.policy_step import policy_sidecars
    from tests.data.dataset_helpers import build_splits, gpt_config_kwargs

    prefix = str(tmp_path / "rl")
    docs = write_rl_data(prefix, num_docs=6, logprobs=True)
    values = [np.zeros(d.size, np.float32) for d in docs]
    values[4][37] = np.nan
    write_sidecar(prefix, "_nan", values, np.float32, "completion", prefix)
    sidecars = policy_sidecars(
        PolicyLossConfig(rl_loss="ppo", rl_logprobs_suffix="_nan")
    )  # fmt: skip
    kwargs = gpt_config_kwargs([prefix], sequence_length=128, vocab_size=257)
    config = PackedDatasetConfig(**kwargs, pad_to_seq_len=True, sidecars=sidecars)
    with pytest.raises(ValueError, match=r"^rl_logprobs sidecar .*rl_nan: document 4, token 37 "
                       r"holds nan: every value must be finite$"):  # fmt: skip
        build_splits(PackedDataset, config, [4, 0, 0])
    # The finite sidecars load, self-padded like the tokens.
    good = PackedDatasetConfig(**kwargs, pad_to_seq_len=True, sidecars=policy_sidecars(
        PolicyLossConfig(rl_loss="ppo")))  # fmt: skip
    sample = build_splits(PackedDataset, good, [4, 0, 0])[0][0]
    assert sample["rl_advantages"].dtype == sample["rl_logprobs"].dtype == torch.float32
    assert sample["rl_advantages"].shape == sample["tokens"].shape == (128,)
    assert sample["rl_logprobs"][~sample["padding_mask"]].min() == -2.0  # completion tokens
