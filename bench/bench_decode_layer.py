"""One decode layer of the Triton layers at 16 rows in bf16 on the GPU: the five kernels (q/k/v, rotary
attention, o, gate/up, down; kernels/decode_linear.py and decode_attention.py) against the same layer as one
persistent kernel (`decode_linear.decode_layer`), each over as many weight copies as the model has layers (so
L2 holds none), timed in a CUDA graph; the five kernels' own GPU times from the profiler; and with --sweep the
persistent kernel with other tiles per phase. Prints microseconds per layer and the share of the bound
(the layer's weight and cache bytes over the measured copy bandwidth)."""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from edgerl.modelspec import CATALOGUE  # noqa: E402


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


def five(layers, x, cos, sin, start, col, group, scale):
    from edgerl.kernels.decode_attention import decode_attention_rope
    from edgerl.kernels.decode_linear import decode_linear
    d = x.float().square().sum(-1)[None]
    B = x.shape[0]
    for L in layers:
        qkv = decode_linear(x, L["qkv_w"], norm=L["ln1"], eps=1e-5, sumsq=d)
        o = decode_attention_rope(qkv, cos, sin, L["kv"][0], L["kv"][1], start, col, scale, group)
        x, ss = decode_linear(o.view(B, -1), L["o_w"], residual=x, return_sumsq=True)
        h = decode_linear(x, L["gu_w"], norm=L["ln2"], eps=1e-5, glu=True, sumsq=ss)
        x, d = decode_linear(h, L["down_w"], residual=x, return_sumsq=True)
    return x


def whole(layers, x, cos, sin, start, col, group, scale, tiles=None, prefetch=True):
    from edgerl.kernels.decode_linear import decode_layer
    d = x.float().square().sum(-1)[None]
    for L in layers:
        x, d = decode_layer(x, d, L["ln1"], 1e-5, L["qkv_w"], None, cos, sin, L["kv"][0], L["kv"][1], start, col,
                            scale, group, L["o_w"], None, L["ln2"], 1e-5, L["gu_w"], None, L["down_w"], None,
                            tiles=tiles, prefetch=prefetch)
    return x


def timed(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


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


def bandwidth_tbs(dev):
    a = torch.empty(2 ** 30 // 2, dtype=torch.float16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    e1.synchronize()
    return 2 * a.numel() * 2 * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e12


def sweep_tiles(name, B, sms):
    """Persistent-kernel tiles to try: one phase changed at a time from the defaults."""
    out = []
    for bn in (16, 32):
        out.append({"qkv": (16, bn, 256, 4, 3, 1, 1)})
    for bn in (16, 64):
        out.append({"gu": (16, bn, 128 if bn == 64 else 256, 4, 3, 1, 0)})
    for bn, split in ((16, 1), (16, 2), (32, 4), (16, 4), (32, 8)):
        out.append({"o": (16, bn, 128, 4, 3, split, 0)})
        out.append({"down": (16, bn, 128, 4, 3, split, 0)})
    out.append({"o": (16, 16, 128, 4, 3, 2, 0), "down": (16, 16, 128, 4, 3, 4, 0), "qkv": (16, 32, 256, 4, 3, 1, 1),
                "gu": (16, 16, 256, 4, 3, 1, 0)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="360m,1.7b")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--col", type=int, default=192, help="the cache column written (the rows see 0..col)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    bw = bandwidth_tbs(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {bw:.2f} TB/s, {sms} SMs")
    results = []
    for name in a.models.split(","):
        layers, x, cos, sin, start, col, group, scale, nbytes = layer_tensors(name, a.rows, 512, a.col,
                                                                                torch.bfloat16, dev)
        n = len(layers)
        bound_us = nbytes / (bw * 1e12) * 1e6
        args = (layers, x, cos, sin, start, col, group, scale)
        want = five(*args)
        got, plain = whole(*args), whole(*args, prefetch=False)
        torch.cuda.synchronize()
        same = bool(torch.equal(want, got)) and bool(torch.equal(want, plain))
        rows = [("five kernels", timed(lambda: five(*args)) * 1e3 / n, None),
                ("one persistent kernel", timed(lambda: whole(*args)) * 1e3 / n, None),
                ("one persistent kernel, no L2 prefetch", timed(lambda: whole(*args, prefetch=False)) * 1e3 / n, None)]
        ktimes = kernel_times(lambda: five(*args))
        print(f"{name}: bound {bound_us:.2f} us per layer ({nbytes / 2**20:.1f} MiB); persistent == five kernels: "
              f"{same}; five kernels' GPU times (us): " + ", ".join(f"{k} {v:.2f}" for k, v in ktimes.items()))
        if a.sweep:
            for t in sweep_tiles(name, a.rows, sms):
                if time.time() - t0 > a.budget_s:
                    print("budget spent: sweep stopped")
                    break
                try:
                    rows.append((f"persistent {t}", timed(lambda: whole(*args, tiles=t)) * 1e3 / n, t))
                except Exception as e:   # a tile set the kernel refuses or that does not compile: shown, skipped
                    print(f"  {t}: {type(e).__name__}: {str(e)[:200]}")
        for label, us, t in rows:
            print(f"| {name} | {label} | {us:.2f} us | {100 * bound_us / us:.1f}% of bound |")
            results.append(dict(model=name, variant=label, us_per_layer=us, bound_us=bound_us,
                                tiles={k: list(v) for k, v in t.items()} if t else None))
        results.append(dict(model=name, kernel_us=ktimes, persistent_equal=same))
        if a.out:
            Path(a.out).write_text(json.dumps(dict(bandwidth_tbs=bw, results=results), indent=1))


if __name__ == "__main__":
    main()
