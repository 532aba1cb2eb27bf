"""tools/convert_routes.py on what vLLM and SGLang really return (tests/tools/engine_encoders.py,
written from vLLM 0.34 / 0.21 and SGLang 0.5.23's released source), converted and read back through
``RoutedPackedDataset``, equal row for row with the routes the engine captured.

Each case generates a model's routes (L >= 3 MoE layers, K in {1, 2, 8}, E in {8, 64, 256, 384},
dense layers first or interleaved, start offsets, n > 1 choices), encodes them as the engine would,
writes the tokens, converts with the model's layer map and ``--tokens-prefix``, and compares:
real tokens' rows exactly, rows before an offset and the last token's row missing.

Tier: Megatron on one rank (IndexedDataset files, BlendedMegatronDatasetBuilder; the tool runs
in-process via its main()).
"""

import json
import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.indexed_writer import write_documents
from megatron_ext.replay.moe_layer_map import moe_layer_ids_from_config
from megatron_ext.replay.route_dataset import RoutedPackedDataset, RoutedPackedDatasetConfig
from megatron_ext.replay.route_file import read_header
from megatron_ext.replay.routes import missing_value, route_dtype
from tests.data.dataset_helpers import build_splits, gpt_config_kwargs
from tests.tools import engine_encoders as enc
from tests.tools.test_convert_routes import load_tool

SEQ = 24

