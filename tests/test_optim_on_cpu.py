"""The optimizer edgerl builds: fused AdamW on FSDP2-sharded parameters equals the plain loop."""

import torch
import torch.distributed as dist

from edgerl.models import init_distributed
from edgerl.optim import make_optimizer


def test_fused_adamw_on_sharded_params_equals_the_reference_loop():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    init_distributed(torch.device("cpu"))
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))  # noqa: E731
    sharded, ref = make(), make()
    ref.load_state_dict(sharded.state_dict())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opt = make_optimizer(sharded.parameters(), "adamw", lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    assert opt.defaults["fused"], "the plan's memory model assumes the fused step (no whole-model temporaries)"
    loop = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    x = torch.randn(5, 8)
    for _ in range(4):
        for model, o in ((sharded, opt), (ref, loop)):
            o.zero_grad()
            model(x).square().sum().backward()
            o.step()
    for a, b in zip(sharded.parameters(), ref.parameters()):
        torch.testing.assert_close(a.full_tensor(), b, rtol=1e-6, atol=1e-7)
