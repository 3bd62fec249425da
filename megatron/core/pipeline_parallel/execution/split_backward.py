"""Split backward: the input gradient now, the weight gradients later (zero-bubble pipelines).

A stage's backward computes two things: the gradient of its input (the next message, on the
pipeline's critical path) and the gradients of its weights (needed only before the optimizer step).
:func:`backward_input` runs autograd from the stage's output towards its input only, so every
node computes just the gradients on that path (a linear layer computes ``dX``, not ``dW``); while it
runs, a pre-hook captures the incoming gradient of every *boundary node*: a node on the input path
with an edge into a part of the graph that leads only to parameters. :func:`backward_weight` later
starts autograd from exactly those nodes with the captured gradients, towards the parameters only,
and lets the engine accumulate the results into ``param.grad`` (firing their post-accumulate-grad
hooks, as a full backward does). Each gradient is the same operation on the same operands
as in one full backward, so the numbers equal the full backward's (only the order in which several
contributions to one parameter are summed may differ: float64 agreement ~1e-16 relative).

The graph is kept (``retain_graph``) between the two halves, so the stage's saved activations stay
alive until its weight gradients are done: :class:`DeferredWeightGradients` counts them for the
stored-memory report. A first stage (no input tensor) has nothing to do in the input half; its
weight half is the whole backward. No project code is involved: this works on any autograd graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass(frozen=True)
class TrainableParameters:
    """A chunk's parameters that require gradients, each with its gradient accumulator (autograd's
    ``AccumulateGrad`` node, the graph node a parameter's gradient flows into). Resolved once per
    chunk and iteration by the interpreter instead of on every input half (the first tensor work
    after a sleep is slow, docs/benchmarks.md §9); holding the nodes keeps every graph built
    meanwhile ending in the same ones (a parameter holds its accumulator only weakly)."""

    params: tuple
    param_of_node: dict  # AccumulateGrad node -> parameter

    @classmethod
    def of(cls, params: Sequence[torch.nn.Parameter]) -> "TrainableParameters":
        trainable = tuple(p for p in params if p.requires_grad)
        return cls(trainable, {get_gradient_edge(p).node: p for p in trainable})

    @classmethod
    def coerce(cls, params: "Sequence[torch.nn.Parameter] | TrainableParameters"
               ) -> "TrainableParameters":
        return params if isinstance(params, TrainableParameters) else cls.of(params)


@dataclass
class DeferredWeightGradients:
    """What the input half leaves for the weight half of one (stage, micro-batch): per boundary
    node, where to start (its outputs and their gradients) and the parameters it leads to."""

    parts: list = field(default_factory=list)  # (roots, grads, params) per boundary node
    full_backward: bool = False  # the input half could not be split; nothing was deferred


def _children(node) -> list:
    return [child for child, _ in node.next_functions if child is not None]


def _reach_flags(root, input_node, param_nodes: set) -> tuple[dict, dict, dict]:
    """One post-order walk below ``root``: (children of every node, whether each node reaches
    ``input_node``, whether it reaches a node of ``param_nodes``). ``next_functions`` builds a
    new tuple on every access, so each node's children are read once and kept."""
    children_of: dict = {}
    to_input: dict = {}
    to_params: dict = {}
    stack = [(root, False)]
    while stack:  # iterative: graphs of deep models exceed Python's recursion limit
        node, children_done = stack.pop()
        if node in to_input:
            continue
        if children_done:
            children = children_of[node]
            to_input[node] = node is input_node or any(to_input[child] for child in children)
            to_params[node] = node in param_nodes or any(to_params[child] for child in children)
            continue
        children = children_of.get(node)
        if children is None:
            children = children_of[node] = _children(node)
        stack.append((node, True))
        stack.extend((child, False) for child in children if child not in to_input)
    return children_of, to_input, to_params


def _params_below(node, children_of: dict, to_params: dict, param_nodes: set) -> set:
    """The nodes of ``param_nodes`` reachable from ``node`` (walking only towards parameters)."""
    found, seen, stack = set(), {node}, [node]
    while stack:
        current = stack.pop()
        if current in param_nodes:
            found.add(current)
        for child in children_of[current]:
            if child not in seen and to_params[child]:
                seen.add(child)
                stack.append(child)
    return found


def _boundary_nodes(root, input_node, param_nodes: set) -> Optional[list]:
    """(node, parameter nodes it alone leads to) for every node on the path to the input with an
    edge into a part of the graph that leads only to parameters; None when two such parts share a
    parameter (the weight half could not keep their sums apart). One walk of the graph finds both
    paths (this runs on every input half, on the pipeline's critical path)."""
    children_of, to_input, to_params = _reach_flags(root, input_node, param_nodes)
    boundary, claimed = [], set()
    for node, on_input_path in to_input.items():
        if not on_input_path:
            continue
        owned = set()
        for child in children_of[node]:
            if to_params[child] and not to_input[child]:
                owned |= _params_below(child, children_of, to_params, param_nodes)
        if owned:
            if owned & claimed:
                return None
            claimed |= owned
            boundary.append((node, owned))
    return boundary


