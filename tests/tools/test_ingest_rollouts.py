"""tools/ingest_rollouts.py (``megatron-ext ingest-rollouts``) on engine answers built as vLLM 0.34
/ 0.21 and SGLang 0.5.23's released source builds them (tests/tools/engine_encoders.py) and on
prime-rl records: tokens read back with Megatron's IndexedDataset, the loss mask, the per-token
sidecars, the route sidecar byte-identical to what convert-routes writes for the same dump, and
every header keyed by the tokens' digest. Bad input: one line, exit status 2, nothing written.

Tier: Megatron on one rank (IndexedDataset files; the tools run in-process via their main()).
"""

import importlib.util
import json
import os
import re

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.sidecar_header import check_tokens_digest, read_sidecar_header
from megatron_ext.data.tool_errors import run_tool
from megatron_ext.replay.rollout_routes import encode_routed_experts
from megatron_ext.replay.route_file import read_header, tokens_digest
from tests.tools import engine_encoders as enc
from tests.tools.test_convert_routes import load_tool as load_convert_routes

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "ingest_rollouts.py")
#: DeepSeek-style: decoder layer 0 dense, MoE layers 1-3, top-2 of 8.
CONFIG = {"num_hidden_layers": 4, "first_k_dense_replace": 1, "n_routed_experts": 8,
          "num_experts_per_tok": 2}  # fmt: skip
MOE, N, K, E = [1, 2, 3], 4, 2, 8


def load_tool():
    spec = importlib.util.spec_from_file_location("ingest_rollouts", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _moe_routes(rng, num_tokens: int) -> np.ndarray:
    return np.argsort(rng.random((num_tokens, len(MOE), E)), axis=-1)[..., :K]


def vllm_dump(rng) -> tuple[list[str], list[tuple[list, list]], dict]:
    """Two vLLM 0.34 chat responses with n = 2 and a completion response (5 sequences), with
    per-choice advantages and vLLM's logprobs objects, and a per-response reward."""
    lines, sequences = [], []
    values = {"advantages": [], "logprobs": [], "reward": []}
    for r, api in enumerate(["chat", "chat", "completion"]):
        prompt = rng.integers(1, 100, 3 + r).tolist()
        completions = [rng.integers(1, 100, 2 + c + r).tolist() for c in range(2 if r < 2 else 1)]
        rows = []
        for c in completions:
            buffer = enc.capture_buffer(_moe_routes(rng, len(prompt) + len(c)), MOE, N)
            rows.append(enc.vllm034_rows(buffer, len(prompt), E, prompt_start=0))
        response = enc.vllm034_response(api, prompt, completions, rows)
        response["reward"] = float(r) - 0.5  # the RL framework's, kept beside the response
        for choice, c in zip(response["choices"], completions, strict=True):
            advantages = rng.normal(size=len(c)).round(3).tolist()
            logprobs = (-rng.random(len(c))).round(3).tolist()
            choice["advantages"] = advantages
            if api == "chat":  # vLLM 0.34 ChatCompletionLogProbs.content[i].logprob
                content = [{"token": "t", "logprob": v, "bytes": None} for v in logprobs]
                choice["logprobs"] = {"content": content}
            else:  # CompletionLogProbs.token_logprobs
                choice["logprobs"] = {"token_logprobs": logprobs, "tokens": ["t"] * len(c),
                                      "text_offset": [0] * len(c), "top_logprobs": []}  # fmt: skip
            sequences.append((prompt, c))
            values["advantages"].append(advantages)
            values["logprobs"].append(logprobs)
            values["reward"].append([response["reward"]] * len(c))
        lines.append(json.dumps(response))
    return lines, sequences, values


def _write(tmp_path, lines: list[str]) -> list[str]:
    (tmp_path / "in.jsonl").write_text("".join(line + "\n" for line in lines))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    argv = ["--input", str(tmp_path / "in.jsonl"), "--no-progress"]
    return argv + ["--model-config", str(tmp_path / "config.json")]


def _documents(prefix: str) -> list[np.ndarray]:
    ds = IndexedDataset(prefix)
    return [np.array(ds[i]) for i in range(len(ds))]


def test_a_vllm_dump_ingests_to_tokens_mask_routes_and_values_keyed_by_one_digest(tmp_path):
    lines, sequences, values = vllm_dump(np.random.default_rng(0))
    argv = _write(tmp_path, lines) + ["--format", "vllm"]
    prefix = str(tmp_path / "rl")
    keys = ["--token-keys", "advantages,logprobs", "--sequence-keys", "reward"]
    assert load_tool().main([*argv, "--output-prefix", prefix, *keys]) == 0

    tokens = _documents(prefix)  # Megatron's own reader
    assert [t.tolist() for t in tokens] == [p + c for p, c in sequences]
    masks = _documents(prefix + "_loss_mask")
    assert [m.tolist() for m in masks] == [[0] * len(p) + [1] * len(c) for p, c in sequences]
    for name in ("advantages", "logprobs", "reward"):
        got = _documents(f"{prefix}_{name}")
        assert all(g.dtype == np.float32 for g in got)
        want = [[0.0] * len(p) + v for (p, _c), v in zip(sequences, values[name], strict=True)]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, np.asarray(w, dtype=np.float32))  # float32 of each
    assert any(v != 0 for v in values["reward"][0])  # broadcast a non-zero value

    # The route sidecar is what convert-routes writes for the same dump and these tokens.
    assert load_convert_routes().main(
        [*argv, "--tokens-prefix", prefix, "--output-prefix", str(tmp_path / "converted")]
    ) == 0  # fmt: skip
    for ext in (".bin", ".idx", ".routes.json"):
        ingested = (tmp_path / f"rl_routes{ext}").read_bytes()
        assert ingested == (tmp_path / f"converted{ext}").read_bytes(), ext
    header = read_header(prefix + "_routes.routes.json")
    assert header["moe_layer_ids"] == MOE and header["num_documents"] == len(sequences)
    # One digest: the route header's and every sidecar header's are the tokens' content digest.
    digest = tokens_digest(prefix)
    assert header["tokens_digest"] == digest
    for name, scope in [("loss_mask", "mask"), ("advantages", "completion"),
                        ("logprobs", "completion"), ("reward", "sequence")]:  # fmt: skip
        assert check_tokens_digest(f"{prefix}_{name}", prefix)["scope"] == scope
        assert read_sidecar_header(f"{prefix}_{name}.sidecar.json")["tokens_digest"] == digest


