"""Flags of the RL policy loss: :class:`PolicyLossConfig` (the math: training/policy_loss.py)."""

import argparse as _argparse
import os as _os
from dataclasses import dataclass as _dataclass
from typing import Literal as _Literal

from megatron_ext.config.megatron_view import MegatronView
from megatron_ext.config.registry import feature_config, flag_value


@feature_config("rl: a policy loss on rollouts (advantages and behaviour log-prob sidecars)")
@_dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """An RL step's loss: PPO-clip on the rollouts' advantages and behaviour log-probs (sidecars)."""

    rl_loss: _Literal["off", "ppo"] = "off"
    """'ppo': train on the token-level PPO-clip surrogate -min(r*A, clip(r, 1-low, 1+high)*A),
    r = exp(logp - behaviour logp), summed over the loss-masked tokens (a token-level mean over
    the global batch with --calculate-per-token-loss, which it needs); advantages and behaviour
    log-probs come from float32 sidecars beside every --data-path prefix (megatron-ext
    ingest-rollouts); logs rl/logprob_mismatch, rl/clip_fraction, rl/ratio_mean, rl/kl_k3. Needs
    --pack-documents. 'off': the language-model loss."""

    rl_clip_low: float = 0.2
    """--rl-loss ppo: the ratio is clipped below at 1 - this."""

    rl_clip_high: float = 0.28
    """--rl-loss ppo: the ratio is clipped above at 1 + this (DAPO's clip-higher: above
    --rl-clip-low; set it equal for PPO's symmetric clip)."""

    rl_kl_coeff: float = 0.0
    """--rl-loss ppo: weight of the k3 estimate of KL(behaviour || policy) added to each token's
    loss (0: only reported, as rl/kl_k3)."""

    rl_advantages_suffix: str = "_advantages"
    """--rl-loss: per-token advantages (float32) of every --data-path prefix P at P + this, with
    its P + this + .sidecar.json header naming P's tokens digest (ingest-rollouts writes both)."""

    rl_logprobs_suffix: str = "_logprobs"
    """--rl-loss: per-token behaviour log-probs (float32: the rollout engine's, of each token)
    at P + this, with its header (as --rl-advantages-suffix)."""

    rl_record_logprobs: str | None = None
    """With --route-replay-mode record: also write the recording forward's log-prob of every
    token (float32, a document's first token 0) as a sidecar at this prefix, with its header
    (e.g. <--data-path>_logprobs, the behaviour log-probs of weights that would generate)."""

    def __post_init__(self) -> None:
        if self.rl_loss not in ("off", "ppo"):
            raise ValueError(f"--rl-loss must be 'off' or 'ppo', got {self.rl_loss!r}")
        if not 0.0 <= self.rl_clip_low < 1.0:
            raise ValueError(f"--rl-clip-low must be in [0, 1), got {self.rl_clip_low}")
        if not self.rl_clip_high >= 0.0:
            raise ValueError(f"--rl-clip-high must be >= 0, got {self.rl_clip_high}")
        if not self.rl_kl_coeff >= 0.0:
            raise ValueError(f"--rl-kl-coeff must be >= 0, got {self.rl_kl_coeff}")
        if self.rl_loss != "off":
            suffixes = (self.rl_advantages_suffix, self.rl_logprobs_suffix)
            if not all(suffixes) or suffixes[0] == suffixes[1]:
                raise ValueError(
                    "--rl-advantages-suffix and --rl-logprobs-suffix must be two non-empty "
                    f"suffixes, got {suffixes}"
                )

    def check_megatron_args(self, args: _argparse.Namespace) -> None:
        """Refuses --rl-loss without packed data or the token-level mean, and a sidecar that is missing, not float32 or of other tokens (its header's
        digest); --rl-record-logprobs outside record mode or over existing files."""
        if self.rl_record_logprobs is not None:
            self._check_record_path(args)
        if self.rl_loss == "off" and self.rl_record_logprobs is None:
            return
        if self.rl_loss == "off":
            return
        view = MegatronView.from_args(args)
        if not flag_value(args, "pack_documents"):
            raise ValueError(
                "--rl-loss reads its advantages and log-prob sidecars through the packed dataset: "
                "add --pack-documents"
            )
        if not view.calculate_per_token_loss:
            raise ValueError(
                "--rl-loss is a token-level mean over the global batch: add "
                "--calculate-per-token-loss (without it Megatron averages per micro-batch)"
            )
        from megatron_ext.common.safe_files import content_digest
        from megatron_ext.data.data_args import data_prefixes
        from megatron_ext.data.sidecar_header import check_tokens_digest

        for _flag, prefixes, _weights in data_prefixes(args):
            for prefix in prefixes:
                if not all(_os.path.isfile(prefix + ext) for ext in (".bin", ".idx")):
                    continue  # the data checks name the missing token file
                digest = content_digest([prefix + ".idx", prefix + ".bin"])  # once per prefix
                for flag, suffix in (
                    ("--rl-advantages-suffix", self.rl_advantages_suffix),
                    ("--rl-logprobs-suffix", self.rl_logprobs_suffix),
                ):
                    for ext in (".bin", ".idx"):
                        if not _os.path.isfile(prefix + suffix + ext):
                            raise ValueError(
                                f"{flag} {suffix}: sidecar file {prefix + suffix + ext} for "
                                f"--data-path prefix {prefix} does not exist"
                            )
                    header = check_tokens_digest(prefix + suffix, prefix, digest)
                    if header.get("dtype") != "float32":
                        raise ValueError(
                            f"{flag} {suffix}: sidecar {prefix + suffix} holds "
                            f"{header.get('dtype')}, not float32"
                        )

    def _check_record_path(self, args: _argparse.Namespace) -> None:
        from megatron_ext.common.safe_files import check_output_prefix
        from megatron_ext.data.data_args import data_prefixes
        from megatron_ext.data.sidecar_header import SIDECAR_EXTENSION

        if flag_value(args, "route_replay_mode") != "record":
            raise ValueError(
                "--rl-record-logprobs records through --route-replay-mode record (its packs' "
                "pieces place each value in its document): add it"
            )
        parent = _os.path.dirname(_os.path.abspath(self.rl_record_logprobs))
        if not _os.path.isdir(parent):
            raise ValueError(f"--rl-record-logprobs: directory {parent} does not exist")
        inputs = [p for _flag, group, _weights in data_prefixes(args) for p in group]
        check_output_prefix(
            self.rl_record_logprobs,
            flag="--rl-record-logprobs",
            inputs=inputs,
            extensions=(".bin", ".idx", SIDECAR_EXTENSION),
            replace_hint="choose a new --rl-record-logprobs (or remove the old files yourself)",
        )
