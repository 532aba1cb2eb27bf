"""tools/convert_routes.py streams: a dump several times larger than a memory limit converts with
the process's peak memory growing by less than that limit (one record at a time, written as it
comes), and the output is still all-or-nothing.

Tier: pure files plus the tool in a subprocess (its real RSS high-water mark, reset after the
imports through /proc/self/clear_refs, Linux >= 4.0).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from tests.tools.engine_encoders import vllm_numpy2base64
from tests.tools.test_convert_routes import load_tool

LIMIT = 8 << 20
L, K, E, T = 4, 8, 384, 4000  # uint16 routes: 256 KB per record

_SCRIPT = r"""
import importlib.util, sys
import megatron_ext.replay.route_dataset  # noqa: F401  (torch and megatron loaded before measuring)
from megatron_ext.data import indexed_checks  # noqa: F401

def status(key):  # kB -> bytes
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

tool_path, small, big, out, flags = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
spec = importlib.util.spec_from_file_location("convert_routes", tool_path)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
# A first small conversion pages in the code it runs (torch, numpy, json): fixed, not per record.
tool.main(["--input", small, "--output-prefix", out + "_warm", *flags])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current RSS
before = status("VmRSS")
rc = tool.main(["--input", big, "--output-prefix", out, *flags])
print(rc, status("VmHWM") - before)
"""


def _dump(path, num_records: int) -> np.ndarray:
    """``num_records`` vLLM 0.34 records of T tokens (T - 1 rows of a .npy base64 payload)."""
    rng = np.random.default_rng(0)
    routes = np.argsort(rng.random((T - 1, L, E)), axis=-1)[..., :K].astype(np.uint16)
    line = json.dumps({"routed_experts": vllm_numpy2base64(routes), "num_tokens": T}) + "\n"
    with open(path, "w") as f:
        for _ in range(num_records):
            f.write(line)
    return routes


@pytest.mark.slow
def test_a_dump_larger_than_the_memory_limit_converts_under_it(tmp_path):
    num_records = 5 * LIMIT // (T * L * K * 2) + 1
    routes = _dump(tmp_path / "big.jsonl", num_records)
    _dump(tmp_path / "small.jsonl", 2)
    files = [str(tmp_path / name) for name in ("small.jsonl", "big.jsonl", "out")]
    flags = ["--format", "vllm", "--no-progress", "--num-layers", str(L), "--topk", str(K)]
    flags += ["--num-experts", str(E)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, load_tool.__globals__["TOOL"], *files, *flags],
        check=True, capture_output=True, text=True, cwd=root,
    ).stdout.split()  # fmt: skip
    rc, rss_growth = int(out[-2]), int(out[-1])
    total = os.path.getsize(tmp_path / "out.bin")
    assert rc == 0 and total == num_records * T * L * K * 2 >= 5 * LIMIT
    assert rss_growth < LIMIT, (rss_growth, total)
    ds = IndexedDataset(str(tmp_path / "out"))
    for d in (0, num_records - 1):  # streamed, still exact
        assert np.array_equal(np.array(ds[d]).reshape(T, L, K)[:-1], routes)


def test_a_refusal_after_the_last_record_leaves_nothing(tmp_path):
    """The fraction check runs after the last document was written to the temporary files: the
    refusal removes them and publishes nothing."""
    routes = np.zeros((3, L, K), dtype=np.uint16)  # every row's ids are duplicates: invalid
    line = json.dumps({"routed_experts": vllm_numpy2base64(routes), "num_tokens": 4})
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    argv = ["--format", "vllm", "--input", str(tmp_path / "bad.jsonl"), "--no-progress"]
    argv += ["--output-prefix", str(tmp_path / "out"), "--num-layers", str(L)]
    argv += ["--topk", str(K), "--num-experts", str(E), "--reject-invalid-rows"]
    with pytest.raises(ValueError, match=r"12 of 16 \(token, layer\) rows \(75.00%\) hold invalid"):
        load_tool().main(argv)
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # no output, no temporary file
