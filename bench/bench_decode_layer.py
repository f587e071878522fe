"""One decode layer of the Triton layers at 16 rows in bf16 on the GPU: the five kernels (q/k/v, rotary
attention, o, gate/up, down; edgerl/kernels/decode_linear.py and decode_attention.py) over as many weight and cache
copies as the model has layers (so L2 holds none), timed in a CUDA graph, with each kernel's own GPU time
from the profiler, and beside them the floor of five kernels that read and write one row each; with --sweep
the rotary attention kernel alone at other column blocks, pipeline depths and warp counts; with --tiles-from
(bench_decode_gemm.py --triton --sweep's JSON) the layer with each product on its fastest swept tiles. Prints
microseconds per layer (or per attention launch) and the share of the bound (the bytes read over the copy
bandwidth measured in the same run)."""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_gemm import (  # noqa: E402  (timed: us per call of fn / n, in a CUDA graph)
    refuse_unknown_models_and_out, require_cuda, timed)
from bench_rollout import measure_bandwidth  # noqa: E402  (bytes/s of a device-to-device copy, best of 3)
from edgerl.core.files import write_atomically  # noqa: E402
from edgerl.plan.modelspec import CATALOGUE  # noqa: E402


def layer_tensors(name, rows, cols, col, dtype, dev):
    c = CATALOGUE[f"smollm2-{name}"].llama_config_fields()
    H, I, NH, KVH = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    D = H // NH
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * s).to(dtype)
    layers = [dict(qkv_w=r((NH + 2 * KVH) * D, H, s=H ** -0.5), o_w=r(H, H, s=H ** -0.5),
                   gu_w=r(2 * I, H, s=H ** -0.5), down_w=r(H, I, s=I ** -0.5), ln1=1 + r(H, s=0.1), ln2=1 + r(H, s=0.1),
                   kv=r(2, rows, KVH, cols, D)) for _ in range(c["num_hidden_layers"])]
    x = r(rows, H)
    pos = torch.full((rows,), col, device=dev)
    inv = 1.0 / (100000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
    f = pos[:, None].float() * inv[None]
    cos, sin = torch.cat((f, f), -1).cos().to(dtype), torch.cat((f, f), -1).sin().to(dtype)
    start = torch.zeros(rows, dtype=torch.long, device=dev)
    colt = torch.tensor([col], device=dev)
    weight_bytes = sum(t.numel() * t.element_size() for k, t in layers[0].items() if k != "kv")
    cache_bytes = 2 * rows * KVH * (col + 1) * D * x.element_size()
    return layers, x, cos, sin, start, colt, NH // KVH, D ** -0.5, weight_bytes + cache_bytes


def five(layers, x, cos, sin, start, col, group, scale, tiles=None):
    """The layers' five kernels; tiles: {product: tiles} for the products not on the rule's tiles."""
    from edgerl.kernels.decode_attention import decode_attention_rope
    from edgerl.kernels.decode_linear import decode_linear
    t = tiles or {}
    d = x.float().square().sum(-1)[None]
    B = x.shape[0]
    for L in layers:
        qkv = decode_linear(x, L["qkv_w"], norm=L["ln1"], eps=1e-5, sumsq=d, tiles=t.get("qkv"))
        o = decode_attention_rope(qkv, cos, sin, L["kv"][0], L["kv"][1], start, col, scale, group)
        x, ss = decode_linear(o.view(B, -1), L["o_w"], residual=x, return_sumsq=True, tiles=t.get("o"))
        h = decode_linear(x, L["gu_w"], norm=L["ln2"], eps=1e-5, glu=True, sumsq=ss, tiles=t.get("gate_up"))
        x, d = decode_linear(h, L["down_w"], residual=x, return_sumsq=True, tiles=t.get("down"))
    return x


def floor_us(x, n, per_layer=5, programs=128):
    """us per layer of `per_layer` Triton kernels of `programs` programs that each read x.shape[1] values and write
    them (each kernel waits for the one before, as the layer's do): what a layer of that many kernels costs
    before it reads any weight."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_row(src, dst, N: tl.constexpr):
        i = tl.program_id(0) * N + tl.arange(0, N)
        tl.store(dst + i, tl.load(src + i) + 1)
    N = triton.next_power_of_2(x.shape[1])
    a, b = (torch.zeros(programs * N, device=x.device, dtype=x.dtype) for _ in range(2))

    def run():
        for _ in range(n * per_layer // 2):
            copy_row[(programs,)](a, b, N=N)
            copy_row[(programs,)](b, a, N=N)
    return timed(run, n * per_layer // 2 * 2 / per_layer)


def kernel_times(fn, per_layer=5):
    """The GPU time of each of a layer's kernels (median over the layers), from the profiler."""
    fn()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA" and "decode_" in e.name]
    names = ["qkv", "attention", "o", "gate_up", "down"]
    out = {}
    for i, n in enumerate(names):
        ts = sorted(e.device_time for e in ev[i::per_layer])
        out[n] = ts[len(ts) // 2] if ts else None
    return out


def attention_sweep(layers, x, cos, sin, start, col, group, scale, bw, smem):
    """The rotary attention kernel alone over the layers' caches, at other BLOCK / stages / warps."""
    from edgerl.kernels.decode_attention import kernel_module
    from edgerl.kernels.tiles import group_pad
    mod = kernel_module()
    B, n = x.shape[0], len(layers)
    _, _, KVH, _, D = layers[0]["kv"].shape
    qkv = torch.randn(B, (group + 2) * KVH * D, device=x.device).to(x.dtype)
    o = torch.empty(B, KVH, group, D, device=x.device, dtype=x.dtype)
    nbytes = 2 * B * KVH * (int(col) + 1) * D * x.element_size()
    rows = []
    for block in (32, 64, 128):
        for stages in (1, 2, 3, 4):
            need = (2 * (stages - 1) if stages >= 2 else 1) * block * D * 2 + (group_pad(group) + 32) * D * 2 + 4096
            if need > smem:
                continue
            for warps in (2, 4, 8):
                def run():
                    for L in layers:
                        k, v = L["kv"][0], L["kv"][1]
                        mod.decode_attention_rope_kernel[(B * KVH,)](
                            qkv, cos, sin, k, v, o, start, col, scale, qkv.stride(0), cos.stride(0), *k.stride()[:3],
                            *v.stride()[:3], *o.stride()[:3], QW=group * KVH * D, KVW=KVH * D, KVH=KVH, G=group,
                            GP=group_pad(group), D=D, BLOCK=block, IEEE=False, UPCAST=False, PLAIN=False,
                            num_warps=warps, num_stages=stages)
                try:
                    us = timed(run, n)
                except Exception as e:   # a configuration Triton refuses: shown, skipped
                    print(f"  BLOCK {block} stages {stages} warps {warps}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                bound = nbytes / (bw * 1e12) * 1e6
                rows.append(dict(block=block, stages=stages, warps=warps, us=us, of_bound=bound / us))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="360m,1.7b")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--col", type=int, default=192, help="the cache column written (the rows see 0..col)")
    ap.add_argument("--sweep", action="store_true", help="also the attention kernel at other configurations")
    ap.add_argument("--tiles-from", default=None, help="bench_decode_gemm.py --triton --sweep's JSON: also time the "
                    "layer with each product on its fastest swept tiles")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    refuse_unknown_models_and_out(ap, a.models, a.out)
    if a.rows < 1 or not 0 <= a.col < 512:
        ap.error("--rows needs at least 1 and --col a column in [0, 512) (the cache holds 512)")
    swept = {}
    if a.tiles_from:
        from bench_decode_gemm import best_tiles
        try:
            recs = json.loads(Path(a.tiles_from).read_text())
            for r in recs:
                t = best_tiles(r)
                if t is not None:
                    swept.setdefault(r["model"], {})[r["proj"]] = t
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--tiles-from {a.tiles_from}: not a bench_decode_gemm.py --sweep JSON ({type(e).__name__}: {e})")
        if not swept:
            ap.error(f"--tiles-from {a.tiles_from}: no product in it has swept tiles (run bench_decode_gemm.py with "
                     "--triton --sweep)")
    require_cuda("bench_decode_layer.py times the decode layer's CUDA kernels")
    t0 = time.time()
    dev = torch.device("cuda")
    bw = measure_bandwidth(dev) / 1e12   # TB/s, as bench_rollout.py measures it
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {bw:.2f} TB/s, {sms} SMs")
    results = []
    for name in a.models.split(","):
        layers, x, cos, sin, start, col, group, scale, nbytes = layer_tensors(name, a.rows, 512, a.col,
                                                                                torch.bfloat16, dev)
        n = len(layers)
        bound_us = nbytes / (bw * 1e12) * 1e6
        args = (layers, x, cos, sin, start, col, group, scale)
        us = timed(lambda: five(*args), n)
        ktimes = kernel_times(lambda: five(*args))
        print(f"| {name} | five kernels | {us:.2f} us per layer | {100 * bound_us / us:.1f}% of bound "
              f"({nbytes / 2**20:.1f} MiB) | GPU time (us): " + ", ".join(f"{k} {v:.2f}" for k, v in ktimes.items())
              + f" (sum {sum(ktimes.values()):.2f}) |")
        floor = floor_us(x, n)
        print(f"| {name} | five 128-program kernels, each program reading and writing a row | {floor:.2f} us per layer |")
        rec = dict(model=name, us_per_layer=us, bound_us=bound_us, kernel_us=ktimes, us_per_layer_five_empty_kernels=floor)
        if swept.get(name):
            rec["swept_tiles"] = swept[name]
            rec["us_per_layer_swept_tiles"] = timed(lambda: five(*args, tiles=swept[name]), n)
            rec["kernel_us_swept_tiles"] = kernel_times(lambda: five(*args, tiles=swept[name]))
            print(f"| {name} | five kernels, each product on the sweep's fastest tiles {swept[name]} | "
                  f"{rec['us_per_layer_swept_tiles']:.2f} us per layer | GPU time (us): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in rec["kernel_us_swept_tiles"].items()) + " |")
        results.append(rec)
        if a.sweep and time.time() - t0 < a.budget_s:
            smem = torch.cuda.get_device_properties(dev).shared_memory_per_block_optin
            sweep = sorted(attention_sweep(*args, bw, smem), key=lambda r: r["us"])
            from edgerl.kernels.decode_attention import stages_for
            rule = (64, stages_for(dev, layers[0]["kv"].shape[-1], torch.bfloat16, group), 4)
            for r in sweep[:8] + [r for r in sweep if (r["block"], r["stages"], r["warps"]) == rule]:
                print(f"|   {name} attention BLOCK {r['block']} stages {r['stages']} warps {r['warps']} | "
                      f"{r['us']:.2f} us | {100 * r['of_bound']:.1f}% of its bound |")
            results.append(dict(model=name, attention_sweep=sweep))
        if a.out:
            write_atomically(Path(a.out), json.dumps(dict(bandwidth_tbs=bw, results=results), indent=1))


if __name__ == "__main__":
    main()