#: Hugging Face configs of the layer layouts the engines' model code reads (module doc of
#: megatron_ext/replay/moe_layer_map.py): DeepSeek-V3 style dense first layers, Qwen3-MoE
#: interleaved with an mlp_only layer, DeepSeek with moe_layer_freq, Mixtral (all MoE).
CONFIGS = {
    "deepseek_dense_first": {
        "num_hidden_layers": 5,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 1,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
    },
    "qwen3_interleaved": {
        "num_hidden_layers": 8,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [5],
        "num_experts": 64,
        "num_experts_per_tok": 2,
    },
    "deepseek_freq2": {
        "num_hidden_layers": 7,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 2,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
    },
    "mixtral_all_moe": {"num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 1},
    "glm_dense_first": {
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
    },
}


def test_layer_maps_of_the_configs():
    # Hand-derived from the rules (deepseek_v2.py, qwen3_moe.py): the cases below rely on them.
    want = {
        "deepseek_dense_first": (2, 3, 4),
        "qwen3_interleaved": (1, 3, 7),  # (i + 1) % 2 == 0, minus mlp_only 5
        "deepseek_freq2": (2, 4, 6),  # i >= 1 and i % 2 == 0
        "mixtral_all_moe": (0, 1, 2),
        "glm_dense_first": (1, 2, 3),
    }
    assert {k: moe_layer_ids_from_config(c, k) for k, c in CONFIGS.items()} == want


class Model:
    """A model's routes per document: the MoE rows the engine's routers chose."""

    def __init__(self, config_name: str, seed: int) -> None:
        self.config = CONFIGS[config_name]
        self.moe_ids = list(moe_layer_ids_from_config(self.config, config_name))
        self.num_decoder = self.config["num_hidden_layers"]
        self.topk = self.config["num_experts_per_tok"]
        self.experts = next(
            self.config[k]
            for k in ("num_experts", "n_routed_experts", "num_local_experts")
            if k in self.config
        )
        self.rng = np.random.default_rng(seed)

    def routes(self, num_tokens: int) -> np.ndarray:
        """[T, L, K] distinct ids per row; the next-to-last token's first MoE layer holds E - 1
        (255 at E = 256 is a real id, not the uint8 missing marker)."""
        keys = self.rng.random((num_tokens, len(self.moe_ids), self.experts))
        if num_tokens >= 2:
            keys[-2, 0, -1] = -1.0  # argsort puts E - 1 first
        return np.argsort(keys, axis=-1)[..., : self.topk]

    def buffer(self, moe_TLK: np.ndarray) -> np.ndarray:
        return enc.capture_buffer(moe_TLK, self.moe_ids, self.num_decoder)

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(1, 100, size=n).tolist()


def expected(moe_TLK: np.ndarray, start: int, model: Model) -> np.ndarray:
    """The sidecar document: rows before ``start`` and the last token's missing."""
    dtype = route_dtype(model.experts, model.topk)
    out = moe_TLK.astype(dtype)
    out[:start] = missing_value(dtype)
    out[-1] = missing_value(dtype)
    return out


def vllm034_case(model: Model, api: str, n: int, prompt_start: int):
    lines, docs, tokens = [], [], []
    for r in range(3):
        prompt = model.tokens(4 + r)
        completions = [model.tokens(3 + 2 * c + r) for c in range(n)]
        prompt_moe = model.routes(len(prompt))  # one prompt: the same rows for every choice
        full = [np.concatenate([prompt_moe, model.routes(len(c))]) for c in completions]
        rows = [
            enc.vllm034_rows(model.buffer(f), len(prompt), model.experts, prompt_start)
            for f in full
        ]
        lines.append(json.dumps(enc.vllm034_response(api, prompt, completions, rows)))
        start = min(prompt_start, len(prompt))
        docs += [expected(f, start, model) for f in full]
        tokens += [prompt + c for c in completions]
    return lines, docs, tokens


def vllm021_case(model: Model, n: int, fingerprint: str | None = None):
    lines, docs, tokens = [], [], []
    for r in range(3):
        prompt = model.tokens(3 + r)
        completions = [model.tokens(2 + c + r) for c in range(n)]
        prompt_moe = model.routes(len(prompt))
        full = [np.concatenate([prompt_moe, model.routes(len(c))]) for c in completions]
        # vLLM 0.21's own rows (MoE rows by moe_layer_id), T - 1 of them: the last token is
        # never fed forward.
        captured = [enc.vllm021_capture_buffer(f, model.config)[:-1] for f in full]
        answer = enc.vllm021_response(prompt, completions, captured, fingerprint)
        lines.append(json.dumps(answer))
        docs += [expected(f, 0, model) for f in full]
        tokens += [prompt + c for c in completions]
    return lines, docs, tokens


def sglang_generate_case(model: Model, start_len: int, batched: bool):
    answers, docs, tokens = [], [], []
    for r in range(4):
        prompt, output = model.tokens(5 + r), model.tokens(2 + r)
        if r == 3:  # T = 1: no token was fed forward, an empty payload of no shape
            prompt, output = model.tokens(1), []
        full = model.routes(len(prompt) + len(output))
        payload = enc.sglang_base64(model.buffer(full), start_len)
        answer = enc.sglang_generate(prompt, output, payload)
        answer["routed_experts_start_len"] = start_len  # the request's value, kept beside it
        answers.append(answer)
        docs.append(expected(full, min(start_len, full.shape[0] - 1), model))
        if full.shape[0] == 1:
            assert answer["meta_info"]["routed_experts"] == ""
        tokens.append(prompt + output)
    lines = (
        [json.dumps(answers[:2]), json.dumps(answers[2:])]
        if batched
        else list(map(json.dumps, answers))
    )
    return lines, docs, tokens


def sglang_openai_case(model: Model, n: int):
    lines, docs, tokens = [], [], []
    for r in range(3):
        prompt = model.tokens(4 + r)
        outputs = [model.tokens(3 + c) for c in range(n)]
        full = [model.routes(len(prompt) + len(o)) for o in outputs]
        payloads = [enc.sglang_base64(model.buffer(f), 0) for f in full]
        lines.append(json.dumps(enc.sglang_openai_chat(prompt, outputs, payloads, n > 1)))
        docs += [expected(f, 0, model) for f in full]
        tokens += [prompt + o for o in outputs]
    return lines, docs, tokens


CASES = {
    # name: (config, format, case builder, extra flags)
    "vllm034 completion n=2, dense first, E=256 K=8": (
        "deepseek_dense_first",
        "vllm",
        lambda m: vllm034_case(m, "completion", 2, 0),
        [],
    ),
    "vllm034 chat, interleaved, prompt start 3, E=64 K=2": (
        "qwen3_interleaved",
        "vllm",
        lambda m: vllm034_case(m, "chat", 1, 3),
        ["--routed-experts-start", "3", "--max-missing-fraction", "0.5"],
    ),
    "vllm034 chat n=3, E=384 uint16, start beyond the prompt": (
        "deepseek_freq2",
        "vllm",
        lambda m: vllm034_case(m, "chat", 3, 50),
        ["--routed-experts-start", "50", "--max-missing-fraction", "1"],
    ),
    # vLLM 0.21 counts 3 rows for this Qwen3-MoE config: exactly its MoE rows.
    "vllm021 split n=2, counted right: MoE rows only, E=64 K=2": (
        "qwen3_interleaved",
        "vllm",
        lambda m: vllm021_case(m, 2),
        [],
    ),
    # GLM-4.5's first_k_dense_replace: 4 rows, MoE rows first (no fingerprint: the split form).
    "vllm021 split n=2, no fingerprint, dense first: MoE rows first, E=8 K=2": (
        "glm_dense_first",
        "vllm",
        lambda m: vllm021_case(m, 2),
        [],
    ),
    # DeepSeek's first_k_dense_replace: vLLM 0.21 counts 5 rows and writes the 3 MoE rows first
    # (the version from the server's system_fingerprint).
    "vllm021 split n=2, dense first: MoE rows first, then zeros, E=256 K=8": (
        "deepseek_dense_first",
        "vllm",
        lambda m: vllm021_case(m, 2, fingerprint="vllm-0.21.0-tp2-3f9c1a2b"),
        [],
    ),
    "sglang generate batched, start_len 2, E=384 K=8": (
        "deepseek_freq2",
        "sglang",
        lambda m: sglang_generate_case(m, 2, batched=True),
        ["--max-missing-fraction", "0.5"],
    ),
    "sglang generate, dense first, E=256 K=8": (
        "deepseek_dense_first",
        "sglang",
        lambda m: sglang_generate_case(m, 0, batched=False),
        [],
    ),
    "sglang openai sglext n=1, all MoE, E=8 K=1": (
        "mixtral_all_moe",
        "sglang",
        lambda m: sglang_openai_case(m, 1),
        [],
    ),
    "sglang openai meta_info per choice n=2, interleaved": (
        "qwen3_interleaved",
        "sglang",
        lambda m: sglang_openai_case(m, 2),
        [],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_answers_convert_exactly_and_read_back_through_the_dataset(tmp_path, case):
    config_name, fmt, build_case, extra = CASES[case]
    model = Model(config_name, seed=len(case))
    lines, want_docs, token_docs = build_case(model)
    (tmp_path / "config.json").write_text(json.dumps(model.config))
    (tmp_path / "in.jsonl").write_text("".join(line + "\n" for line in lines))
    prefix = str(tmp_path / "data")
    write_documents(prefix, [np.array(t) for t in token_docs], np.int32)
    argv = ["--format", fmt, "--input", str(tmp_path / "in.jsonl"), "--no-progress"]
    argv += ["--model-config", str(tmp_path / "config.json"), "--output-prefix", prefix + "_routes"]
    assert load_tool().main([*argv, "--tokens-prefix", prefix, *extra]) == 0

    header = read_header(prefix + "_routes.routes.json")
    assert header["moe_layer_ids"] == model.moe_ids and header["num_layers"] >= 3
    routes = IndexedDataset(prefix + "_routes")
    assert len(routes) == len(want_docs) == len(token_docs)
    L, K = len(model.moe_ids), model.topk
    for d, want in enumerate(want_docs):  # every document, row for row
        got = np.array(routes[d]).reshape(-1, L, K)
        assert got.dtype == want.dtype and np.array_equal(got, want), (case, d)
    assert all((w[-2, 0] == model.experts - 1).any() for w in want_docs if len(w) > 1)  # real id

    kwargs = gpt_config_kwargs([prefix], sequence_length=SEQ, path_to_cache=str(tmp_path / "c"))
    kwargs.update(pad_to_seq_len=True, route_suffix="_routes", route_num_layers=L, route_topk=K)
    kwargs.update(route_num_experts=model.experts)
    ds = build_splits(RoutedPackedDataset, RoutedPackedDatasetConfig(**kwargs), [8, 0, 0])[0]
    seen = set()
    for i in range(len(ds)):
        sample = ds[i]
        doc_Q, start_Q, len_Q = ds.pack_pieces(i)
        real = np.concatenate(
            [want_docs[d][s : s + n] for d, s, n in zip(doc_Q, start_Q, len_Q, strict=True)]
        )
        assert np.array_equal(sample["routes"].numpy()[: real.shape[0]], real), (case, i)
        seen.update(int(d) for d in doc_Q)
    assert seen == set(range(len(want_docs)))  # every document went through a pack


def test_dense_row_that_is_not_zero_is_refused_naming_layer_and_token(tmp_path):
    model = Model("deepseek_dense_first", seed=1)
    full = model.routes(6)
    buffer = model.buffer(full)
    buffer[3, 1] = [7] * model.topk  # token 3 routed on decoder layer 1: the map is wrong
    prompt, output = model.tokens(4), model.tokens(2)
    answer = enc.sglang_generate(prompt, output, enc.sglang_base64(buffer, 0))
    (tmp_path / "in.jsonl").write_text(json.dumps(answer) + "\n")
    (tmp_path / "config.json").write_text(json.dumps(model.config))
    argv = ["--format", "sglang", "--input", str(tmp_path / "in.jsonl"), "--no-progress"]
    argv += ["--model-config", str(tmp_path / "config.json")]
    argv += ["--output-prefix", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=r"in.jsonl:1: token 3, decoder layer 1 is dense by the"):
        load_tool().main(argv)
    assert not os.path.exists(tmp_path / "out.idx")
    # Without the layer map the 5-layer rows are refused as a layer count (never guessed).
    argv = [a for a in argv if a not in ("--model-config", str(tmp_path / "config.json"))]
    with pytest.raises(ValueError, match=r"that is 5 layers x top-8 per row"):
        load_tool().main([*argv, "--num-layers", "3", "--topk", "8", "--num-experts", "256"])


def _sglang_dump(tmp_path, start_len: int) -> list[str]:
    """Two SGLang answers of a DeepSeek-style model (dense layers 0-1) with ``start_len``."""
    model = Model("deepseek_dense_first", seed=2)
    lines = []
    for _ in range(2):
        prompt, output = model.tokens(6), model.tokens(4)
        payload = enc.sglang_base64(model.buffer(model.routes(10)), start_len)
        lines.append(json.dumps(enc.sglang_generate(prompt, output, payload)))
    (tmp_path / "in.jsonl").write_text("".join(line + "\n" for line in lines))
    (tmp_path / "config.json").write_text(json.dumps(model.config))
    argv = ["--format", "sglang", "--input", str(tmp_path / "in.jsonl"), "--no-progress"]
    return argv + ["--output-prefix", str(tmp_path / "out")]


def test_start_offsets_beyond_the_missing_limit_are_refused_unless_allowed(tmp_path):
    argv = _sglang_dump(tmp_path, start_len=3)
    argv += ["--model-config", str(tmp_path / "config.json"), "--routed-experts-start", "3"]
    # 3 of 10 tokens per document before the offset: 30% of the rows, over the 5% default.
    with pytest.raises(ValueError, match=r"18 of 60 \(token, layer\) rows \(30.00%\) have no "
                       r"engine route \(6 tokens before start offsets"):  # fmt: skip
        load_tool().main(argv)
    assert not os.path.exists(tmp_path / "out.idx")
    assert load_tool().main([*argv, "--max-missing-fraction", "0.3"]) == 0


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--moe-layer-ids", "1-4"], "--moe-layer-ids 1-4 disagrees with --model-config's MoE"),
        (["--num-layers", "4"], "--num-layers 4 disagrees with the layer map's 3"),
        (["--num-decoder-layers", "6"], "disagrees with --model-config's num_hidden_layers 5"),
        (["--max-missing-fraction", "2"], r"--max-missing-fraction must be in \[0, 1\]"),
    ],
)
def test_layer_map_flags_that_disagree_are_refused(tmp_path, extra, match):
    argv = _sglang_dump(tmp_path, 0) + ["--model-config", str(tmp_path / "config.json")]
    with pytest.raises(ValueError, match=match):
        load_tool().main([*argv, *extra])


def test_moe_layer_ids_alone_select_the_moe_rows(tmp_path):
    argv = _sglang_dump(tmp_path, 0)
    argv += ["--moe-layer-ids", "2-4", "--num-decoder-layers", "5", "--topk", "8"]
    assert load_tool().main([*argv, "--num-experts", "256"]) == 0
    assert read_header(str(tmp_path / "out.routes.json"))["moe_layer_ids"] == [2, 3, 4]
    with pytest.raises(ValueError, match="--num-experts is required"):
        load_tool().main([*argv, "--overwrite"])


def test_records_in_another_order_than_the_tokens_are_refused(tmp_path):
    """Equal lengths pass every count check; the token ids vLLM returns name the mismatch."""
    model = Model("mixtral_all_moe", seed=3)
    lines, tokens = [], []
    for _ in range(2):
        prompt, completion = model.tokens(4), model.tokens(3)
        rows = enc.vllm034_rows(model.buffer(model.routes(7)), 4, model.experts, 0)
        lines.append(json.dumps(enc.vllm034_response("chat", prompt, [completion], [rows])))
        tokens.append(np.array(prompt + completion))
    (tmp_path / "in.jsonl").write_text("".join(line + "\n" for line in lines))
    (tmp_path / "config.json").write_text(json.dumps(model.config))
    argv = ["--format", "vllm", "--input", str(tmp_path / "in.jsonl"), "--no-progress"]
    argv += ["--model-config", str(tmp_path / "config.json"), "--tokens-prefix"]
    write_documents(str(tmp_path / "swapped"), tokens[::-1], np.int32)
    with pytest.raises(
        ValueError, match=r"in.jsonl:1 choice 0: token 0 is \d+ but token document 0"
    ):
        load_tool().main([*argv, str(tmp_path / "swapped"), "--output-prefix", str(tmp_path / "o")])
    write_documents(str(tmp_path / "right"), tokens, np.int32)
    assert (
        load_tool().main([*argv, str(tmp_path / "right"), "--output-prefix", str(tmp_path / "o")])
        == 0
    )


def test_a_config_whose_block_types_outnumber_its_layers_is_refused_naming_the_file(tmp_path):
    """``layers_block_type`` longer than ``num_hidden_layers``: the config's own inconsistency,
    named with the file (it was refused as "--moe-layer-ids names layer 5", a flag never given)."""
    argv = _sglang_dump(tmp_path, 0) + ["--model-config", str(tmp_path / "config.json")]
    config = tmp_path / "config.json"
    blocks = ["attention", "attention", "moe", "moe", "moe", "moe"]  # 6 entries, layers 0-5
    config.write_text(json.dumps({**json.loads(config.read_text()), "layers_block_type": blocks}))
    with pytest.raises(ValueError) as err:
        load_tool().main(argv)
    assert str(err.value) == (
        f"--model-config {config}: 'layers_block_type' lists 6 layers, 'num_hidden_layers' is 5"
    )


def _vllm021_deepseek_dump(tmp_path, fingerprint: str | None) -> list[str]:
    """A vLLM 0.21 answer of a DeepSeek-style model (dense layers 0-1): 5 rows, MoE first."""
    model = Model("deepseek_dense_first", seed=4)
    assert enc.vllm021_count_moe_layers(model.config) == 5  # misses first_k_dense_replace
    prompt, completion = model.tokens(5), model.tokens(4)
    full = model.routes(9)
    captured = enc.vllm021_capture_buffer(full, model.config)[:-1]
    assert captured[:, :3].any() and not captured[:, 3:].any()  # the case: MoE rows first
    answer = enc.vllm021_response(prompt, [completion], [captured], fingerprint)
    (tmp_path / "in.jsonl").write_text(json.dumps(answer) + "\n")
    (tmp_path / "config.json").write_text(json.dumps(model.config))
    argv = ["--format", "vllm", "--input", str(tmp_path / "in.jsonl"), "--no-progress"]
    return argv + ["--model-config", str(tmp_path / "config.json")]


def test_vllm021_row_order_comes_from_the_engine_version_or_the_flag(tmp_path):
    """vLLM 0.21's MoE-first rows: read as such when its system_fingerprint names 0.21, or its
    split form has no fingerprint, or --vllm-moe-rows first says so; a fingerprint of another
    version (or --vllm-moe-rows decoder) reads row i as decoder layer i, refused with a hint
    naming both causes. The rows being zero never decides."""
    out = ["--output-prefix", str(tmp_path / "out")]
    for fingerprint, extra in [
        ("vllm-0.21.0-3f9c1a2b", []),
        (None, []),
        ("vllm-0.22.1-3f9c1a2b", ["--vllm-moe-rows", "first"]),
    ]:
        argv = _vllm021_deepseek_dump(tmp_path, fingerprint)
        assert load_tool().main([*argv, *out, *extra, "--overwrite"]) == 0
        assert read_header(str(tmp_path / "out.routes.json"))["moe_layer_ids"] == [2, 3, 4]
    for fingerprint, extra in [
        ("vllm-0.22.1-3f9c1a2b", []),
        ("vllm-0.21.0-3f9c1a2b", ["--vllm-moe-rows", "decoder"]),
    ]:
        argv = _vllm021_deepseek_dump(tmp_path, fingerprint)
        with pytest.raises(ValueError, match=r"choice 0: token 0, decoder layer 0 is dense .* "
                           r"or the dump is vLLM 0.21's.* pass --vllm-moe-rows first"):  # fmt: skip
            load_tool().main([*argv, "--output-prefix", str(tmp_path / "refused"), *extra])
    assert not os.path.exists(tmp_path / "refused.idx")
