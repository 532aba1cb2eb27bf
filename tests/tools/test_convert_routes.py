"""Round-trip tests for tools/convert_routes.py. Tier: Megatron on one rank (IndexedDataset files;
the tool runs in-process via its main())."""

import importlib.util
import json
import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.replay.rollout_routes import encode_routed_experts, write_safetensors
from megatron_ext.replay.routes import missing_mask, validate_routes

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "convert_routes.py")
L, K, E = 3, 2, 8


def load_tool():
    spec = importlib.util.spec_from_file_location("convert_routes", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_routes(num_tokens: int, seed: int, num_experts: int = E) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack(
        [[rng.permutation(num_experts)[:K] for _ in range(L)] for _ in range(num_tokens)]
    ).astype(np.int64)


def run(tmp_path, inputs, fmt, *extra) -> tuple[list, str]:
    n = 0
    while os.path.exists(tmp_path / f"routes{n}.idx"):  # outputs are never replaced silently
        n += 1
    out = str(tmp_path / f"routes{n}")
    argv = [
        "--format",
        fmt,
        "--output-prefix",
        out,
        "--num-layers",
        str(L),
        "--topk",
        str(K),
        "--num-experts",
        str(E),
        "--no-progress",
        *extra,
    ]
    for path in inputs:
        argv += ["--input", str(path)]
    assert load_tool().main(argv) == 0
    ds = IndexedDataset(out)
    # Copies: the arrays are views of the mmap that closes with ds.
    return [np.array(ds[i]).reshape(-1, L, K) for i in range(len(ds))], out


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_vllm_base64_t_minus_1_round_trip(tmp_path, capsys):
    lengths = [5, 1, 9]
    full = [random_routes(n, seed=n) for n in lengths]
    records = [
        {
            "routed_experts": encode_routed_experts(r[:-1].astype(np.uint8)),
            "token_ids": list(range(n)),
        }
        for r, n in zip(full, lengths, strict=True)
    ]
    write_documents(str(tmp_path / "tokens"), [np.arange(n) for n in lengths])
    docs, out = run(
        tmp_path,
        [write_jsonl(tmp_path / "in.jsonl", records)],
        "vllm",
        "--tokens-prefix",
        str(tmp_path / "tokens"),
    )
    for got, want in zip(docs, full, strict=True):
        assert got.dtype == np.uint8 and got.shape == want.shape
        assert np.array_equal(got[:-1], want[:-1]) and missing_mask(got)[-1].all()
    assert "3 T-1 rows appended" in capsys.readouterr().out
    # --tokens-prefix names the tokens: the header ties the routes to their content.
    from megatron_ext.replay.route_file import read_header, tokens_digest

    header = read_header(out + ".routes.json")
    assert header["tokens_digest"] == tokens_digest(str(tmp_path / "tokens"))
    _, unnamed = run(tmp_path, [write_jsonl(tmp_path / "in2.jsonl", records)], "vllm")
    assert "tokens_digest" not in read_header(unnamed + ".routes.json")


def test_megatron_prompt_and_completion_with_balanced_policy(tmp_path, capsys):
    full = random_routes(7, seed=3)
    record = {
        "prompt_moe_topk_indices": full[:3].tolist(),
        "moe_topk_indices": full[3:6].tolist(),
        "num_tokens": 7,
    }
    docs, _ = run(
        tmp_path,
        [write_jsonl(tmp_path / "m.jsonl", [record])],
        "megatron",
        "--missing-route-policy",
        "balanced",
    )
    assert np.array_equal(docs[0][:6], full[:6]) and not missing_mask(docs[0]).any()
    validate_routes(docs[0], num_layers=L, num_experts=E, topk=K)
    assert f"{L} rows filled (balanced)" in capsys.readouterr().out


def test_npy_and_safetensors_are_exact(tmp_path):
    a, b = random_routes(4, seed=1), random_routes(6, seed=2)
    np.save(tmp_path / "a.npy", a.astype(np.uint8))
    np.save(tmp_path / "b.npy", b.astype(np.uint8))
    docs, _ = run(tmp_path, [tmp_path / "a.npy", tmp_path / "b.npy"], "npy")
    assert np.array_equal(docs[0], a) and np.array_equal(docs[1], b)
    write_safetensors(str(tmp_path / "r.safetensors"), {"0": a.astype(np.int32), "1": b})
    docs, _ = run(tmp_path, [tmp_path / "r.safetensors"], "safetensors")
    assert np.array_equal(docs[0], a) and np.array_equal(docs[1], b)


def test_safetensors_keys_are_ordered_as_document_numbers(tmp_path):
    # 11 documents: a lexical sort would give "0", "1", "10", "2", ... (document 10 second).
    routes = [random_routes(2 + i, seed=20 + i) for i in range(11)]
    path = str(tmp_path / "many.safetensors")
    write_safetensors(path, {str(i): r.astype(np.uint8) for i, r in enumerate(routes)})
    docs, _ = run(tmp_path, [path], "safetensors")
    assert [d.shape[0] for d in docs] == [2 + i for i in range(11)]
    assert all(np.array_equal(got, want) for got, want in zip(docs, routes, strict=True))
    for keys, match in (
        (["0", "doc1"], r"non-numeric key\(s\) \['doc1'\]"),
        (["0", "2"], r"0\.\.1 exactly once \(missing \[1\]"),
    ):
        bad = str(tmp_path / "bad.safetensors")
        write_safetensors(bad, {k: routes[0].astype(np.uint8) for k in keys})
        with pytest.raises(ValueError, match=match):
            run(tmp_path, [bad], "safetensors")


def test_bad_jsonl_records_name_file_and_line(tmp_path):
    rows = random_routes(2, seed=0).tolist()
    good = {
        "vllm": json.dumps({"routed_experts": rows, "num_tokens": 3}),
        "megatron": json.dumps({"moe_topk_indices": rows, "num_tokens": 3}),
    }
    for fmt, second, match in (
        ("vllm", '{"routes": []}', "needs a 'routed_experts' key"),
        ("vllm", '{"routed_experts": [', "not valid JSON"),
        ("vllm", "[1, 2]", "expected a JSON object, got int"),  # a list: one record per element
        ("megatron", '{"num_tokens": 3}', "needs a 'prompt_moe_topk_indices' or 'moe_topk"),
    ):
        path = tmp_path / "r.jsonl"
        path.write_text(good[fmt] + "\n\n" + second + "\n")  # a blank line still counts as line 2
        with pytest.raises(ValueError, match=rf"r.jsonl:3(\[0\])?: .*{match}"):
            run(tmp_path, [path], fmt)


def test_invalid_rows_fail_or_are_rejected_and_counted(tmp_path, capsys):
    bad = random_routes(4, seed=5)
    bad[2, 1] = [E, 0]
    bad[3, 0] = [1, 1]
    np.save(tmp_path / "bad.npy", bad)
    with pytest.raises(ValueError, match="bad.npy: token 2, MoE layer 1"):
        run(tmp_path, [tmp_path / "bad.npy"], "npy")
    # 2 of 12 rows rejected: refused under the default limit, nothing written; converted above it.
    with pytest.raises(ValueError, match=r"2 of 12 \(token, layer\) rows \(16.67%\) .* rejected"):
        run(tmp_path, [tmp_path / "bad.npy"], "npy", "--reject-invalid-rows")
    assert not list(tmp_path.glob("routes*"))
    docs, _ = run(
        tmp_path,
        [tmp_path / "bad.npy"],
        "npy",
        "--reject-invalid-rows",
        "--max-rejected-fraction",
        "0.17",
        "--max-missing-fraction",
        "0.17",  # rejected rows are missing too
    )
    assert missing_mask(docs[0]).sum() == 2 and missing_mask(docs[0])[2, 1]
    assert "rejected: 2 invalid rows" in capsys.readouterr().out


def test_length_mismatches_and_missing_input_are_refused(tmp_path):
    write_documents(str(tmp_path / "tokens"), [np.arange(5)])
    rec = {"routed_experts": random_routes(3, seed=0).tolist(), "num_tokens": 4}
    path = write_jsonl(tmp_path / "x.jsonl", [rec])
    with pytest.raises(ValueError, match="4 tokens but token document 0 has 5"):
        run(tmp_path, [path], "vllm", "--tokens-prefix", str(tmp_path / "tokens"))
    with pytest.raises(ValueError, match="3 route rows for 5 tokens"):
        rec["num_tokens"] = 5
        run(tmp_path, [write_jsonl(tmp_path / "y.jsonl", [rec])], "vllm")
    with pytest.raises(ValueError, match="does not exist"):
        run(tmp_path, [tmp_path / "nope.jsonl"], "vllm")


@pytest.mark.parametrize("fmt, key", [("vllm", "routed_experts"), ("megatron", "moe_topk_indices")])
def test_t_minus_1_records_without_a_token_count_are_refused(tmp_path, fmt, key):
    """vLLM / Megatron inference give T - 1 rows for T tokens: without num_tokens, token_ids or
    --tokens-prefix the tool cannot know T, and taking the rows as complete would leave every
    document's routes one row short of its tokens. The same rows with the count convert."""
    rows = random_routes(3, seed=1).tolist()
    path = write_jsonl(tmp_path / f"{fmt}.jsonl", [{key: rows}])
    with pytest.raises(ValueError, match="holds T - 1 rows for T tokens; give its num_tokens"):
        run(tmp_path, [path], fmt)
    assert not list(tmp_path.glob("routes*"))  # nothing written
    counted = write_jsonl(tmp_path / f"{fmt}_n.jsonl", [{key: rows, "num_tokens": 4}])
    docs, _ = run(tmp_path, [counted], fmt)
    assert docs[0].shape == (4, L, K) and missing_mask(docs[0])[3].all()


def test_sglang_records_without_a_token_count_are_refused(tmp_path):
    """SGLang returns seqlen - 1 rows too: without prompt/completion counts, tokens or
    --tokens-prefix the last token's missing row would be silently dropped."""
    rows = random_routes(3, seed=1).tolist()
    path = write_jsonl(tmp_path / "s.jsonl", [{"meta_info": {"routed_experts": rows}}])
    with pytest.raises(ValueError, match="--format sglang record holds T - 1 rows"):
        run(tmp_path, [path], "sglang")
    assert not list(tmp_path.glob("routes*"))
    meta = {"routed_experts": rows, "prompt_tokens": 2, "completion_tokens": 2}
    docs, _ = run(tmp_path, [write_jsonl(tmp_path / "n.jsonl", [{"meta_info": meta}])], "sglang")
    assert docs[0].shape == (4, L, K) and missing_mask(docs[0])[3].all()


def test_a_null_or_empty_megatron_part_adds_no_rows(tmp_path):
    """null is an absent part and [] a part with no rows (an empty prompt): both convert."""
    rows = random_routes(3, seed=2)
    for prompt in (None, []):
        rec = {
            "prompt_moe_topk_indices": prompt,
            "moe_topk_indices": rows.tolist(),
            "num_tokens": 4,
        }
        docs, _ = run(tmp_path, [write_jsonl(tmp_path / "m.jsonl", [rec])], "megatron")
        assert np.array_equal(docs[0][:3], rows) and missing_mask(docs[0])[3].all()


def test_uint16_above_256_experts(tmp_path):
    routes = random_routes(3, seed=9, num_experts=300)
    np.save(tmp_path / "w.npy", routes)
    out = str(tmp_path / "wide")
    argv = [
        "--format",
        "npy",
        "--input",
        str(tmp_path / "w.npy"),
        "--output-prefix",
        out,
        "--num-layers",
        str(L),
        "--topk",
        str(K),
        "--num-experts",
        "300",
        "--no-progress",
    ]
    assert load_tool().main(argv) == 0
    ds = IndexedDataset(out)
    got = np.array(ds[0]).reshape(-1, L, K)
    assert got.dtype == np.uint16 and np.array_equal(got, routes)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """The tool as a user runs it: one line on stderr and exit status 2 for a user error."""
    import contextlib
    import io

    from megatron_ext.data.tool_errors import run_tool

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_tool(load_tool().main, argv)
    return rc, err.getvalue()


def test_uint8_id_255_is_a_real_expert_at_256_experts_top1(tmp_path, capsys):
    # 256 experts, top-1: the sidecar is uint16 (route_dtype) and 255 is a real id in a uint8
    # vLLM payload. It used to be taken as "missing" (and counted nowhere).
    rows = np.array([[[255]], [[3]]], dtype=np.uint8)  # T - 1 = 2 rows, L = 1, K = 1
    rec = {"routed_experts": encode_routed_experts(rows), "num_tokens": 3}
    out = str(tmp_path / "r256")
    argv = ["--format", "vllm", "--input", write_jsonl(tmp_path / "in.jsonl", [rec])]
    argv += ["--output-prefix", out, "--num-layers", "1", "--topk", "1", "--num-experts", "256"]
    assert load_tool().main([*argv, "--no-progress"]) == 0
    ds = IndexedDataset(out)
    got = np.array(ds[0]).reshape(-1, 1, 1)
    assert got.dtype == np.uint16 and got[:2, 0, 0].tolist() == [255, 3]
    assert missing_mask(got).tolist() == [[False], [False], [True]]  # only the T-1 row
    assert "1 T-1 rows appended" in capsys.readouterr().out


def _bad_input(tmp_path, kind: str, content) -> str:
    path = tmp_path / f"in.{kind}"
    if kind == "jsonl":
        path.write_bytes(content if isinstance(content, bytes) else (content + "\n").encode())
    elif kind == "npy":
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            np.save(path, content, allow_pickle=True)
    else:  # safetensors: a valid file, then cut or replaced
        write_safetensors(str(path), {"0": random_routes(3, seed=1).astype(np.uint8)})
        data = path.read_bytes()
        path.write_bytes(content(data))
    return str(path)


def _duplicate_first_tensor(data: bytes) -> bytes:
    """A safetensors file whose header lists its tensor twice (the same key)."""
    size = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + size].decode().strip()
    entry = header[1:-1]  # '"0": {...}' (the only tensor)
    doubled = ("{" + entry + "," + entry + "}").encode()
    return len(doubled).to_bytes(8, "little") + doubled + data[8 + size :]


