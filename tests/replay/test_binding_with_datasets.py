"""Tier: gloo ranks (real Megatron GPTModel on CPU, one rank) with the route sidecar dataset.

Self-padded packs from RoutedPackedDataset replay, on the model, the routes of the tokens each pad
copies; record mode writes a sidecar (RouteRecorder) that replays exactly after perturbing routers.
"""

import torch

from megatron_ext.testing import run_distributed
from tests.replay.replay_model import (
    BATCH,
    build_model_for_seq,
    capture_maps,
    routers,
)


def _packed_self_padded_replay(root: str, policy: str = "native") -> dict:
    """Samples of a RoutedPackedDataset (self-padded packs) replayed on the model: every position,
    pads included, routes to the experts of the sample's routes; pads = their source token's.
    Under ``balanced`` the rows without a recorded route are filled by the data, a pad copying such
    a token included: it must replay its source's fill."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    from megatron_ext.replay.binding import RouteReplayBinding
    from megatron_ext.replay.route_dataset import RoutedPackedDataset, RoutedPackedDatasetConfig
    from tests.data.dataset_helpers import gpt_config_kwargs

    seq = 32
    config = RoutedPackedDatasetConfig(
        **gpt_config_kwargs([f"{root}/docs"], sequence_length=seq, path_to_cache=f"{root}/cache"),
        pad_to_seq_len=True,
        route_num_layers=2,
        route_topk=2,
        route_num_experts=8,
        route_missing_policy=policy,
    )
    ds = BlendedMegatronDatasetBuilder(
        RoutedPackedDataset, [4, 0, 0], lambda: True, config
    ).build()[0]
    samples = [ds[i] for i in range(BATCH)]
    tokens = torch.stack([s["tokens"] for s in samples])
    routes = torch.stack([s["routes"] for s in samples])
    src = torch.stack([s["src_index"] for s in samples])
    torch.manual_seed(7)
    model = build_model_for_seq(seq)
    binding = RouteReplayBinding(model, "replay")
    log, handles = capture_maps(model)
    binding.install(routes, key=0)
    model(
        tokens, torch.arange(seq).expand(BATCH, seq), attention_mask=None, labels=tokens
    ).sum().backward()
    for h in handles:
        h.remove()
    positions = binding._my_positions(BATCH, seq)
    n_real = torch.tensor([seq - int(s["padding_mask"].sum()) for s in samples])
    is_pad_N = (positions % seq) >= n_real[positions // seq]
    copies_N = src.reshape(-1)[positions]  # the real position each router row copies
    has_route_N = ~(routes.reshape(-1, 2, 2)[positions] == 255).all(-1).any(-1)
    pad_rows = is_pad_N & has_route_N
    ok = True
    for r in binding.replays:
        got = log[r.layer_number][0]
        want = torch.zeros_like(got).scatter(
            1, routes.reshape(-1, 2, 2)[positions][:, r.moe_ordinal].long().clamp(max=7), True
        )
        ok &= torch.equal(got[has_route_N], want[has_route_N])
        # A pad row's experts equal those of the real token it copies (same sample).
        sample_N = positions // seq
        source_rows = sample_N * seq + copies_N
        source_routes = routes.reshape(-1, 2, 2)[source_rows][:, r.moe_ordinal]
        ok &= torch.equal(
            got[pad_rows],
            torch.zeros_like(got[pad_rows]).scatter(1, source_routes[pad_rows].long(), True),
        )
    binding.remove()
    return {
        "ok": ok,
        "pads": int(pad_rows.sum()),
        "routes": routes,
        "pad_rows": pad_rows,  # router rows (Megatron's [S, B] order) that are pads with a route
        "positions": positions,  # router row -> flat [B, S] position
    }


def _both_policies(root: str) -> dict:
    native = _packed_self_padded_replay(root, "native")
    balanced = _packed_self_padded_replay(root, "balanced")
    # Pads whose source token has no recorded route (missing in the native samples): under
    # balanced they carry a fill, which must be their source's (checked in the replay above).
    missing_BS = (native["routes"].reshape(-1, 2, 2) == 255).all(-1).any(-1)
    missing_N = missing_BS[balanced["positions"]]
    return {
        "native": native["ok"] and native["pads"] > 0,
        "balanced": balanced["ok"] and bool((balanced["routes"] != 255).all()),
        "balanced_pads_of_missing": int((balanced["pad_rows"] & missing_N).sum()),
    }


def test_packed_self_padded_data_replays_pad_routes_of_copied_tokens(tmp_path):
    import numpy as np

    from megatron_ext.data.indexed_writer import write_documents

    rng = np.random.default_rng(0)
    # 10-25 tokens: packs of 32 leave pads that copy a token without a route (measured: 3 of 4)
    docs = [rng.integers(1, 100, size=int(n)) for n in rng.integers(10, 25, size=12)]
    write_documents(str(tmp_path / "docs"), docs)
    routes = []
    for doc in docs:
        r = np.stack(
            [[[(t + layer + k) % 8 for k in range(2)] for layer in range(2)] for t in doc]
        ).astype(np.uint8)
        r[-1] = 255  # vLLM: the last token has no route -> native
        r[: len(doc) % 2] = 255  # odd-length documents: the first token has none either
        routes.append(r)
    write_documents(str(tmp_path / "docs_routes"), routes, dtype=np.uint8)
    (result,) = run_distributed(_both_policies, 1, str(tmp_path))
    assert result["native"] and result["balanced"]
    assert result["balanced_pads_of_missing"] > 0  # the case balanced used to get wrong occurred


def _record_sidecar_then_replay(root: str) -> dict:
    """Record mode end to end: routes Megatron chose -> RouteRecorder -> route sidecar on disk ->
    RoutedPackedDataset -> replay after perturbing the routers: real positions replay exactly."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    from megatron_ext.replay.binding import RouteReplayBinding
    from megatron_ext.replay.route_dataset import (
        RoutedPackedDataset,
        RoutedPackedDatasetConfig,
        RouteRecorder,
    )
    from tests.data.dataset_helpers import gpt_config_kwargs

    seq = 32

    def dataset(suffix):
        config = RoutedPackedDatasetConfig(
            **gpt_config_kwargs(
                [f"{root}/docs"], sequence_length=seq, path_to_cache=f"{root}/cache"
            ),
            pad_to_seq_len=True,
            route_suffix=suffix,
            route_num_layers=2,
            route_topk=2,
            route_num_experts=8,
        )
        return BlendedMegatronDatasetBuilder(
            RoutedPackedDataset, [4, 0, 0], lambda: True, config
        ).build()[0]

    source = dataset(None)
    samples = [source[i] for i in range(BATCH)]
    tokens = torch.stack([s["tokens"] for s in samples])
    positions = torch.arange(seq).expand(BATCH, seq)
    torch.manual_seed(7)
    model = build_model_for_seq(seq)
    recorder_binding = RouteReplayBinding(model, "record")
    recorder_binding.begin_record("mb0", BATCH, seq)
    model(tokens, positions, attention_mask=None, labels=tokens).sum().backward()
    recorded = recorder_binding.recorded_routes("mb0")
    recorder_binding.remove()
    recorder = RouteRecorder.for_dataset(source)
    for b, s in enumerate(samples):
        recorder.add_pack(source.pack_pieces(int(s["pack_index"])), recorded[b].numpy())
    recorder.write(f"{root}/docs_rec")

    with torch.no_grad():
        for router in routers(model):
            router.weight.add_(torch.randn_like(router.weight) * 3.0)
    replayed = dataset("_rec")
    routes = torch.stack([replayed[i]["routes"] for i in range(BATCH)])
    real_BS = torch.stack([~s["padding_mask"] for s in samples])
    binding = RouteReplayBinding(model, "replay")
    log, handles = capture_maps(model)
    binding.install(routes, key=0)
    model(tokens, positions, attention_mask=None, labels=tokens).sum().backward()
    for h in handles:
        h.remove()
    rows = binding._my_positions(BATCH, seq)
    real_N = real_BS.reshape(-1)[rows]
    ok = torch.equal(routes[real_BS], recorded[real_BS])  # the sidecar holds what was recorded
    for r in binding.replays:
        want = torch.zeros_like(log[r.layer_number][0]).scatter(
            1, recorded.reshape(-1, 2, 2)[rows][:, r.moe_ordinal].long(), True
        )
        ok &= torch.equal(log[r.layer_number][0][real_N], want[real_N])
    binding.remove()
    return {"ok": ok, "real": int(real_N.sum())}


def test_record_mode_writes_a_sidecar_that_replays_exactly(tmp_path):
    import numpy as np

    from megatron_ext.data.indexed_writer import write_documents

    rng = np.random.default_rng(1)
    write_documents(
        str(tmp_path / "docs"),
        [rng.integers(1, 100, size=int(n)) for n in rng.integers(3, 20, size=12)],
    )
    (result,) = run_distributed(_record_sidecar_then_replay, 1, str(tmp_path))
    assert result["ok"] and result["real"] > 0
