"""The planner's expert parallelism: transformers' all-to-all dispatch with the routing of a balanced router.

A simulated step has no routing to read: under FakeTensorMode the router's choices are tensors without
values, and transformers' `AllToAllEP` reads its split sizes back to the host from them (`.tolist()` of the
exchanged counts), which a fake tensor cannot give. The plan instead assumes what load balancing aims at:
each rank sends every rank of its ep group an equal share of its (token, expert) pairs, and each local expert
receives an equal share of the rows. Everything else is transformers' own path: the experts sharded over the
ep group, its combine (`_combine_tokens`, the reverse all-to-all and the weighted sum), autograd's
all-to-alls in backward, and FSDP2 over efsdp. Registered under its own name in transformers'
`EPImplementationInterface` (its extension point), so the recipe's runs never meet it.

What a real run adds to it: an uneven router sends the busiest rank more rows than its share (its
activations and all-to-all bytes grow by the run's `moe/load_max`-like factor per rank); the plan is the
balanced step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.distributed.expert_parallel import (
    AllToAllEP,
    EPImplementationInterface,
    _AllToAllState,
    _WaitTensor,
    all_to_all_single_autograd,
)

NAME = "lmpretrain_planned_balanced"


class BalancedAllToAllEP(AllToAllEP):
    """`AllToAllEP` whose split sizes are a balanced router's: no value of the routing is read."""

    def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
        ep_group, ep_size = self.ep_mesh.get_group(), self.ep_mesh.size()
        pairs = top_k_index.numel()  # (token, expert) pairs this rank routes
        sizes = [pairs // ep_size + (rank < pairs % ep_size) for rank in range(ep_size)]
        # the per-expert counts' exchange, as the real dispatch does first (their values are not read here)
        counts = torch.zeros(ep_size, self.num_local_experts, dtype=torch.long, device=hidden_states.device)
        dist.all_to_all_single(torch.empty_like(counts), counts, group=ep_group)
        order = torch.arange(
            pairs, device=hidden_states.device
        )  # pairs in routed order, as if sorted by expert
        send_tokens = hidden_states[order // top_k_index.size(-1)]
        recv_tokens = _WaitTensor.apply(all_to_all_single_autograd(send_tokens, sizes, sizes, ep_group))
        rows = sum(sizes)
        # each local expert gets an equal run of the received rows
        local_ids = torch.arange(rows, device=hidden_states.device) * self.num_local_experts // max(rows, 1)
        recv_expert_ids = local_ids.unsqueeze(-1)
        recv_weights = torch.ones_like(recv_expert_ids, dtype=recv_tokens.dtype)
        state = _AllToAllState(top_k_weights, order, sizes, sizes, hidden_states.size(0))
        return recv_tokens, recv_expert_ids, recv_weights, state


EPImplementationInterface.register(NAME, BalancedAllToAllEP)
