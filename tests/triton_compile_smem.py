"""Compile the log-prob Triton kernels for a GPU target without a GPU and print their shared memory.

Run as a script (never with TRITON_INTERPRET=1, which turns the kernels into interpreted functions):
    python tests/triton_compile_smem.py '[[CC, DTYPE, BLOCK_N, BLOCK_V, BLOCK_K, NUM_WARPS, NUM_STAGES], ...]'
prints one JSON list with {"fwd": bytes, "grad": bytes} per config: Triton's own `metadata.shared`.
Used by tests/test_tiles_on_cpu.py; Triton's bundled ptxas does the compiling.
"""
import json
import sys
import warnings

warnings.filterwarnings("ignore")  # Triton 3.9 warns about its FP-fusion default on every compile

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from edgerl.kernels import _triton_kernels as K  # noqa: E402

POINTER = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}


def compiled_shared(kernel, cc: int, dtype: str, bn: int, bv: int, bk: int, warps: int, stages: int) -> int:
    p = POINTER[dtype]
    const = dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, EVEN_K=True, DOT_UPCAST=False,
                 INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    if kernel is K.fwd_stats_kernel:
        sig = dict(h_ptr=p, w_ptr=p, tgt_ptr="*i64", m_ptr="*fp32", s_ptr="*fp32", t_ptr="*fp32",
                   ztgt_ptr="*fp32", N="i32", V="i32", H="i32", stride_hn="i32", stride_wv="i32",
                   inv_temp="fp32", tiles_per_split="i32")
        const["COMPUTE_ENTROPY"] = True
    else:
        sig = dict(h_ptr=p, w_ptr=p, tgt_ptr="*i64", lse_ptr="*fp32", mz_ptr="*fp32", dlogp_ptr="*fp32",
                   dent_ptr="*fp32", g_ptr=p, R="i32", C="i32", H="i32", stride_hn="i32", stride_wv="i32",
                   stride_g="i32", col0="i32", inv_temp="fp32", n_row_blocks="i32")
        const.update(HAS_DLOGP=True, HAS_DENT=True)
    sig.update({name: "constexpr" for name in const})
    # What the JIT infers for a real launch with hidden % 16 == 0: 16-byte aligned pointers and
    # strides divisible by 16. Without it loads are not vectorised and the loop is not pipelined,
    # so the shared memory would be understated.
    aligned = [i for i, name in enumerate(kernel.arg_names)
               if name.endswith("_ptr") or name in ("H", "stride_hn", "stride_wv", "stride_g")]
    src = ASTSource(kernel, sig, const, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    return int(compiled.metadata.shared)


if __name__ == "__main__":
    if K.INTERPRETED:
        sys.exit("TRITON_INTERPRET=1 is set; unset it to compile")
    print(json.dumps([{"fwd": compiled_shared(K.fwd_stats_kernel, *cfg), "grad": compiled_shared(K.grad_logits_kernel, *cfg)}
                      for cfg in json.loads(sys.argv[1])]))
