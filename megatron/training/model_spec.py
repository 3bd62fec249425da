"""The model seam: one record (:class:`ModelSpec`) holding everything ``pretrain`` needs to know
about a model, as torchtitan's ModelSpec does.

``pretrain(config, spec, ...)`` builds the model chunks with ``spec.model_provider``, turns dataset
samples into micro-batches with ``spec.batch_from_samples``, runs ``spec.forward_step``, reduces
and logs the losses named by ``spec.loss_keys``, and reports throughput with
``spec.flops_per_iteration`` (when given). ``parse_args(argv, model_spec=spec)`` builds the model's
flags from ``spec.config_section`` (the dataclass that becomes ``config.model``) and checks them with
``spec.validation_steps``. GPT is one spec (:func:`megatron.training.gpt_spec.gpt_model_spec`, built
by ``pretrain_gpt.py``); ``tests/distributed/test_extension_seams.py`` trains a linear+GeLU stack
through ``pretrain`` with a spec of its own.

The contract a config section keeps (read by the runtimes and the generic validation):

* ``num_layers``: the units the pipeline splits over its stages (``layer_range``; evenly unless
  the uneven-stage flags of ``config.parallel`` say otherwise);
* ``tied_embeddings``: whether the first and the last stage hold copies of one weight (a
  ``ClassVar``, a property or a field; GPT: ``not --untie-embeddings-and-output-weights``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class HFAdapter:
    """Conversion between the model's checkpoints and a Hugging Face directory (optional)."""

    export_checkpoint: Callable  # (load_dir, hf_dir, iteration=None, log=print) -> hf_dir
    import_checkpoint: Callable  # (hf_dir, save_dir, target_layout, ...) -> save_dir


@dataclass(frozen=True)
class ModelSpec:
    """Everything ``pretrain`` and ``parse_args`` need to know about one model.

    Attributes:
        name: the model's name (log lines).
        model_provider: ``(config, parallel_state, *, pre_process, post_process, layer_range=None)``
            -> one model chunk (it implements the stage contract for pipelines).
        forward_step: ``(microbatch, model) -> (output, loss_func)``; ``loss_func(output)`` ->
            ``(loss, {key: detached scalar for key in loss_keys})``.
        loss_keys: the names of the losses ``forward_step`` reports, averaged over the global batch
            and logged (every rank must know them: not every pipeline stage computes a loss).
        config_section: the dataclass of the model's flags; it becomes ``config.model`` (see the
            module docstring for the fields every section has).
        validation_steps: ``(name, step(config, world_size, registry), needs)`` entries run by
            :func:`~megatron.training.config_validation.validate_config` with the generic ones:
            entries without ``needs`` before them, the others after them. Name the step that
            checks ``num_layers`` ``"model"``: the generic steps reading it are skipped when it
            fails.
        batch_from_samples: ``(samples, sample_ids, device)`` -> one micro-batch dict.
        datasets_provider: default ``(config, parallel_state, num_samples)`` -> (train, valid,
            test) datasets, used when ``pretrain`` gets none.
        flops_per_iteration: ``(model_config, global_batch_size)`` -> floating-point operations of
            one iteration (forward and backward), or None: the throughput is not reported.
        hf_adapter: Hugging Face conversion, or None.
    """

    name: str
    model_provider: Callable
    loss_keys: tuple
    config_section: type
    batch_from_samples: Callable
    forward_step: Optional[Callable] = None
    validation_steps: tuple = ()
    datasets_provider: Optional[Callable] = None
    flops_per_iteration: Optional[Callable[[Any, int], float]] = None
    hf_adapter: Optional[HFAdapter] = None

    def with_functions(self, model_provider: Optional[Callable] = None,
                       forward_step: Optional[Callable] = None) -> "ModelSpec":
        """This spec with another model provider and/or forward step (e.g. a float64 model)."""
        changes = {name: value for name, value in (("model_provider", model_provider),
                                                   ("forward_step", forward_step))
                   if value is not None}
        return dataclasses.replace(self, **changes)

