"""Cross entropy on vocabulary-parallel logits, without ever gathering the full logits.

Each TP rank holds logits for its contiguous block of the (padded) vocabulary. The loss needs three
reductions over the vocabulary, each an all-reduce of a ``[b, s]`` tensor over the TP group:
the maximum (for a stable softmax), the target's logit (only the owning rank contributes a non-zero)
and the sum of exponentials. The backward pass is local: softmax minus the one-hot target on the
owning rank, scaled by the incoming gradient. With TP = 1 (nothing to reduce) it is PyTorch's
``F.cross_entropy`` in the same precision, which is cheaper on one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.utils import group_size_and_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        size, rank = group_size_and_rank(group)
        # Compute in at least float32 (bf16/fp16 logits lose too much in exp/sum).
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        shifted = logits.to(compute_dtype, copy=True)

        logits_max = shifted.max(dim=-1).values
        if size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted -= logits_max.unsqueeze(-1)

        vocab_per_rank = shifted.shape[-1]
        vocab_start = rank * vocab_per_rank
        not_mine = (target < vocab_start) | (target >= vocab_start + vocab_per_rank)
        local_target = (target - vocab_start).masked_fill(not_mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(not_mine, 0.0)

        exp_logits = shifted.exp_()  # in place: the shifted logits are not needed any more
        sum_exp = exp_logits.sum(dim=-1)
        if size > 1:
            both = torch.stack([target_logit, sum_exp])  # one all-reduce for the two sums
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]

        loss = torch.log(sum_exp) - target_logit
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, not_mine)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, not_mine = ctx.saved_tensors
        grad = softmax.clone()
        is_mine = (~not_mine).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -is_mine)
        grad *= grad_loss.unsqueeze(-1).to(grad.dtype)
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss ``-log softmax(full logits)[target]`` from this rank's vocabulary block.

    ``logits``: ``[..., V / tp]``, this rank's contiguous block of the padded vocabulary.
    ``target``: ``[...]`` global token ids. Returns ``[...]`` in float32 (float64 for float64
    logits). ``group`` is the TP group (None when TP is 1).
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} "
                         f"disagree; logits must be [..., V/tp] for target [...]")
    if group_size_and_rank(group)[0] == 1:  # the whole vocabulary is here: PyTorch's fused kernel
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        flat = logits.to(compute_dtype).reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, target.reshape(-1), reduction="none").view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, group)
