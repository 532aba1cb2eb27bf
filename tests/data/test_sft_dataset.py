"""Tests for megatron_ext.data.sft_dataset. Tier: Megatron on one rank (Megatron's dataset builder,
its ``SFTDataset`` and its ``SFTTokenizer`` on a real offline tokenizer, in-process).

With ``--sft-packing megatron`` our samples are compared with Megatron's own ``SFTDataset`` item by
item on the same JSONL (not with a copy of its code); with ``packed`` every conversation token is in
a pack.
"""

import json

import numpy as np
import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.training.datasets.sft_dataset import IGNORE_INDEX, SFTDataset

from megatron_ext.data.sft_dataset import SelfPaddedSFTDataset, SFTDatasetConfig

SEQ = 128
LINES = 60  # samples compared


def _tokenizer(path: str, prompt_format: str = "nemotron-h-aligned"):
    """Megatron's SFT tokenizer as its ``build_tokenizer`` makes it for ``--tokenizer-type
    SFTTokenizer`` (megatron/core/tokenizers/utils/build_tokenizer.py, 0.19.2)."""
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=path, metadata_path={"library": "sft"}, prompt_format=prompt_format
    )


@pytest.fixture(scope="module")
def tokenizer(sft_data):
    return _tokenizer(sft_data[0])


def _common(data: str, tokenizer, cp: int = 1, **kw) -> dict:
    return dict(
        random_seed=1, sequence_length=SEQ, blend=([data], None), split="100,0,0",
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, context_parallel_size=cp, **kw,
    )  # fmt: skip


def _build(cls, config, num_samples: int | None = LINES):
    return BlendedMegatronDatasetBuilder(cls, [num_samples, 0, 0], lambda: True, config).build()[0]


def _ours(data, tokenizer, cp=1, num_samples: int | None = LINES, **kw) -> SelfPaddedSFTDataset:
    return _build(
        SelfPaddedSFTDataset, SFTDatasetConfig(**_common(data, tokenizer, cp, **kw)), num_samples
    )


@pytest.mark.parametrize("cp", [1, 2])
def test_megatron_rule_equals_megatrons_sft_dataset(sft_data, tokenizer, cp: int, tmp_path) -> None:
    """Real tokens, labels where Megatron trains, loss mask (prompts and pads), positions and
    document boundaries equal Megatron's; constant pads are Megatron's pad ids; self pads differ
    only where ``padding_mask`` is set, and are masked."""
    data = sft_data[1]
    megatron = _build(SFTDataset, GPTDatasetConfig(**_common(data, tokenizer, cp)))
    ours = {
        policy: _ours(data, tokenizer, cp, sft_packing="megatron", pad_policy=policy,
                      path_to_cache=str(tmp_path))
        for policy in ("constant", "self")
    }  # fmt: skip
    seen = {"cut": 0, "several": 0, "cp_pads": 0, "prompt": 0}
    for i in range(LINES):
        theirs = {k: v.numpy() for k, v in megatron[i].items()}
        cu = theirs["cu_seqlens"][: np.argmax(theirs["cu_seqlens"] == SEQ) + 1]
        trains = theirs["loss_mask"] == 1
        for policy, dataset in ours.items():
            mine = {k: v.numpy() for k, v in dataset[i].items()}
            real = ~mine["padding_mask"]
            assert np.array_equal(mine["loss_mask"], theirs["loss_mask"]), (i, policy)
            assert np.array_equal(mine["labels"][trains], theirs["labels"][trains])
            assert np.array_equal(mine["tokens"][real], theirs["tokens"][real])
            assert np.array_equal(mine["position_ids"][real], theirs["position_ids"][real])
            assert not mine["loss_mask"][~real].any()
            # Boundaries: Megatron's last one is SEQ (its tail pad joins the last conversation);
            # ours ends that conversation's slot there, then the tail pad is its own segment.
            mine_cu = mine["cu_seqlens"][: int(mine["num_segments"]) + 1]
            assert np.array_equal(mine_cu[: cu.size - 1], cu[:-1])
            last_end = int(mine_cu[cu.size - 1])
            assert mine_cu[-1] == SEQ and (mine["padding_mask"][last_end:]).all()
            # Positions continue through a conversation's CP pads (inside its segment), as
            # Megatron's; only the tail pad restarts them.
            assert np.array_equal(
                mine["position_ids"][:last_end], theirs["position_ids"][:last_end]
            )
            if policy == "constant":  # Megatron's pad id everywhere a pad is
                assert np.array_equal(mine["tokens"], theirs["tokens"])
            elif real.sum() < SEQ:
                assert not np.array_equal(mine["tokens"], theirs["tokens"])
        seen["cut"] += int(real.sum() == SEQ and theirs["labels"][-1] == tokenizer.pad)
        seen["several"] += int(cu.size > 2)
        seen["cp_pads"] += int(mine["padding_mask"][: int(mine_cu[-2])].sum())
        seen["prompt"] += int((theirs["labels"][real[1:].nonzero()[0]] == IGNORE_INDEX).any())
    # Not vacuous: lines were cut, held several conversations, had CP pads (CP 2), and prompts.
    assert seen["cut"] and seen["several"] and seen["prompt"] == LINES
    assert (seen["cp_pads"] > 0) == (cp > 1)