def _sglang_and_records(rng) -> tuple[list[str], list[tuple[list, list]], list[list]]:
    """An SGLang /generate answer (return_prompt_token_ids, output_token_logprobs), an SGLang
    sample (tokens split by meta_info.prompt_tokens) and a prime-rl record (prompt_ids /
    completion_ids, its base64 routes object, completion_logprobs) in one --format each."""
    out = {}
    prompt, output = rng.integers(1, 100, 4).tolist(), rng.integers(1, 100, 3).tolist()
    buffer = enc.capture_buffer(_moe_routes(rng, 7), MOE, N)
    answer = enc.sglang_generate(prompt, output, enc.sglang_base64(buffer, 0))
    answer["prompt_token_ids"] = prompt  # tokenizer_manager.py: out_dict["prompt_token_ids"]
    lp = (-rng.random(3)).round(3).tolist()
    answer["meta_info"]["output_token_logprobs"] = [
        [v, t, None] for v, t in zip(lp, output, strict=True)
    ]
    sample = {"tokens": prompt + output, "meta_info": dict(answer["meta_info"])}
    out["sglang"] = ([answer, sample], [(prompt, output)] * 2, [lp, lp])
    routes = _moe_routes(rng, 6)[:-1].astype(np.uint8)  # T - 1 rows of the MoE layers
    record = {"prompt_ids": [1, 2], "completion_ids": [3, 4, 5, 6],
              "routed_experts": encode_routed_experts(routes),
              "completion_logprobs": [-0.5, -0.25, -1.0, -2.0]}  # fmt: skip
    out["vllm"] = ([record], [([1, 2], [3, 4, 5, 6])], [record["completion_logprobs"]])
    return out


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_sglang_answers_and_prime_rl_records_ingest(tmp_path, fmt):
    lines, sequences, logprobs = _sglang_and_records(np.random.default_rng(1))[fmt]
    key = "output_token_logprobs" if fmt == "sglang" else "completion_logprobs"
    argv = _write(tmp_path, [json.dumps(line) for line in lines])
    prefix = str(tmp_path / "rl")
    argv += ["--format", fmt, "--output-prefix", prefix, "--token-keys", f"logprobs={key}"]
    assert load_tool().main(argv) == 0
    assert [t.tolist() for t in _documents(prefix)] == [p + c for p, c in sequences]
    masks = [m.tolist() for m in _documents(prefix + "_loss_mask")]
    assert masks == [[0] * len(p) + [1] * len(c) for p, c in sequences]
    got = [g.tolist() for g in _documents(prefix + "_logprobs")]
    want = [
        np.float32([0] * len(p) + v).tolist() for (p, _), v in zip(sequences, logprobs, strict=True)
    ]
    assert got == want
    routes = _documents(prefix + "_routes")
    assert [r.size for r in routes] == [(len(p) + len(c)) * len(MOE) * K for p, c in sequences]


