"""Flags of the route-replay feature: :class:`ReplayConfig`."""

import argparse as _argparse
import os as _os
import warnings as _replay_warnings
from dataclasses import dataclass as _dataclass
from typing import Literal as _Literal

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.config.registry import feature_config, flag, flag_value
from megatron_ext.replay.unsupported import check_replay_supported


@feature_config("replay: route record/replay bound to Megatron's RouterReplay")
@_dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """Route replay (R3): train on the experts the rollout engine chose (megatron_ext.replay)."""

    route_replay_mode: _Literal["off", "record", "replay"] = "off"
    """'replay' installs each pack's recorded routes into the MoE routers (every MoE layer's
    top-k equals the recorded one); 'record' captures the routes the forward chose and writes
    them to --route-record-path; 'off' routes natively."""

    route_data_suffix: str | None = None
    """Route sidecars: every --data-path prefix P has a route IndexedDataset at P + suffix
    (tools/convert_routes.py output, e.g. '_routes'), aligned document by document and token by
    token with P; the packer gathers, packs and pads it exactly as the tokens."""

    route_record_path: str | None = None
    """Output prefix of the route sidecar written by --route-replay-mode record."""

    replay_missing_route_policy: _Literal["native", "balanced"] = "native"
    """Tokens with no recorded route (vLLM's last token, tool tokens, constant-id pads):
    'native' lets the router decide them; 'balanced' fills a distinct top-k spread evenly over
    EP ranks for every EP size dividing the expert count."""

    route_replay_check: bool = False
    """With --route-replay-mode replay: count, on the device, per log interval, the (token,
    layer) rows with a recorded route and how many Megatron's router used exactly (any other is
    logged as an error), the rows without one and how --replay-missing-route-policy decided
    them, and on recorded rows how often the model's own top-k would differ (one extra top-k per
    MoE layer); printed whenever Megatron logs, and written to --moe-expert-load-log."""

    route_replay_max_missing: float = 0.05
    """With --route-replay-mode replay: the largest fraction of the (token, layer) rows of the
    run's training packs (their real tokens) that may have no recorded route; a run whose data
    has more is refused when its datasets are built (the fraction is logged either way). 1
    accepts any coverage."""

    route_replay_allow_undigested: bool = False
    """With --route-replay-mode replay: replay route sidecars that record no tokens digest
    (converted without tools/convert_routes.py --tokens-prefix, or without a header), whose routes
    cannot be told from routes left beside rewritten token data of the same lengths. Without it
    such a sidecar is refused at launch (and in the dry run)."""

    def __post_init__(self) -> None:
        if self.route_replay_check and self.route_replay_mode != "replay":
            raise ValueError(
                "--route-replay-check needs --route-replay-mode replay "
                f"(got {self.route_replay_mode!r})"
            )
        if self.route_replay_mode not in ("off", "record", "replay"):
            raise ValueError(
                "--route-replay-mode must be 'off', 'record' or 'replay', "
                f"got {self.route_replay_mode!r}"
            )
        if self.replay_missing_route_policy not in ("native", "balanced"):
            raise ValueError(
                "--replay-missing-route-policy must be 'native' or 'balanced', "
                f"got {self.replay_missing_route_policy!r}"
            )
        if not 0.0 <= self.route_replay_max_missing <= 1.0:
            raise ValueError(
                "--route-replay-max-missing must be a fraction in [0, 1], "
                f"got {self.route_replay_max_missing}"
            )
        if self.route_replay_mode == "replay" and not self.route_data_suffix:
            raise ValueError("--route-replay-mode replay needs --route-data-suffix")
        if self.route_replay_mode == "record" and not self.route_record_path:
            raise ValueError("--route-replay-mode record needs --route-record-path")
        if self.route_replay_mode != "replay" and self.route_replay_max_missing != 0.05:
            _replay_warnings.warn(
                "--route-replay-max-missing has no effect without --route-replay-mode replay",
                stacklevel=2,
            )
        if self.route_replay_mode != "replay" and self.route_replay_allow_undigested:
            _replay_warnings.warn(
                "--route-replay-allow-undigested has no effect without --route-replay-mode replay",
                stacklevel=2,
            )
        unused = {
            "off": ("route_data_suffix", "route_record_path"),
            "record": ("route_data_suffix",),
            "replay": ("route_record_path",),
        }[self.route_replay_mode]
        for name in (n for n in unused if getattr(self, n) is not None):
            _replay_warnings.warn(
                f"{flag(name)} has no effect with --route-replay-mode {self.route_replay_mode}",
                stacklevel=2,
            )
        if self.route_replay_mode == "record":
            parent = _os.path.dirname(_os.path.abspath(self.route_record_path))
            if not _os.path.isdir(parent):
                raise ValueError(f"--route-record-path: directory {parent} does not exist")

    def check_megatron_args(self, args: _argparse.Namespace) -> None:
        """Refuses every Megatron setting under which 0.19.2 would silently skip replay, and a
        record path that exists or would overwrite token data or one of its sidecars."""
        if self.route_replay_mode == "off":
            return
        check_replay_supported(args, f"--route-replay-mode {self.route_replay_mode}")
        if self.route_replay_mode == "record":
            self._check_record_path(args)
        if self.route_replay_mode == "replay":
            if not flag_value(args, "pack_documents"):
                raise ValueError(
                    "--route-replay-mode replay reads route sidecars through the packed dataset: "
                    "add --pack-documents"
                )
            from megatron_ext.data.data_args import data_prefixes

            for flag, prefixes, _weights in data_prefixes(args):
                for prefix in prefixes:
                    for ext in (".bin", ".idx"):
                        path = prefix + self.route_data_suffix + ext
                        if not _os.path.isfile(path):
                            raise ValueError(
                                f"--route-data-suffix {self.route_data_suffix}: route file "
                                f"{path} for {flag} prefix {prefix} does not exist"
                            )
                    self._check_header(prefix + self.route_data_suffix, args)
                    self._check_tokens_digest(prefix + self.route_data_suffix, prefix)

    @staticmethod
    def _check_header(route_prefix: str, args: _argparse.Namespace) -> None:
        """The model a route file's header was written for (L, K, E, its rows' decoder layers)
        against this run's."""
        # Now rather than at dataset build, after the model and optimizer are built. A file
        # without a header is checked there (L x K per token, with a warning).
        from megatron_ext.replay.layout import moe_layer_numbers_for_args
        from megatron_ext.replay.route_file import (
            HEADER_EXTENSION,
            check_layer_ids,
            check_written_for,
            read_header,
        )

        header_path = route_prefix + HEADER_EXTENSION
        if not _os.path.isfile(header_path):
            return
        header, moe_layers = read_header(header_path), moe_layer_numbers_for_args(args)
        # Rows map onto the model's MoE layers in order: another count is refused naming both
        # lists (before the L x K x E line, which cannot name them).
        check_layer_ids(header, header_path, [n - 1 for n in moe_layers])  # 1-based -> 0-based
        view = MegatronView.from_args(args)
        check_written_for(
            header,
            header_path,
            num_layers=len(moe_layers),
            topk=view.moe_router_topk,
            num_experts=view.num_experts,
        )

    def _check_tokens_digest(self, route_prefix: str, tokens_prefix: str) -> None:
        """Refuses a route file that records no tokens digest unless
        --route-replay-allow-undigested."""
        # Only the digest tells its routes from routes left beside rewritten tokens of the same
        # lengths (the dataset compares it when built).
        from megatron_ext.replay.route_file import HEADER_EXTENSION, read_header

        header_path = route_prefix + HEADER_EXTENSION
        if self.route_replay_allow_undigested:
            return
        if not _os.path.isfile(header_path):
            why = f"has no header {header_path}, so no tokens digest"
        elif "tokens_digest" in read_header(header_path):
            return
        else:
            why = "records no tokens digest (converted without --tokens-prefix)"
        raise ValueError(
            f"route file {route_prefix} {why}: routes left beside rewritten tokens of the same "
            "lengths could not be caught; convert the routes again with tools/convert_routes.py "
            f"--tokens-prefix {tokens_prefix}, or replay it anyway with "
            "--route-replay-allow-undigested"
        )

    def _check_record_path(self, args: _argparse.Namespace) -> None:
        from megatron_ext.common.safe_files import check_output_prefix
        from megatron_ext.data.data_args import data_prefixes
        from megatron_ext.replay.route_file import HEADER_EXTENSION

        inputs = []
        suffix = flag_value(args, "pack_loss_mask_suffix")
        for _flag, prefixes, _weights in data_prefixes(args):
            inputs += prefixes + ([p + suffix for p in prefixes] if suffix else [])
        check_output_prefix(
            self.route_record_path,
            flag="--route-record-path",
            inputs=inputs,
            extensions=(".bin", ".idx", HEADER_EXTENSION),
            replace_hint="choose a new --route-record-path (or remove the old files yourself)",
        )
