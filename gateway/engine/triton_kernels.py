"""The Triton kernels of engine/attention.py (which says what they compute). A module of its own
because Triton is optional: it is imported only when a kernel is first launched. With
`TRITON_INTERPRET=1` set before Triton is imported (the test suite does so on a machine without a
GPU) they run on CPU tensors through Triton's interpreter."""

# ruff: noqa: E741  (kernel arguments named as in Triton's tutorials: Q, K, V, O)
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode(Q, K, V, Part, Lse, rows, q_start, g_start, g_len,
           o_start, o_len, scale, window, sqt, sqh, skh, skn,
           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
           BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    kv_head = kvh.to(tl.int64) * skh  # 64-bit: a head's offset in a large pool passes 2**31
    split = tl.program_id(2)
    seq = tl.load(rows + row)
    token = tl.load(q_start + seq)
    gs = tl.load(g_start + seq)
    gl = tl.load(g_len + seq)
    os_ = tl.load(o_start + seq)
    kv_len = gl + tl.load(o_len + seq)
    per_split = ((kv_len + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kv_len)
    if window > 0:
        lo = tl.maximum(lo, kv_len - window)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + token * sqt + heads[:, None] * sqh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
    qk_scale = scale * 1.4426950408889634
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        where = tl.where(pos < gl, gs + pos, os_ + pos - gl)
        kt = tl.load(K + kv_head + where[None, :] * skn + offs_d[:, None],
                     mask=valid[None, :] & mask_d[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        v = tl.load(V + kv_head + where[:, None] * skn + offs_d[None, :],
                    mask=valid[:, None] & mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    slot = (row * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split  # Part/Lse [rows, q_heads, SPLITS]
    tl.store(Part + slot[:, None] * DIM + offs_d[None, :], out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(Lse + slot, lse, mask=mask_g)

@triton.jit
def combine(Part, Lse, O, rows, q_start, q_len, sot, soh, DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    seq = tl.load(rows + row)
    token = tl.load(q_start + seq)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < DIM
    out_mask = offs_d < tl.where(tl.load(q_len + seq) > 0, DIM, 0)  # a padding row (no query) writes nothing
    lse = tl.load(Lse + (row * heads + head) * SPLITS + offs_s)
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # no keys at all: a padding row
    part = tl.load(Part + ((row * heads + head) * SPLITS + offs_s)[:, None] * DIM + offs_d[None, :],
                   mask=mask_d[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(O + token * sot + head * soh + offs_d, out.to(O.dtype.element_ty), mask=out_mask)

@triton.jit
def prefill(Q, K, V, O, tile_seq, tile_first, q_start, q_len,
            g_start, g_len, o_start, o_len, scale, window, sqt, sqh,
            skh, skn, sot, soh, GROUP: tl.constexpr, DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    kv_head = kvh.to(tl.int64) * skh  # 64-bit: a head's offset in a large pool passes 2**31
    seq = tl.load(tile_seq + tile)
    first = tl.load(tile_first + tile)
    qs = tl.load(q_start + seq)
    ql = tl.load(q_len + seq)
    gs = tl.load(g_start + seq)
    gl = tl.load(g_len + seq)
    os_ = tl.load(o_start + seq)
    ol = tl.load(o_len + seq)
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ql
    mask_d = offs_d < DIM
    q = tl.load(Q + (qs + offs_m)[:, None] * sqt + head * sqh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = gl + ol - ql + offs_m
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    qk_scale = scale * 1.4426950408889634
    hi = tl.minimum(gl + ol, gl + ol - ql + first + BLOCK_M)  # the last key any query here sees
    lo = 0
    if window > 0:
        lo = tl.maximum(0, gl + ol - ql + first - window + 1) // BLOCK_N * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        where = tl.where(pos < gl, gs + pos, os_ + pos - gl)
        inside = pos < hi
        kt = tl.load(K + kv_head + where[None, :] * skn + offs_d[:, None],
                     mask=inside[None, :] & mask_d[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        visible = inside[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (q_pos[:, None] - pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        v = tl.load(V + kv_head + where[:, None] * skn + offs_d[None, :],
                    mask=inside[:, None] & mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + (qs + offs_m)[:, None] * sot + head * soh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])
