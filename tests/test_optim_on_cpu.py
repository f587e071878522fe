"""The optimizers edgerl builds: fused AdamW on FSDP2-sharded parameters equals the plain loop; the
table of bytes per parameter that the memory model reads is what the optimizers really allocate."""

import pytest
import torch
import torch.distributed as dist

from edgerl.plan.dtypes import torch_dtype
from edgerl.core.errors import OptimizerError
from edgerl.models.load import init_distributed
from edgerl.train.optim import OPTIMIZERS, make_optimizer


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


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "adamw8bit"])  # 8-bit: test_lora_cuda.py
def test_bytes_per_parameter_table_matches_what_the_optimizer_allocates(name):
    spec = OPTIMIZERS[name]
    p = torch.nn.Parameter(torch.randn(64, 96, dtype=torch_dtype(spec.param_dtype)))
    opt = make_optimizer([p], name, 1e-3, (0.9, 0.999), 0.0)
    p.grad = torch.randn_like(p)
    opt.step()
    state = sum(t.nbytes for t in opt.state[p].values() if t.numel() > 1)  # not the step counter
    assert (p.element_size(), p.grad.element_size(), state / p.numel()) == (spec.weights, spec.grads, spec.state)
    assert spec.total == {"adamw": 16, "adamw-bf16": 10, "adamw-bf16-sr": 8}[name]


def test_bf16_optimizers_refuse_fp32_parameters_and_unknown_names_list_the_choices():
    with pytest.raises(OptimizerError, match="float32.*load the model in bf16"):
        make_optimizer([torch.nn.Parameter(torch.zeros(3))], "adamw-bf16", 1e-3, (0.9, 0.999), 0.0)
    with pytest.raises(OptimizerError, match="adamw, adamw8bit, adamw-bf16, adamw-bf16-sr"):
        make_optimizer([torch.nn.Parameter(torch.zeros(3))], "adam", 1e-3, (0.9, 0.999), 0.0)
