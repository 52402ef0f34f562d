"""BatchNorm running statistics that describe the weights they are used with (ALGORITHMS.md 6).

Running statistics stay on each device (FedBN), and training updates them with momentum 0.1
over the few minibatches of a round: at a round's end they mix the statistics of every set of
weights the round passed through, and after aggregation they describe none of the model's
current weights. A model evaluated in eval mode with such statistics misjudges itself (the
keyword-spotting example lost 10 to 20 points to them under every strategy, local training
included). `refreshed` re-estimates them from the device's own data under the weights they
will be used with: one forward pass in train mode over the data, nothing learned.
"""

from __future__ import annotations

import torch
from torch import nn

from agent.learning.sparse import State

STATISTICS_BATCH = 512
"""Samples a forward pass of the re-estimation takes at most (memory, not the result: every
chunk of the data is about the same size and counts the same)."""


def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers that keep running statistics."""
    return [
        module
        for module in model.modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats
    ]


@torch.no_grad()
def refreshed(
    model: nn.Module, state: State, x: torch.Tensor, names: tuple[str, ...] | list[str]
) -> State:
    """`state` with its BatchNorm running statistics `names` re-estimated on the inputs `x`
    under `state`'s own weights; every other entry is `state`'s own tensor.

    The statistics are the exact average over `x` (cumulative averaging, momentum None, over
    chunks of nearly equal size, in order: no randomness), with only the BatchNorm layers in
    train mode, so dropout and the like do not disturb them. With no names, or fewer than two
    samples (a batch statistic needs two), `state` comes back as it is.
    """
    if not names or len(x) < 2:
        return state
    model.load_state_dict(state)
    norms = batch_norms(model)
    if not norms:
        return state
    momenta = [module.momentum for module in norms]
    device = next(model.buffers()).device
    model.eval()
    try:
        for module in norms:
            module.reset_running_stats()
            module.momentum = None
            module.train()
        chunks = -(-len(x) // STATISTICS_BATCH)
        for part in torch.tensor_split(x, chunks):
            model(part.to(device))
    finally:
        for module, momentum in zip(norms, momenta, strict=True):
            module.momentum = momentum
        model.eval()
    current = model.state_dict()
    wanted = set(names)
    return {
        name: current[name].detach().to("cpu", copy=True) if name in wanted else tensor
        for name, tensor in state.items()
    }
