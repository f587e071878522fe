"""Compile edgerl's Triton kernels for a GPU target without a GPU and print their shared memory.

Run as a script (never with TRITON_INTERPRET=1, which turns the kernels into interpreted functions):
    python tests/triton_compile_smem.py '[[CC, DTYPE, BLOCK_N, BLOCK_V, BLOCK_K, NUM_WARPS, NUM_STAGES], ...]'
prints one JSON list with {"fwd": bytes, "grad": bytes} per config (the log-prob kernels), and
    python tests/triton_compile_smem.py decode '[[CC, DTYPE, HEAD_DIM, GROUP, NUM_STAGES], ...]'
one list of bytes per config (the decode-attention kernel): Triton's own `metadata.shared`.
Used by tests/test_tiles_on_cpu.py; Triton's bundled ptxas does the compiling.
"""
import json
import sys
import warnings

warnings.filterwarnings("ignore")  # Triton 3.9 warns about its FP-fusion default on every compile

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from edgerl.kernels import _triton_decode_attention as DA  # noqa: E402
from edgerl.kernels import _triton_kernels as K  # noqa: E402
from edgerl.kernels.tiles import DECODE_BLOCK_S, group_pad  # noqa: E402

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


def decode_shared(cc: int, dtype: str, head_dim: int, group: int, stages: int) -> int:
    p = POINTER[dtype]
    const = dict(KVH=8, G=group, GP=group_pad(group), D=head_dim, BLOCK=DECODE_BLOCK_S, IEEE=dtype == "fp32",
                 UPCAST=False)
    strides = ("sq_b", "sq_h", "sq_g", "sk_b", "sk_h", "sk_s", "sv_b", "sv_h", "sv_s", "so_b", "so_h", "so_g")
    sig = dict(q_ptr=p, k_ptr=p, v_ptr=p, o_ptr=p, start_ptr="*i64", col_ptr="*i64", scale="fp32",
               **{name: "i32" for name in strides}, **{name: "constexpr" for name in const})
    # a real launch: aligned pointers and strides divisible by 16 (head sizes >= 16), so loads are
    # vectorised and the loop pipelined, as the JIT specialises it
    aligned = [i for i, name in enumerate(DA.decode_attention_kernel.arg_names)
               if name.endswith("_ptr") and name not in ("start_ptr", "col_ptr") or name in strides]
    src = ASTSource(DA.decode_attention_kernel, sig, const, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=4, num_stages=stages))
    return int(compiled.metadata.shared)


if __name__ == "__main__":
    if K.INTERPRETED:
        sys.exit("TRITON_INTERPRET=1 is set; unset it to compile")
    if sys.argv[1] == "decode":
        print(json.dumps([decode_shared(*cfg) for cfg in json.loads(sys.argv[2])]))
        sys.exit(0)
    print(json.dumps([{"fwd": compiled_shared(K.fwd_stats_kernel, *cfg), "grad": compiled_shared(K.grad_logits_kernel, *cfg)}
                      for cfg in json.loads(sys.argv[1])]))