@pytest.fixture(scope="module")
def short_jsonl(sft_data, tmp_path_factory) -> str:
    """The first 80 lines of the JSONL (a whole epoch is read in a test)."""
    path = str(tmp_path_factory.mktemp("short") / "chat.jsonl")
    with open(sft_data[1]) as src, open(path, "w") as dst:
        dst.writelines(src.readlines()[:80])
    return path


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_conversations_lose_no_token(short_jsonl, tokenizer, cp: int, tmp_path) -> None:
    """``packed`` (best_fit) over one epoch: every conversation token is in a pack, once; pads are
    masked; every document slot is a multiple of 2*CP. Megatron's rule on the same lines loses
    tokens, and pads more."""
    data = short_jsonl
    ours = _ours(data, tokenizer, cp, num_samples=None, path_to_cache=str(tmp_path))
    total = int(ours.conv_lens_Q.sum())
    real, trained, multiple = 0, 0, 2 * cp if cp > 1 else 1
    for i in range(len(ours)):
        sample = {k: v.numpy() for k, v in ours[i].items()}
        real += int((~sample["padding_mask"]).sum())
        trained += int(sample["loss_mask"].sum())
        assert not sample["loss_mask"][sample["padding_mask"]].any()
        cu = sample["cu_seqlens"][: int(sample["num_segments"]) + 1]
        assert not (np.diff(cu)[:-1] % multiple).any()  # the tail pad may be any length
    assert real == total and trained > 0
    assert ours.stats["num_split"] > 0  # conversations longer than the sequence: split, kept
    megatron_rule = _ours(data, tokenizer, cp, num_samples=None, sft_packing="megatron")
    kept = sum(int((~megatron_rule[i]["padding_mask"]).sum()) for i in range(len(megatron_rule)))
    assert kept < 0.8 * total  # Megatron's rule cuts lines: here more than a fifth is lost
    assert 1 - total / (len(ours) * SEQ) < 1 - kept / (len(megatron_rule) * SEQ)  # fewer pads


def test_scan_is_cached_per_file_and_tokenizer(
    sft_data, short_jsonl, tokenizer, tmp_path, monkeypatch
) -> None:
    data = str(tmp_path / "chat.jsonl")
    with open(short_jsonl) as src, open(data, "w") as dst:
        dst.writelines(src.readlines()[:40])
    first = _ours(data, tokenizer, num_samples=30)
    assert not first.cache_hit
    scans = []
    original = SelfPaddedSFTDataset._scan
    monkeypatch.setattr(
        SelfPaddedSFTDataset, "_scan", lambda self: scans.append(1) or original(self)
    )
    again = _ours(data, tokenizer, num_samples=30)
    assert again.cache_hit and scans == []  # neither scanned nor planned again
    assert np.array_equal(again[3]["tokens"], first[3]["tokens"])
    other_template = _tokenizer(sft_data[0], "nemotron-nano-v2")  # other tokens per conversation
    rescanned = _ours(data, other_template, num_samples=30)
    assert scans == [1] and not np.array_equal(rescanned.conv_lens_Q, first.conv_lens_Q)
    with open(data, "a") as f:  # the file changes: scanned again, one more line
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    grown = _ours(data, tokenizer, num_samples=30)
    assert scans == [1, 1] and grown.line_offsets_N1.size == first.line_offsets_N1.size + 1


def test_blend_of_two_files(sft_data, tokenizer, tmp_path) -> None:
    """Megatron's builder blends our datasets by weight, as it blends its own."""
    data = sft_data[1]
    config = SFTDatasetConfig(
        **{**_common(data, tokenizer), "blend": ([data, data], [0.3, 0.7])},
        path_to_cache=str(tmp_path),
    )
    blended = _build(SelfPaddedSFTDataset, config, num_samples=40)
    ids = [int(blended[i]["dataset_id"]) for i in range(40)]
    assert len(blended) == 40 and set(ids) == {0, 1} and ids.count(1) > ids.count(0)


def test_a_line_without_messages_is_named(sft_data, tokenizer, tmp_path) -> None:
    data = str(tmp_path / "bad.jsonl")
    with open(sft_data[1]) as src, open(data, "w") as dst:
        dst.writelines([*src.readlines()[:3], json.dumps({"messages": []}) + "\n"])
    with pytest.raises(ValueError, match=r"bad.jsonl line 4: no messages"):
        _ours(data, tokenizer, num_samples=4)
    megatron_rule = _ours(data, tokenizer, num_samples=4, sft_packing="megatron")
    with pytest.raises(ValueError, match=r"bad.jsonl line 4: no messages"):
        megatron_rule[3]


def test_config_refusals(tokenizer, sft_data) -> None:
    with pytest.raises(ValueError, match="--sft-packing must be one of"):
        SFTDatasetConfig(**_common(sft_data[1], tokenizer), sft_packing="greedy")
    with pytest.raises(ValueError, match="--seq-length 128 is not a multiple of the per-document"):
        SFTDatasetConfig(**_common(sft_data[1], tokenizer, cp=3))
