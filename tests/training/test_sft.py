"""Tier: subprocesses (Megatron's real ``pretrain``, 2 gloo ranks, CPU, EP=2): Megatron's ``--sft``.

Two launches on the same JSONL conversations (Megatron's ``SFTTokenizer`` on a real offline
tokenizer, conversations packed whole across lines by best_fit, pads dispatched to the experts): self
pads for 4 iterations, saving at 2; then that checkpoint resumed with constant pads (Megatron's pad
id). The resumed iterations log exactly what the uninterrupted run logged (the real-token loss, the
load-balancing loss, the grad norm, the consumed samples), which holds only if the resume is exact
and the two pad policies train alike; the pads reach other experts (the load log's all-token counts
differ, its real-token counts do not). One launch fewer than a run per policy plus a resume.
"""

import json

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, launch
from tests.training.loop_checks import without

K, N = 2, 4  # save at K, resume, train to N
LOGGED = ("lm loss", "load_balancing_loss", "grad norm", "consumed samples")


def _sft_args(sft_data: tuple[str, str], tmp_path, policy: str) -> list[str]:
    tokenizer, jsonl = sft_data
    args = without(without(list(TINY_MOE_TEST_ARGS), "--tokenizer-type"), "--vocab-size")
    return [
        *args, "--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tokenizer,
        "--data-path", jsonl, "--data-cache-path", str(tmp_path / "cache"),
        "--train-iters", str(N), "--moe-pad-routing", "dispatch", "--pad-policy", policy,
        "--moe-expert-load-metrics", "--moe-expert-load-log", str(tmp_path / f"{policy}.jsonl"),
    ]  # fmt: skip


def _counts(log, prefix: str) -> dict[int, list]:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {
        r["iteration"]: [r[k] for k in sorted(r) if k.endswith(f"/{prefix}tokens")] for r in records
    }


def test_sft_trains_and_resumes_exactly_with_the_other_pad_policy(sft_data, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    selfpad = launch(
        [*_sft_args(sft_data, tmp_path, "self"), "--save", ckpt, "--save-interval", str(K)]
    ).check()
    constant = launch(
        [*_sft_args(sft_data, tmp_path, "constant"), "--load", ckpt, "--ckpt-step", str(K)]
    ).check()
    assert "SelfPaddedSFTDataset" in selfpad.output
    assert sorted(selfpad.iterations) == list(range(1, N + 1))
    assert len(set(selfpad.losses.values())) == N  # it trains
    assert (
        f"at iteration {K}" in constant.output
        and "--pad-policy self -> constant" in constant.output
    )
    assert sorted(constant.iterations) == list(range(K + 1, N + 1))
    for i in range(K + 1, N + 1):
        for key in LOGGED:
            assert constant.iterations[i][key] == selfpad.iterations[i][key], (i, key)
    self_load, const_load = (_counts(tmp_path / f"{p}.jsonl", "") for p in ("self", "constant"))
    self_real, const_real = (
        _counts(tmp_path / f"{p}.jsonl", "real_") for p in ("self", "constant")
    )
    resumed = range(K + 1, N + 1)
    assert [self_real[i] for i in resumed] == [const_real[i] for i in resumed]
    # The interesting case occurred: packs held pads, and the two policies sent them elsewhere.
    assert all(sum(map(sum, self_load[i])) > sum(map(sum, self_real[i])) for i in resumed)
    assert [self_load[i] for i in resumed] != [const_load[i] for i in resumed]


def test_sft_trains_under_context_parallelism_with_every_conversation_padded(
    sft_data, tmp_path
) -> None:
    """``--sft`` at CP 2 (EP 2 over the same ranks): every conversation of a pack padded to a
    multiple of 4 with its own tokens, each pack split per document by Megatron's own
    ``get_batch_on_this_cp_rank`` (the --cpu CP attention rehearsing Transformer Engine's)."""
    run = launch([*_sft_args(sft_data, tmp_path, "self"), "--context-parallel-size", "2"]).check()
    assert "SelfPaddedSFTDataset" in run.output
    assert "data-parallel size: 1, context-parallel size: 2" in run.output
    assert "every document padded to a multiple of 4" in run.output
    assert sorted(run.iterations) == list(range(1, N + 1))
    assert run.losses[N] < run.losses[1]  # it trains
    load, real = (_counts(tmp_path / "self.jsonl", p) for p in ("", "real_"))
    # The interesting case: the packs held pads (per conversation and at the tail), routed.
    assert all(sum(map(sum, load[i])) > sum(map(sum, real[i])) for i in load)
