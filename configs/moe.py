"""The quick start with a mixture of experts, built-in English->Spanish: 8 experts, top-2 routing (GShard), in
every other layer of each stack (docs/moe.md). Trains on the built-in corpus on a CPU from one command:

    python train.py --config=configs/moe.py --workdir=runs/moe

The log line adds the experts' part: the share of assignments dropped for capacity, the busiest expert's load
(1 = balanced), and the load-balancing and router z-losses, which the training loss includes.
"""

from configs import default


def get_config():
    config = default.get_config()
    model = config.model
    model.num_experts = 8
    model.experts_per_token = 2
    model.expert_every = 2
    return config
