"""Tier: subprocesses (Megatron's real ``pretrain``, 2 gloo ranks, CPU, EP=2): Megatron's ``--sft``.

Three launches on the same JSONL conversations (Megatron's ``SFTTokenizer`` on a real offline
tokenizer, conversations packed whole across lines by best_fit, pads dispatched to the experts):
constant pads (Megatron's pad id) for 4 iterations; self pads for 4 iterations, saving at 2; self
pads resumed from that checkpoint. The two policies train alike (the real-token loss, the
load-balancing loss and the grad norm equal every iteration; the pads reach other experts), and the
resumed run logs what the uninterrupted one logged.
"""

import json

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, launch
from tests.training.loop_checks import without

K, N = 2, 4  # save at K, resume, train to N
LOGGED = ("lm loss", "load_balancing_loss", "grad norm")


def _sft_args(sft_data: tuple[str, str]) -> list[str]:
    tokenizer, jsonl = sft_data
    args = without(without(list(TINY_MOE_TEST_ARGS), "--tokenizer-type"), "--vocab-size")
    return [
        *args, "--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tokenizer,
        "--data-path", jsonl, "--train-iters", str(N), "--moe-pad-routing", "dispatch",
    ]  # fmt: skip


def _counts(records: list[dict], prefix: str) -> list:
    return [[r[k] for k in sorted(r) if k.endswith(f"/{prefix}tokens")] for r in records]


def test_sft_trains_with_constant_and_self_pads_and_resumes_exactly(sft_data, tmp_path) -> None:
    runs, loads = {}, {}
    for policy in ("constant", "self"):
        log = tmp_path / f"{policy}.jsonl"
        extra = (
            ["--save", str(tmp_path / "ckpt"), "--save-interval", str(K)]
            if policy == "self"
            else []
        )
        runs[policy] = launch(
            [*_sft_args(sft_data), "--pad-policy", policy, "--moe-expert-load-metrics",
             "--moe-expert-load-log", str(log), "--data-cache-path", str(tmp_path / "cache"), *extra]
        ).check()  # fmt: skip
        loads[policy] = [json.loads(line) for line in log.read_text().splitlines()]
    logged = {
        p: {i: tuple(f[k] for k in LOGGED) for i, f in r.iterations.items()}
        for p, r in runs.items()
    }
    assert sorted(logged["self"]) == list(range(1, N + 1))
    assert (
        logged["self"] == logged["constant"]
    )  # pads are loss-masked and out of every real token's view
    assert _counts(loads["self"], "real_") == _counts(loads["constant"], "real_")
    # The interesting case occurred: packs held pads, and the two policies sent them elsewhere.
    every, real = _counts(loads["self"], ""), _counts(loads["self"], "real_")
    assert sum(map(sum, sum(every, []))) > sum(map(sum, sum(real, [])))
    assert every != _counts(loads["constant"], "")
    assert "SelfPaddedSFTDataset" in runs["self"].output
    assert len({runs["self"].losses[i] for i in range(1, N + 1)}) == N  # it trains

    resumed = launch(
        [*_sft_args(sft_data), "--pad-policy", "self", "--load", str(tmp_path / "ckpt"),
         "--ckpt-step", str(K), "--data-cache-path", str(tmp_path / "cache")]
    ).check()  # fmt: skip
    assert f"at iteration {K}" in resumed.output
    assert sorted(resumed.iterations) == list(range(K + 1, N + 1))
    for i in range(K + 1, N + 1):
        assert (
            resumed.iterations[i]["consumed samples"]
            == runs["self"].iterations[i]["consumed samples"]
        )
        for key in LOGGED:
            assert resumed.iterations[i][key] == runs["self"].iterations[i][key], (i, key)
