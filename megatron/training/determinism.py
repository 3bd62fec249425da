"""``--deterministic-mode``: bitwise-reproducible runs, as Megatron-LM sets them up.

Before any communicator or cuBLAS handle exists, :func:`apply_deterministic_mode` checks the
environment variables that decide determinism and fills in Megatron's values where they are unset
(``NCCL_ALGO=Ring``: a fixed all-reduce order; ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: deterministic
cuBLAS; ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` for Transformer Engine, should one be loaded), then
switches PyTorch to deterministic algorithms (``torch.use_deterministic_algorithms(True)``; an op
without a deterministic implementation raises instead of running) and cuDNN to deterministic,
non-benchmarking kernels. Values set by the user win if they are deterministic too; one that is
not is an error naming the variable and the accepted values.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping, Optional

import torch

logger = logging.getLogger(__name__)

ENVIRONMENT_DEFAULTS: dict[str, str] = {
    "NCCL_ALGO": "Ring",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}
# NCCL algorithms whose reduction order does not depend on timing.
DETERMINISTIC_NCCL_ALGORITHMS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
ACCEPTED_VALUES: dict[str, frozenset[str]] = {
    "CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"}),
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": frozenset({"0"}),
}


def determinism_environment_problems(env: MutableMapping[str, str]) -> list[str]:
    """One message per environment variable whose value would make the run non-deterministic."""
    problems = []
    nccl_algo = env.get("NCCL_ALGO")
    if nccl_algo is not None:
        tokens = [token.strip() for token in nccl_algo.split(",") if token.strip()]
        if not tokens or any(token not in DETERMINISTIC_NCCL_ALGORITHMS for token in tokens):
            problems.append(f"NCCL_ALGO={nccl_algo!r} may reduce in a timing-dependent order; "
                            f"use one of {', '.join(sorted(DETERMINISTIC_NCCL_ALGORITHMS))} or "
                            f"unset it (--deterministic-mode sets Ring)")
    for name, accepted in ACCEPTED_VALUES.items():
        value = env.get(name)
        if value is not None and value not in accepted:
            problems.append(f"{name}={value!r} is not a deterministic setting; use "
                            f"{' or '.join(sorted(accepted))} or unset it")
    return problems


def apply_deterministic_mode(env: Optional[MutableMapping[str, str]] = None) -> None:
    """Set up deterministic execution in this process (call before process groups exist).

    Raises ``ValueError`` when an environment variable asks for a non-deterministic setting."""
    env = os.environ if env is None else env
    problems = determinism_environment_problems(env)
    if problems:
        raise ValueError("--deterministic-mode: " + "; ".join(problems))
    for name, value in ENVIRONMENT_DEFAULTS.items():
        env.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    logger.info("deterministic mode: torch deterministic algorithms on, NCCL_ALGO=%s, "
                "CUBLAS_WORKSPACE_CONFIG=%s", env["NCCL_ALGO"], env["CUBLAS_WORKSPACE_CONFIG"])