ROWS = random_routes(2, seed=0).tolist()  # [2, L, K], valid
B64 = encode_routed_experts(np.asarray(ROWS, dtype=np.uint8))


def _vllm(routes, **extra) -> str:
    return json.dumps({"routed_experts": routes, "num_tokens": 3, **extra})


#: (case, input kind, content, format, extra flags, expected one-line message)
BAD_INPUTS = [
    (
        "fractional id",
        "jsonl",
        _vllm([[[1.5, 2]] * L] * 2),
        "vllm",
        [],
        r"in\.jsonl:1 routed_"
        r"experts: expert ids must be integers, got non-integer values such as 1\.5",
    ),
    (
        "string id",
        "jsonl",
        _vllm([[["1", "2"]] * L] * 2),
        "vllm",
        [],
        r":1 routed_experts: .*"
        "string values",
    ),
    ("boolean id", "jsonl", _vllm([[[True, False]] * L] * 2), "vllm", [], "boolean values"),
    ("NaN id", "jsonl", _vllm([[[float("nan"), 1]] * L] * 2), "vllm", [], "such as nan"),
    ("1e30 id", "jsonl", _vllm([[[1e30, 1]] * L] * 2), "vllm", [], r"such as 1e\+30"),
    ("2**64 id", "jsonl", _vllm([[[2**64, 1]] * L] * 2), "vllm", [], "beyond int64"),
    ("2**70 id named", "jsonl", _vllm([[[0, 2**70]] * L] * 2), "vllm", [], f"such as {2**70}"),
    ("2**63 id", "jsonl", _vllm([[[2**63, 1]] * L] * 2), "vllm", [], "within int64"),
    ("2**63 ids", "jsonl", _vllm([[[2**63, 2**63 + 1]] * L] * 2), "vllm", [], "is beyond int64"),
    ("ragged rows", "jsonl", _vllm([[[1, 2]] * L, [[1]] * L]), "vllm", [], ":1 .*ragged"),
    (
        "wrong layer count",
        "jsonl",
        _vllm([[[1, 2]] * (L - 1)] * 2),
        "vllm",
        [],
        f"have {L - 1} MoE layers x top-2, expected {L} MoE layers x top-2",
    ),
    (
        "num_tokens vs token_ids",
        "jsonl",
        _vllm(ROWS, token_ids=[1, 2, 3, 4]),
        "vllm",
        [],
        "num_tokens 3 disagrees with the 4 token_ids",
    ),
    (
        "non-numeric num_tokens",
        "jsonl",
        json.dumps({"routed_experts": ROWS, "num_tokens": "3"}),
        "vllm",
        [],
        "num_tokens must be a non-negative integer, got '3'",
    ),
    ("bad base64", "jsonl", _vllm({**B64, "data": "@@not base64"}), "vllm", [], "not valid base64"),
    (
        "float16 dtype",
        "jsonl",
        _vllm({**B64, "dtype": "float16"}),
        "vllm",
        [],
        "dtype 'float16' is not an integer route dtype",
    ),
    (
        "wrong byte count",
        "jsonl",
        _vllm({**B64, "shape": [3, L, K]}),
        "vllm",
        [],
        r"bytes do not hold shape \(3, 3, 2\)",
    ),
    (
        "non-integer shape",
        "jsonl",
        _vllm({**B64, "shape": ["2", L, K]}),
        "vllm",
        [],
        "'shape' must be 3 non-negative integers",
    ),
    ("non-UTF-8 line", "jsonl", b"\xff\xfe{}\n", "vllm", [], r"in\.jsonl:1: not UTF-8"),
    ("2-D npy", "npy", np.zeros((3, 2), np.uint8), "npy", [], r"got shape \(3, 2\)"),
    ("object npy", "npy", np.array([[[None]]], dtype=object), "npy", [], "not a readable .npy"),
    ("corrupt npy", "npy", b"\x93NUMPY garbage", "npy", [], "not a readable .npy"),
    ("float npy", "npy", np.full((2, L, K), 0.5), "npy", [], "non-integer values such as 0.5"),
    (
        "corrupt safetensors",
        "safetensors",
        lambda d: b"\x10" + b"\0" * 7 + b"{not json}xxxxxx",
        "safetensors",
        [],
        "safetensors header is not valid JSON",
    ),
    (
        "truncated safetensors",
        "safetensors",
        lambda d: d[:-5],
        "safetensors",
        [],
        r"tensor '0': bytes .* \(truncated or corrupt file\)",
    ),
    ("tiny safetensors", "safetensors", lambda d: d[:3], "safetensors", [], "only 3 bytes"),
    (
        "missing --tokens-prefix",
        "jsonl",
        _vllm(ROWS),
        "vllm",
        ["--tokens-prefix", "{tmp}/nope"],
        r"--tokens-prefix file .*nope\.idx does not exist",
    ),
    (
        "output is the tokens",
        "jsonl",
        _vllm(ROWS),
        "vllm",
        ["--tokens-prefix", "{tmp}/tokens", "--output-prefix", "{tmp}/tokens"],
        "is an input",
    ),
    (
        "existing output",
        "jsonl",
        _vllm(ROWS),
        "vllm",
        ["--output-prefix", "{tmp}/tokens"],
        r"tokens\.bin already exists; pass --overwrite",
    ),
    ("--num-layers 0", "jsonl", _vllm(ROWS), "vllm", ["--num-layers", "0"], "--num-layers must"),
    (  # numpy reads [true, 3] as [1, 3]: the boolean must not become expert 1
        "boolean among integer ids",
        "jsonl",
        _vllm([[[0, 1]] * L, [[2, 3]] * (L - 1) + [[True, 3]]]),
        "vllm",
        [],
        r"token 1, MoE layer 2 holds True, not an expert id",
    ),
    ("tokens with 0 layers", "npy", np.zeros((3, 0, K), np.uint8), "npy", [], "have 0 MoE layers"),
    ("3 empty rows", "jsonl", _vllm([[], [], []]), "vllm", [], r"got \(3, 0\)"),
    ("no rows of 5 layers", "npy", np.zeros((0, 5, K), np.uint8), "npy", [], "have 5 MoE layers"),
    (
        "base64 rows of 0 layers",
        "jsonl",
        _vllm({"data": "", "shape": [2, 0, K], "dtype": "uint8"}),
        "vllm",
        [],
        "have 0 MoE layers",
    ),
    (
        "megatron route key holding 0",
        "jsonl",
        json.dumps({"prompt_moe_topk_indices": ROWS, "moe_topk_indices": 0, "num_tokens": 3}),
        "megatron",
        [],
        "moe_topk_indices: expected nested lists or a base64 object, got 0",
    ),
    (
        "megatron route key holding ''",
        "jsonl",
        json.dumps({"moe_topk_indices": "", "num_tokens": 1}),
        "megatron",
        [],
        "moe_topk_indices: expected nested lists or a base64 object, got ''",
    ),
    (
        "a key twice in a record",
        "jsonl",
        f'{{"routed_experts": {json.dumps(ROWS)}, "num_tokens": 3, '
        f'"routed_experts": {json.dumps(ROWS[:1])}}}',
        "vllm",
        [],
        r"in\.jsonl:1: key 'routed_experts' appears twice",
    ),
    (
        "a tensor key twice in safetensors",
        "safetensors",
        lambda d: _duplicate_first_tensor(d),
        "safetensors",
        [],
        "safetensors header: key '0' appears twice",
    ),
]


