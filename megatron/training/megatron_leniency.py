"""Where Megatron-LM is lenient with a flag, be lenient the same way (before validation).

Megatron launch scripts rely on these: ``--sequence-parallel`` with tensor-parallel size 1 is
switched off with a warning (Megatron does the same, since there is nothing to split), and a
``--split`` value that still carries the quotes of a shell script (``'99,1,0'``) is read for its
numbers, as Megatron's split parser does. Each adjustment is logged.
"""

from __future__ import annotations

import logging

from megatron.core.config import MegatronConfig

logger = logging.getLogger(__name__)

_QUOTES = "'\""


def apply_megatron_leniency(config: MegatronConfig) -> None:
    """Adjust ``config`` in place where Megatron accepts a flag that our rules would refuse."""
    parallel = config.parallel
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size == 1:
        logger.warning("--sequence-parallel is switched off because --tensor-model-parallel-size "
                       "is 1 (nothing to split across ranks), as Megatron-LM does")
        parallel.sequence_parallel = False
    if parallel.num_virtual_stages_per_pipeline_rank == 1:
        logger.info("--num-virtual-stages-per-pipeline-rank 1 is the plain (non-interleaved) "
                    "pipeline, as in Megatron-LM")
        parallel.num_virtual_stages_per_pipeline_rank = None
    split = config.data.split
    if split != split.strip(_QUOTES):
        config.data.split = split.strip(_QUOTES)
        logger.info("--split %s: reading the proportions %s (the quotes are the shell script's)",
                    split, config.data.split)
