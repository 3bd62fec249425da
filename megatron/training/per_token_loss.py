"""``--calculate-per-token-loss``: the loss of an iteration is the sum of its token losses over the
number of loss-mask tokens of the whole global batch (Megatron's per-token loss), not the average
of the micro-batches' mean losses. The two agree when every micro-batch has the same number of
loss tokens; with loss masks that differ between samples, per-token weighs every token equally.

How: each micro-batch's mean loss ``sum_i / n_i`` is rescaled to ``sum_i / n_ref``
(``n_ref`` = micro-batch size x sequence length, a constant), so the runtime's usual division by
the number of micro-batches and the data-parallel size yields ``sum_i / n_ref`` averaged over the
global batch's micro-batches. Once the token counts ``n_i`` are averaged the same way (one
all-reduce, as for the reported loss), the gradients and the loss are multiplied by
``n_ref / mean(n_i)``, giving ``sum over all tokens / number of tokens`` exactly.
"""

from __future__ import annotations

from typing import Callable

TOKENS_KEY = "loss tokens"


def per_token_forward_step(forward_step_func: Callable, reference_tokens: int) -> Callable:
    """``forward_step_func`` whose loss is ``sum of token losses / reference_tokens`` and whose
    loss dict also carries the micro-batch's loss-token count (:data:`TOKENS_KEY`)."""

    def forward_step(microbatch: dict, model):
        output, loss_func = forward_step_func(microbatch, model)

        def per_token_loss_func(output_tensor):
            # Read here, where the loss is computed (a last pipeline stage has the loss mask).
            tokens = microbatch["loss_mask"].sum()
            loss, reported = loss_func(output_tensor)
            scale = tokens / reference_tokens
            return loss * scale, {**{key: value * scale for key, value in reported.items()},
                                  TOKENS_KEY: tokens.detach()}

        return output, per_token_loss_func

    return forward_step


def per_token_correction(mean_tokens_per_microbatch: float, reference_tokens: int) -> float:
    """The factor that turns the averaged ``sum_i / n_ref`` into ``sum / tokens`` (0 when the
    global batch has no loss tokens: there is nothing to learn from it)."""
    if mean_tokens_per_microbatch <= 0:
        return 0.0
    return reference_tokens / mean_tokens_per_microbatch