def _run_backward(output: torch.Tensor, grad: Optional[torch.Tensor], inputs: list, *,
                  keep_graph: bool, accumulate: bool):
    """Autograd from ``output`` towards ``inputs``. The engine is called directly because a sent
    activation's data has been freed and ``torch.autograd.grad`` would compare the gradient's
    shape with the (now empty) data; the graph keeps the recorded shape (Megatron-LM does the same).
    """
    grad = torch.ones_like(output) if grad is None else grad
    return _engine_backward((output,), (grad,), inputs, keep_graph=keep_graph,
                            accumulate=accumulate)


def _engine_backward(roots, grads, inputs, *, keep_graph: bool, accumulate: bool):
    """The autograd engine from ``roots`` (tensors or gradient edges) with ``grads`` towards
    ``inputs``, without ``torch.autograd``'s argument checks (see :func:`_run_backward` and
    :func:`backward_weight` for why they are skipped)."""
    return torch.autograd.Variable._execution_engine.run_backward(
        tensors=tuple(roots), grad_tensors=tuple(grads), keep_graph=keep_graph,
        create_graph=False, inputs=tuple(inputs), allow_unreachable=True,
        accumulate_grad=accumulate)


def input_half_boundary(output: torch.Tensor, input_tensor: Optional[torch.Tensor],
                        params: "Sequence[torch.nn.Parameter] | TrainableParameters"
                        ) -> Optional[list]:
    """What :func:`backward_input` finds in the graph before it runs autograd: the boundary nodes
    of ``output``'s graph (each with the parameters it alone leads to); None when there is nothing
    to split (no graph, or a first stage) or two parts share a parameter. It needs no gradient,
    so a caller may compute it while the gradient message is still in flight and pass it in."""
    if output.grad_fn is None or input_tensor is None:
        return None
    trainable = TrainableParameters.coerce(params)
    return _boundary_nodes(output.grad_fn, get_gradient_edge(input_tensor).node,
                           set(trainable.param_of_node))


_FIND_BOUNDARY = object()  # backward_input's default: walk the graph itself


def backward_input(output: torch.Tensor, grad: Optional[torch.Tensor],
                   input_tensor: Optional[torch.Tensor],
                   params: "Sequence[torch.nn.Parameter] | TrainableParameters",
                   boundary=_FIND_BOUNDARY) -> tuple[Optional[torch.Tensor],
                                                     DeferredWeightGradients]:
    """The input gradient of ``output`` (None for a first stage) and what the weight half needs.

    ``grad`` is the gradient of ``output`` (None when ``output`` is the scalar loss); ``params``
    the stage's parameters, or their :class:`TrainableParameters` resolved beforehand;
    ``boundary``: :func:`input_half_boundary` of the same arguments, if already computed.
    """
    trainable = TrainableParameters.coerce(params)
    params = list(trainable.params)
    if output.grad_fn is None:
        return None, DeferredWeightGradients()
    if input_tensor is None:  # a first stage: the whole backward is weight work
        root = GradientEdge(output.grad_fn, output.output_nr)
        part = ([root], [grad if grad is not None else torch.ones_like(output)], params)
        return None, DeferredWeightGradients([part])
    param_of_node = trainable.param_of_node
    if boundary is _FIND_BOUNDARY:
        boundary = input_half_boundary(output, input_tensor, trainable)
    if boundary is None:  # shared parameters across parts: one full backward now
        _run_backward(output, grad, [input_tensor] + params, keep_graph=False, accumulate=True)
        input_grad, input_tensor.grad = input_tensor.grad, None
        return input_grad, DeferredWeightGradients(full_backward=True)
    captured: dict = {}
    handles = [node.register_prehook(
        lambda grad_outputs, node=node: captured.__setitem__(node, grad_outputs))
        for node, _ in boundary]
    try:
        (input_grad,) = _run_backward(output, grad, [input_tensor], keep_graph=True,
                                      accumulate=False)
    finally:
        for handle in handles:
            handle.remove()
    deferred = DeferredWeightGradients()
    for node, owned in boundary:
        node_grads = [(index, g) for index, g in enumerate(captured.get(node, ()))
                      if g is not None]
        if node_grads:
            deferred.parts.append(([GradientEdge(node, index) for index, _ in node_grads],
                                   [g for _, g in node_grads],
                                   [param_of_node[n] for n in owned]))
    return input_grad, deferred


def backward_weight(deferred: DeferredWeightGradients) -> None:
    """Compute the deferred weight gradients and add them into ``param.grad``; frees the graph.

    The engine is called directly, as ``torch.autograd.backward(roots, grads, inputs=params)``
    would after its argument checks (every root has its captured gradient; the checks cost
    ~0.15 ms on this op's critical path after a sleep, docs/benchmarks.md §9). The engine
    accumulates each parameter's gradient itself (``param.grad += g``, as a full backward does),
    so the parameters' post-accumulate-grad hooks fire: ``--overlap-grad-reduce`` launches a
    bucket's reduction from them during the module's last weight half. Each parameter belongs to
    one part (:func:`_boundary_nodes`), so its hook fires once per weight half."""
    for roots, grads, params in deferred.parts:
        _engine_backward(roots, grads, params, keep_graph=False, accumulate=True)
    deferred.parts = []