#: Bad records (a vLLM 0.34 chat response, n = 1, edited) and flags: (edit, flags, message).
BAD = {
    "per-token key missing": (lambda r: r["choices"][0].pop("advantages"), [],
                              r"in.jsonl:1 choice 0: has no 'advantages'"),
    "advantages of the wrong length": (
        lambda r: r["choices"][0]["advantages"].append(1.0), [],
        r"in.jsonl:1 choice 0 advantages: 3 values for the 2 completion tokens"),
    "NaN advantage": (lambda r: r["choices"][0]["advantages"].__setitem__(1, float("nan")), [],
                      r"in.jsonl:1 choice 0 advantages\[1\] is nan, not a finite number"),
    "NaN log-prob": (
        lambda r: r["choices"][0]["logprobs"]["content"][0].__setitem__("logprob", float("nan")),
        [], r"in.jsonl:1 choice 0 logprobs\[0\] is nan"),
    "a list as a per-sequence value": (
        lambda r: r.__setitem__("reward", [1.0]), [], r"reward: a per-sequence key"),
    "no token ids (return_token_ids off)": (
        lambda r: r.pop("prompt_token_ids"), [], r"in.jsonl:1 choice 0: needs prompt_token_ids"),
    "flags that disagree with the config": (
        lambda r: None, ["--num-layers", "4"], r"--num-layers 4 disagrees with the layer map's 3"),
    "a dump of another layer map": (
        lambda r: None, ["--moe-layer-ids", "0-2", "--model-config", "", "--num-decoder-layers",
                         "4", "--topk", "2", "--num-experts", "8"],
        r"in.jsonl:1 choice 0: token 0, decoder layer 3 is dense by the layer map"),
    "a reserved name": (lambda r: None, ["--token-keys", "routes"], r"'routes' is the tool's own"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, case, capsys):
    edit, flags, message = BAD[case]
    rng = np.random.default_rng(2)
    lines, _, _ = vllm_dump(rng)
    response = json.loads(lines[0])
    response["choices"] = response["choices"][:1]
    edit(response)
    argv = _write(tmp_path, [json.dumps(response), lines[1]]) + ["--format", "vllm"]
    if "--model-config" in flags:  # the layer map from ids instead
        at = argv.index("--model-config")
        argv = argv[:at] + argv[at + 2 :]
        flags = [f for f in flags if f not in ("--model-config", "")]
    argv += ["--output-prefix", str(tmp_path / "rl"), "--token-keys", "advantages,logprobs"]
    argv += ["--sequence-keys", "reward", *flags]
    assert run_tool(load_tool().main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "in.jsonl"]


def test_an_existing_output_is_refused_unless_overwrite(tmp_path):
    lines, _, _ = vllm_dump(np.random.default_rng(3))
    argv = _write(tmp_path, lines) + ["--format", "vllm", "--output-prefix", str(tmp_path / "rl")]
    assert load_tool().main(argv) == 0
    before = (tmp_path / "rl.idx").stat().st_ino
    with pytest.raises(ValueError, match=r"rl.bin already exists; pass --overwrite"):
        load_tool().main(argv)
    assert load_tool().main([*argv, "--overwrite"]) == 0
    assert (tmp_path / "rl.idx").stat().st_ino != before  # replaced, by rename
