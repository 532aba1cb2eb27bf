"""tools/convert_routes.py --format sglang on records built exactly to SGLang's layout (no server):
``meta_info.routed_experts`` = base64 of int32 ``[T - 1, L, K]``, T = prompt_tokens + completion_tokens,
or nested lists; responses, or samples carrying ``tokens``/``token_ids`` beside ``meta_info``.

Tier: Megatron on one rank (IndexedDataset files; the tool runs in-process via its main())."""

import base64
import json
import os
import re

import numpy as np
import pytest

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.replay.routes import missing_mask
from tests.tools.test_convert_routes import E, K, L, random_routes, run, run_cli, write_jsonl


def b64_int32(rows: np.ndarray) -> str:
    """SGLang's wire form: base64 of the int32 tensor's raw bytes (little-endian, C order)."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")


def response(full_TLK: np.ndarray, prompt_tokens: int, **meta) -> dict:
    """A /generate response for a document of T = len(full) tokens (routes of its T - 1 first)."""
    t = full_TLK.shape[0]
    return {
        "text": "...",
        "output_ids": list(range(t - prompt_tokens)),
        "meta_info": {
            "id": "req",
            "prompt_tokens": prompt_tokens,
            "completion_tokens": t - prompt_tokens,
            "cached_tokens": 0,
            "routed_experts": b64_int32(full_TLK[:-1]),
            **meta,
        },
    }


def test_responses_round_trip_in_document_order(tmp_path, capsys):
    lengths = [6, 1, 11, 3]  # T = 1: no forward pass fed a token on, an empty payload
    full = [random_routes(n, seed=40 + n) for n in lengths]
    records = [response(r, prompt_tokens=min(2, n)) for r, n in zip(full, lengths, strict=True)]
    assert records[1]["meta_info"]["routed_experts"] == ""
    write_documents(str(tmp_path / "tokens"), [np.arange(n) for n in lengths])
    docs, out = run(
        tmp_path,
        [write_jsonl(tmp_path / "sg.jsonl", records)],
        "sglang",
        "--tokens-prefix",
        str(tmp_path / "tokens"),
    )
    assert [d.shape[0] for d in docs] == lengths
    for got, want in zip(docs, full, strict=True):
        assert got.dtype == np.uint8  # E = 8: the sidecar's dtype, not SGLang's int32
        assert np.array_equal(got[:-1], want[:-1])
        assert missing_mask(got)[-1].all() and not missing_mask(got)[:-1].any()
    header = json.loads(open(out + ".routes.json").read())
    assert (header["num_layers"], header["topk"], header["num_experts"]) == (L, K, E)
    assert "4 T-1 rows appended" in capsys.readouterr().out


def test_samples_with_tokens_and_nested_lists_balanced(tmp_path, capsys):
    full = [random_routes(5, seed=1), random_routes(4, seed=2)]
    records = [
        {"tokens": list(range(5)), "meta_info": {"routed_experts": full[0][:-1].tolist()}},
        {
            "token_ids": list(range(4)),
            "response_length": 2,
            "meta_info": {"routed_experts": b64_int32(full[1][:-1])},
        },
    ]
    docs, _ = run(
        tmp_path,
        [write_jsonl(tmp_path / "s.jsonl", records)],
        "sglang",
        "--missing-route-policy",
        "balanced",
    )
    for got, want in zip(docs, full, strict=True):
        assert np.array_equal(got[:-1], want[:-1]) and not missing_mask(got).any()
    assert f"{2 * L} rows filled (balanced)" in capsys.readouterr().out


def test_negative_int32_ids_fail_or_are_rejected_and_counted(tmp_path, capsys):
    full = random_routes(4, seed=3)
    rows = full[:-1].astype(np.int32)
    rows[1, 2] = [-1, 3]  # int32 can hold what no expert id is
    src = write_jsonl(tmp_path / "n.jsonl", [response(np.concatenate([rows, full[-1:]]), 2)])
    with pytest.raises(ValueError, match=r"n\.jsonl:1: token 1, MoE layer 2 has experts \[-1, 3\]"):
        run(tmp_path, [src], "sglang")
    limits = ["--max-rejected-fraction", "0.1", "--max-missing-fraction", "0.1"]  # 1 of 12 rows
    docs, _ = run(tmp_path, [src], "sglang", "--reject-invalid-rows", *limits)
    assert missing_mask(docs[0])[1, 2] and missing_mask(docs[0]).sum() == 1 + L
    assert "rejected: 1 invalid rows" in capsys.readouterr().out


ROUTES = random_routes(3, seed=0)  # T = 3: 2 route rows
GOOD = response(ROUTES, 1)


def _with_meta(**changes) -> str:
    meta = {k: v for k, v in {**GOOD["meta_info"], **changes}.items() if v is not ...}
    return json.dumps({**GOOD, "meta_info": meta})


#: (case, second line of the input, extra flags, expected one-line message)
BAD_SGLANG = [
    ("no meta_info", json.dumps({"text": "x"}), [], "needs meta_info.routed_experts"),
    ("no routed_experts", _with_meta(routed_experts=...), [], "needs meta_info.routed_experts"),
    (
        "T rows, not T - 1",  # a shapeless payload's rows are the format's, never the byte count's
        _with_meta(routed_experts=b64_int32(np.zeros((3, L, K)))),
        [],
        rf"{3 * L * K} int32 ids are not T - 1 = 2 rows",
    ),
    ("null routed_experts", _with_meta(routed_experts=None), [], "--enable-return-routed-experts"),
    ("batched answer, bad element", json.dumps([GOOD, {"text": "x"}]), [], r"2\[1\]: a --format"),
    ("bad base64", _with_meta(routed_experts="@@@"), [], "routed_experts: not valid base64"),
    (
        "odd byte count",
        _with_meta(routed_experts=base64.b64encode(b"\0" * 5).decode()),
        [],
        "5 bytes are not whole int32 expert ids",
    ),
    (
        "every hidden layer",
        _with_meta(routed_experts=b64_int32(np.zeros((2, L + 1, K)))),
        [],
        rf"are not T - 1 = 2 rows of {L} layers x top-{K}; that is {L + 1} layers",
    ),
    (
        "one count only",
        _with_meta(completion_tokens=...),
        [],
        "has prompt_tokens but not completion",
    ),
    ("string count", _with_meta(prompt_tokens="1"), [], "prompt_tokens must be a non-negative"),
    (
        "count vs tokens",
        json.dumps({**GOOD, "tokens": [1, 2, 3, 4]}),
        [],
        "= 3 disagrees with the 4 tokens",
    ),
    ("not JSON", '{"meta_info": ', [], "not valid JSON"),
    (
        "id >= E",
        _with_meta(routed_experts=b64_int32(np.full((2, L, K), [E, 0]))),
        [],
        rf"token 0, MoE layer 0 has experts \[{E}, 0\]",
    ),
    (
        "float ids in lists",
        _with_meta(routed_experts=[[[0.5, 1]] * L] * 2),
        [],
        "non-integer values such as 0.5",
    ),
    (
        "T rows, T from --tokens-prefix",  # no counts in the record: still exactly T - 1 rows
        json.dumps({"meta_info": {"routed_experts": b64_int32(np.zeros((4, L, K)))}}),
        ["--tokens-prefix", "{tmp}/tokens"],
        r"4 rows of 3 layers x top-2 from token 0 on, but T = 4 tokens need T - 1 = 3",
    ),
    (
        "T vs --tokens-prefix",
        _with_meta(),
        ["--tokens-prefix", "{tmp}/tokens"],
        "3 tokens but token document 1 has 4 tokens",
    ),
]


@pytest.mark.parametrize(
    "second, extra, match", [c[1:] for c in BAD_SGLANG], ids=[c[0] for c in BAD_SGLANG]
)
def test_bad_sglang_records_give_one_line_errors(tmp_path, second, extra, match):
    write_documents(str(tmp_path / "tokens"), [np.arange(3), np.arange(4)])
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + second + "\n")  # the bad record is line 2
    argv = ["--format", "sglang", "--input", str(path), "--no-progress"]
    argv += ["--output-prefix", str(tmp_path / "out"), "--num-layers", str(L), "--topk", str(K)]
    argv += ["--num-experts", str(E)] + [a.replace("{tmp}", str(tmp_path)) for a in extra]
    rc, err = run_cli(argv)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and "in.jsonl:2" in err and re.search(match, err), err
    assert not os.path.exists(tmp_path / "out.idx")  # nothing half-written
