"""``PaddedTopKRouter``: Megatron's ``TopKRouter`` whose expert-bias token counts leave pads out.

Aux-loss-free balancing (``--moe-router-enable-expert-bias``, DeepSeek-V3) counts the tokens each
expert received in ``local_tokens_per_expert``; Megatron's ``finalize_model_grads`` turns those
counts into the next step's expert bias. megatron_ext always hands the router a ``padding_mask``
(True = pad) so pads stay out of the balancing statistics, but Megatron-Core 0.19.2's
``TopKRouter._apply_expert_bias`` masks with ``routing_map & ~padding_mask``: ``[N, E]`` against
``[N]``, which broadcasts over the wrong dimension and raises at the first training forward. This
subclass counts ``routing_map & ~padding_mask[:, None]``, so only real tokens are counted.

Worked example (N=4 tokens, E=3 experts, top-1; the last two tokens are pads)::

    routing_map = [[1 0 0]      padding_mask = [F F T T]
                   [0 1 0]
                   [0 1 0]       counted:  [1 1 0]   (Megatron without the mask: [1 2 1])
                   [0 0 1]]

Everything else is Megatron's: top-k, scores, aux losses, z-loss, token dropping and route
replay (``RouterReplay`` lives on the router and is inherited), and ``local_tokens_per_expert``
keeps Megatron's shape, dtype and "training forward with grad only" rule (no count in evaluation
or in the ``no_grad`` first pass of an activation checkpoint). Without a padding mask, or with
expert bias off, the router is ``TopKRouter`` exactly. It reaches a model through the spec
(``MoESubmodules.router``; see :func:`megatron_ext.moe.layer_specs.with_padded_router`).

The aux-loss paths of 0.19.2 (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``) and the z-loss
already apply the flattened mask with the right shapes (``valid[:, None]`` on ``[N, E]``, ``[N]`` on
``[N]``), so they are left as they are.
"""

import torch
from megatron.core.transformer.moe.router import TopKRouter


def real_tokens_per_expert(
    routing_map_TE: torch.Tensor, pad_mask_T: torch.Tensor | None
) -> torch.Tensor:
    """Tokens routed to each expert, pads left out (int64 ``[E]``; no host sync).

    Args:
        routing_map_TE: bool ``[T, E]``, the router's output routing map.
        pad_mask_T: ``[T]`` (any shape with T elements, in the router's token order), True = pad;
            None counts every token.
    """
    if pad_mask_T is None:
        return routing_map_TE.sum(dim=0)
    valid_T1 = ~pad_mask_T.reshape(-1, 1).bool()
    assert valid_T1.shape[0] == routing_map_TE.shape[0], (
        f"padding_mask has {valid_T1.shape[0]} tokens, routing map {routing_map_TE.shape[0]}"
    )
    return (routing_map_TE & valid_T1).sum(dim=0)


class PaddedTopKRouter(TopKRouter):
    """``TopKRouter`` whose expert-bias counts (``local_tokens_per_expert``) exclude pads."""

    def _apply_expert_bias(
        self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> None:
        """Adds this micro-batch's real-token counts to ``local_tokens_per_expert``.

        Same gate as Megatron's: only with expert bias on and grad enabled (a training forward
        or the recompute of a checkpoint; Megatron evaluates under ``no_grad``). Not wrapped in
        Megatron's ``jit_fuser``: two element-wise ops and a sum, nothing to fuse.
        """
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += real_tokens_per_expert(routing_map, padding_mask)
