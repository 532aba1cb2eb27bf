"""Tier: subprocesses (Megatron's real ``pretrain``, 2 gloo ranks, CPU, EP=2 and so 2 data-parallel
ranks).

Every log interval prints tokens/s, real tokens/s and the pad fraction and writes them into the
expert-load JSON line. The counts are checked against the data two other ways: the tokens are the
global batch times the sequence length (``--pad-to-seq-len``), and the real tokens equal what the
MoE routers received as real (the load metrics count the device-side pad mask, summed over both
data-parallel ranks) divided by top-k. The rows hold pads, so the real count is not the total.
"""

import json
import re

from megatron_ext.testing.real_loop import TINY_MOE_TEST_ARGS, launch

_LINE = re.compile(
    r"megatron_ext tokens/s ([0-9.]+) \| real tokens/s ([0-9.]+) \| pad fraction ([0-9.]+) "
    r"\(iteration (\d+)\)"
)


#: Longer than most corpus documents, so one-document rows are mostly padding.
SEQ = ("--seq-length", "512", "--max-position-embeddings", "512")


def _arg(name: str) -> int:
    args = [*TINY_MOE_TEST_ARGS, *SEQ]
    return int(args[len(args) - 1 - args[::-1].index(name) + 1])  # the last one wins


def test_each_interval_logs_real_token_throughput(corpus_prefix, tmp_path) -> None:
    log = tmp_path / "load.jsonl"
    run = launch(
        [*TINY_MOE_TEST_ARGS, *SEQ, "--data-path", corpus_prefix, "--train-iters", "3", "--pack-documents",
         "--packing-window", "1", "--pad-to-seq-len", "--pack-overlong-policy", "truncate",
         "--moe-pad-routing", "dispatch", "--moe-expert-load-metrics",
         "--moe-expert-load-log", str(log)]
    ).check()  # fmt: skip
    lines = {int(m[3]): tuple(map(float, m[:3])) for m in _LINE.findall(run.output)}
    assert sorted(lines) == sorted(run.iterations) == [1, 2, 3]  # one line per interval, once
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    topk = _arg("--moe-router-topk")
    for record in records:
        assert record["token_counts_exact"]
        assert record["tokens"] == _arg("--global-batch-size") * _arg("--seq-length")
        routed_real = sum(sum(v) for k, v in record.items() if k.endswith("/real_tokens"))
        layers = sum(1 for k in record if k.endswith("/real_tokens"))
        assert record["real_tokens"] * topk * layers == routed_real
        assert 0 < record["real_tokens"] < record["tokens"]  # the rows really hold pads
        assert record["pad_fraction"] == 1 - record["real_tokens"] / record["tokens"]
        ratio = record["real_tokens_per_s"] / record["tokens_per_s"]
        assert abs(ratio - record["real_tokens"] / record["tokens"]) < 1e-12
        printed = lines[record["iteration"]]
        assert abs(printed[1] - round(record["real_tokens_per_s"], 1)) < 0.06
        assert abs(printed[2] - record["pad_fraction"]) < 5e-4
