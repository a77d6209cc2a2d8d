"""Where a consumer warpgroup's loop iteration goes in the Gluon sage2 kernel (needs an sm_90 GPU): a copy of
``kernels/attn_gluon.py`` with ``%clock`` reads at the phase boundaries of ``_section``
(``kernel_copy.edited_copy``), non-causal unless ``--causal``, B=4, H=32, D=128, bf16, sage2-8b operands; prints
the SM cycles a loop iteration spends in each phase (summed over programs and their loop iterations: every section
but the first, masked one), per consumer warpgroup.

    python eval/probes/timeline_gluon_attention.py [--causal] [N ...]   # default: 2048 8192

Phases (``_section``, block j): ``data`` waits for K_{j+1} and V_j; ``turn`` for the other warpgroup's MMA issue;
``qk_wait`` issues Q·K_{j+1} and P̃_j·V_j and waits for Q·K_{j+1}; ``max`` is softmax up to the new row max
(I2FP, the FFMA with δQδK and ΔS, the row max); ``exp_sum`` the exp2s and the row sum; ``tail`` the rest of the
softmax (FP8 conversion); ``publish`` P̃ into shared memory (fence and warpgroup barrier); ``pv_wait`` waits for
P̃_j·V_j and releases the stage. ``loop`` is the whole loop divided by its iterations (the acc update and the
reads themselves are the difference). The clock reads cost the kernel ~9 % (H200, session 17): the split is a
guide, not a measurement of the unmodified kernel. Reads anchored on a value (the row max, the row sum) come
after it; ptxas may still move independent work across them.
"""

import sys

import torch
from kernel_copy import edited_copy

PHASES = ("data", "turn", "qk_wait", "max", "exp_sum", "tail", "publish", "pv_wait", "loop", "iters")

