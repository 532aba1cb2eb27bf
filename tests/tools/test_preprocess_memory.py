"""tools/preprocess_data.py streams: its peak memory does not grow with the input.

Tier: pure (the tool in-process, byte-level tokenizer, a few seconds). Peak memory is what
``tracemalloc`` traces: every Python object and numpy array the run allocates (token arrays,
chunk buffers, the index lists), the allocations that would grow with a run that held its data.
"""

import tracemalloc

from megatron_ext.bench.preprocess import write_corpus
from tests.tools.test_preprocess_data import load_tool


def peak_mib(argv: list[str]) -> float:
    tool = load_tool()
    tracemalloc.start()
    try:
        assert tool.main(argv) == 0
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def test_peak_memory_does_not_grow_with_the_input(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TQDM_DISABLE", "1")
    peaks = {}
    for mib in (1, 16):
        src = tmp_path / f"in{mib}.jsonl"
        write_corpus(src, mib << 20)
        argv = ["--input", str(src), "--output-prefix", str(tmp_path / f"o{mib}"), "--append-eod"]
        peaks[mib] = peak_mib(argv)
        tokens = (tmp_path / f"o{mib}.bin").stat().st_size // 2  # uint16 byte-level ids
        assert tokens > (mib << 20) * 0.9  # the input was tokenized, not skipped
    # 15 MiB more input is ~15 M more tokens: held in memory they would add >= 30 MiB (uint16;
    # the tool held them as int64 before it streamed). Streamed, the peak is one chunk's (a
    # chunk ends at the line that passes 1 MiB, so chunks differ a little).
    assert peaks[16] - peaks[1] < 6, peaks
    assert peaks[1] > 1  # a chunk of 1 MiB of text was traced: the measurement saw the work