@pytest.mark.parametrize(
    "kind, content, fmt, extra, match", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_inputs_give_one_line_errors(tmp_path, kind, content, fmt, extra, match):
    write_documents(str(tmp_path / "tokens"), [np.arange(3)])
    argv = ["--format", fmt, "--input", _bad_input(tmp_path, kind, content), "--no-progress"]
    argv += ["--output-prefix", str(tmp_path / "out"), "--num-layers", str(L), "--topk", str(K)]
    argv += ["--num-experts", str(E)] + [a.replace("{tmp}", str(tmp_path)) for a in extra]
    rc, err = run_cli(argv)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and __import__("re").search(match, err), err
    assert not os.path.exists(tmp_path / "out.idx")  # nothing half-written
    with pytest.raises(ValueError, match=match):  # --debug: the exception itself
        run_cli([*argv, "--debug"])


def test_overwrite_replaces_output_and_header(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"routed_experts": ROWS, "num_tokens": 3}])
    argv = ["--format", "vllm", "--input", src, "--output-prefix", str(tmp_path / "o")]
    argv += ["--num-layers", str(L), "--topk", str(K), "--num-experts", str(E), "--no-progress"]
    assert load_tool().main(argv) == 0
    header = json.loads((tmp_path / "o.routes.json").read_text())
    assert (header["num_layers"], header["topk"], header["num_experts"]) == (L, K, E)
    assert run_cli(argv)[0] == 2
    assert load_tool().main([*argv, "--overwrite"]) == 0


def test_an_input_without_records_is_refused(tmp_path):
    """An empty or blank JSONL wrote a 0-document sidecar; preprocess_data refuses the same."""
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n\n")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=f"{name} holds no route records"):
            run(tmp_path, [path], "vllm")
    assert not list(tmp_path.glob("routes*"))