CLOCK = '''@gluon.jit
def _clock(anchor):
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [anchor], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _publish('''
EDITS = [  # (anchor, replacement[, times found]): once unless said
    ("@gluon.jit\ndef _publish(", CLOCK),
    ("    m_new = gl.maximum(m_i, gl.max(s, 1))\n",
     "    m_new = gl.maximum(m_i, gl.max(s, 1))\n    c_max = _clock(m_new)\n"),
    ("    l_i = l_i * alpha + gl.sum(p, 1)\n", "    l_i = l_i * alpha + gl.sum(p, 1)\n    c_sum = _clock(l_i)\n"),
    ("    return gl.convert_layout(p8, p_op), alpha, m_new, l_i\n",
     "    return gl.convert_layout(p8, p_op), alpha, m_new, l_i, c_max, c_sum\n"),
    ("row_o: gl.constexpr, p_op: gl.constexpr):\n    \"\"\"Section j + 1",
     "row_o: gl.constexpr, p_op: gl.constexpr, t):\n    \"\"\"Section j + 1"),
    ("    mbarrier.wait(k_ready.index(nbuf), ((j + 1) // STAGES) & 1)\n",
     "    c0 = _clock(l_i)\n    mbarrier.wait(k_ready.index(nbuf), ((j + 1) // STAGES) & 1)\n"),
    ("    mbarrier.wait(turn.index(WG), ((j + 1) & 1) ^ OTHER)\n",
     "    c1 = _clock(l_i)\n    mbarrier.wait(turn.index(WG), ((j + 1) & 1) ^ OTHER)\n    c2 = _clock(l_i)\n"),
    ("    s_int = hopper.warpgroup_mma_wait(1, deps=[s_tok])\n    p_hat, alpha_next, m_i, l_i = _softmax_block(",
     "    s_int = hopper.warpgroup_mma_wait(1, deps=[s_tok])\n    c3 = _clock(gl.max(s_int, 1))\n"
     "    p_hat, alpha_next, m_i, l_i, c_max, c_sum = _softmax_block("),
    ("    _publish(p_hat, p_s.index(2 * WG + (j + 1) % 2))",
     "    c4 = _clock(l_i)\n    _publish(p_hat, p_s.index(2 * WG + (j + 1) % 2))"),
    ("    r = hopper.warpgroup_mma_wait(0, deps=[r_tok])\n    mbarrier.arrive(kv_empty.index(buf))  # K_j",
     "    c5 = _clock(l_i)\n    r = hopper.warpgroup_mma_wait(0, deps=[r_tok])\n"
     "    mbarrier.arrive(kv_empty.index(buf))  # K_j"),
    ("    return m_i, l_i, alpha_next, acc, ks_next, ks_after\n",
     "    c6 = _clock(l_i)\n"
     "    t = (t[0] + (c1 - c0), t[1] + (c2 - c1), t[2] + (c3 - c2), t[3] + (c_max - c3), t[4] + (c_sum - c_max),\n"
     "         t[5] + (c4 - c_sum), t[6] + (c5 - c4), t[7] + (c6 - c5))\n"
     "    return m_i, l_i, alpha_next, acc, ks_next, ks_after, t\n"),
    ("    p_hat, alpha, m_i, l_i = _softmax_block(s_int, scale, ds_s.index(0),",
     "    p_hat, alpha, m_i, l_i, c_max, c_sum = _softmax_block(s_int, scale, ds_s.index(0),"),
    ("    for j in range(n_blocks - 1):\n        m_i, l_i, alpha, acc, ks_next, ks_after = _section(",
     "    z = gl.zeros([WG_ROWS], gl.int32, layout=row_s)\n    t = (z, z, z, z, z, z, z, z)\n"
     "    c_start = _clock(l_i)\n"
     "    for j in range(n_blocks - 1):\n        m_i, l_i, alpha, acc, ks_next, ks_after, t = _section("),
    ("BLOCK_N, STAGES, SMOOTH_Q, TOKEN_SCALES, PV_INT8, LANE_DK_RING, col_s, row_s, row_o, p_op)\n",
     "BLOCK_N, STAGES, SMOOTH_Q, TOKEN_SCALES, PV_INT8, LANE_DK_RING, col_s, row_s, row_o, p_op, t)\n"
     "    t_loop = _clock(l_i) - c_start\n"),
    ("    if RETURN_LSE:\n        ds_shift",
     "    slot = CLK_ptr + ((pid_bh * gl.num_programs(0) + gl.program_id(0)) * 2 + WG) * 10 + 0 * rows\n"
     "    for i in gl.static_range(8):\n        gl.store(slot + i, t[i], mask=rows == r0)\n"
     "    gl.store(slot + 8, t_loop, mask=rows == r0)\n"
     "    gl.store(slot + 9, 0 * rows + n_blocks - 1, mask=rows == r0)\n"
     "    if RETURN_LSE:\n        ds_shift"),
    ("    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + _block_pv(r)\n    return m_i, l_i, acc\n",
     "    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + _block_pv(r)\n    return m_i, l_i, acc, t, t_loop\n"),
    ("        m_i, l_i, acc = _pingpong_loop(", "        m_i, l_i, acc, t, t_loop = _pingpong_loop("),
    ("VS_ptr, VM_ptr, O_ptr, LSE_ptr, stride_ob, stride_oh, stride_om)",
     "VS_ptr, VM_ptr, O_ptr, LSE_ptr, stride_ob, stride_oh, stride_om, CLK_ptr)"),
    ("VS_ptr, VM_ptr, O_ptr, LSE_ptr, stride_ob, stride_oh, stride_om = tensors",
     "VS_ptr, VM_ptr, O_ptr, LSE_ptr, stride_ob, stride_oh, stride_om, CLK_ptr = tensors"),
    ("VS_ptr, VM_ptr, O_ptr, LSE_ptr,\n    stride_ob", "VS_ptr, VM_ptr, O_ptr, LSE_ptr, CLK_ptr,\n    stride_ob"),
    ("x.v_scale, x.v_mean, o,\n         lse,", "x.v_scale, x.v_mean, o,\n         lse, CLK,"),
    ("_LAUNCH = LaunchPlans(_attn_qk_int8_fwd_gluon)", "CLK = None\n_LAUNCH = LaunchPlans(_attn_qk_int8_fwd_gluon)"),
]


def main() -> None:
    import quantpatch as qp
    from quantpatch.kernels import fast_paths
    from quantpatch.kernels.qk_quant_triton import QuantizedQKV

    tm = edited_copy("attn_gluon", EDITS)
    cfg = qp.get_mode("sage2-8b").attention
    causal = "--causal" in sys.argv
    for n in [int(a) for a in sys.argv[1:] if a != "--causal"] or [2048, 8192]:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        x = QuantizedQKV(*fast_paths.quantize_qkv(q, k, v, **fast_paths.quant_options(cfg), v_key_order=True))
        tm.CLK = torch.zeros(4 * 32 * -(-n // tm.BLOCK_M) * 2 * 10, dtype=torch.int32, device="cuda")
        for _ in range(3):
            tm.attn_qk_int8_gluon(x, n, is_causal=causal, block_q=cfg.block_q, v_keys_permuted=x.v_hat_t)
        torch.cuda.synchronize()
        c = tm.CLK.view(-1, 2, 10).double()
        per_iter = c[..., :9].sum(0) / c[..., 9:].sum(0).clamp(min=1)  # (warpgroup, phase) cycles an iteration
        for wg in range(2):
            print(f"N={n}{' causal' * causal} WG{wg}: "
                  + ", ".join(f"{p} {per_iter[wg, i]:.0f}" for i, p in enumerate(PHASES[:9])))


if __name__ == "__main__":
    main()
