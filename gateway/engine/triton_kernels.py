"""The Triton kernels of the owned models on CUDA (engine/attention.py says what attention computes,
engine/models/layers.py what the elementwise kernels replace). A module of its own because Triton is
optional: it is imported only when a kernel is first launched. With `TRITON_INTERPRET=1` set
before Triton is imported (the test suite does so on a machine without a GPU) they run on CPU
tensors through Triton's interpreter.

A decoder layer's decode step is eight launches (four matrix products and these four): `rms_norm`
(with the residual add), `decode` (q/k norm, RoPE, the KV write and split-KV attention with its
combine), `rms_norm` again, `silu_mul`. Prompt chunks add `rope_kv` and `prefill`.

`F32_DOT`: Triton 3.9's interpreter runs `tl.dot` on bfloat16 operands as integers, so under the
interpreter (only) the operands are converted to float32 first, which is what the GPU's MMA does.
"""

# ruff: noqa: E741  (kernel arguments named as in Triton's tutorials: Q, K, V, O)
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm(X, R, W, Y, eps, T, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, ADD: tl.constexpr):
    """`Y = RMSNorm(X)`, or with `ADD`: `R += X` (in place) then `Y = RMSNorm(R)`; `ROWS` rows a
    program. Rounded as transformers' RMSNorm: the sum in the model's dtype, the weight times the
    normalized row rounded to it."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    mask = (rows < T)[:, None] & (offs < N)[None, :]
    at = rows[:, None] * N + offs[None, :]
    x = tl.load(X + at, mask=mask, other=0.0)
    if ADD:  # the sum rounded once to the model's dtype (in float32: the interpreter's bf16 math is wrong)
        x = (x.to(tl.float32) + tl.load(R + at, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(R + at, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / N + eps)
    w = tl.load(W + offs, mask=offs < N, other=0.0).to(tl.float32)
    y = (h * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(Y + at, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul(GU, Y, T, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """`Y = silu(gate) * up` for `GU = [gate | up]` rows of `2N`; grid (T / ROWS, N / BLOCK)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < T)[:, None] & (offs < N)[None, :]
    at = rows[:, None] * 2 * N + offs[None, :]
    gate = tl.load(GU + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + at + N, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + rows[:, None] * N + offs[None, :], (act * up).to(Y.dtype.element_ty), mask=mask)


# The turn of q and k (q/k norm, then RoPE) is written out in both kernels that do it: a call of a
# jitted helper costs the interpreter milliseconds (it patches `triton.language` again per call).
# In both: `x` the heads `[R, BLOCK_D]` and `xs` the same with their halves swapped (rotate_half
# without the sign), normed over `DIM` when `HAS_NORM` and rotated with the tables of `angle`,
# each step rounded to the model's dtype as transformers rounds it (its tables included).


@triton.jit
def rope_kv(QKV, K, V, Norm, InvFreq, tile_seq, tile_first, q_start, q_len, g_len, o_start, o_len,
            rope_scale, eps, sqt, skh, skn, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_NORM: tl.constexpr):
    """Prompt chunks: each query head normed and rotated in place in `QKV`, each key head normed,
    rotated and written to the pool with its value; grid (tiles, q_heads + kv_heads)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seq + tile)
    first = tl.load(tile_first + tile)
    qs = tl.load(q_start + seq)
    ql = tl.load(q_len + seq)
    ol = tl.load(o_len + seq)
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = DIM // 2
    swap = tl.where(offs_d < half, offs_d + half, offs_d - half)
    mask = (offs_m < ql)[:, None] & (offs_d < DIM)[None, :]
    tokens = (qs + offs_m).to(tl.int64)
    base = QKV + tokens[:, None] * sqt + head * DIM
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0)
    dt = x.dtype
    x = x.to(tl.float32)
    xs = tl.load(base + swap[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w_at = Norm + (head >= Q_HEADS).to(tl.int32) * DIM
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / DIM + eps)
        w = tl.load(w_at + offs_d, mask=offs_d < DIM, other=0.0).to(tl.float32)
        ws = tl.load(w_at + swap, mask=offs_d < DIM, other=0.0).to(tl.float32)
        x = ((x * rstd[:, None]).to(dt).to(tl.float32) * w[None, :]).to(dt).to(tl.float32)
        xs = ((xs * rstd[:, None]).to(dt).to(tl.float32) * ws[None, :]).to(dt).to(tl.float32)
    freq = tl.load(InvFreq + offs_d % half, mask=offs_d < DIM, other=0.0)
    angle = (tl.load(g_len + seq) + ol - ql + offs_m).to(tl.float32)[:, None] * freq[None, :]
    cos = (tl.cos(angle) * rope_scale).to(dt).to(tl.float32)
    sin = (tl.sin(angle) * rope_scale).to(dt).to(tl.float32)
    x = x * cos + xs * tl.where(offs_d < half, -sin, sin)
    if head >= Q_HEADS:
        kvh = (head - Q_HEADS).to(tl.int64)
        slots = (tl.load(o_start + seq) + ol - ql + offs_m).to(tl.int64)
        where = kvh * skh + slots[:, None] * skn + offs_d[None, :]
        tl.store(K + where, x.to(K.dtype.element_ty), mask=mask)
        v = tl.load(QKV + tokens[:, None] * sqt + (Q_HEADS + KV_HEADS + kvh) * DIM + offs_d[None, :], mask=mask)
        tl.store(V + where, v, mask=mask)
    else:
        tl.store(base + offs_d[None, :], x.to(dt), mask=mask)


@triton.jit
def decode(QKV, K, V, O, Part, Lse, Count, Norm, InvFreq, rows, q_start, q_len, g_start, g_len, o_start, o_len,
           rope_scale, eps, scale, window, sqt, skh, skn, sot, soh,
           Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
           BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
           HAS_NORM: tl.constexpr, F32_DOT: tl.constexpr):
    """Decode rows: grid (rows, kv_heads, SPLITS). Each program turns its query heads and its KV
    head's new key itself (rows `[0, GROUP)` of one tile the query heads, row `GROUP` the key; the
    new key and value are used from registers, and split 0 writes them to the pool), attends over
    its split of the keys, and the last split of a (row, kv head) to finish combines all splits
    in split order (an atomic count, reset for the next layer)."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    kv_heads = tl.num_programs(1)
    kv_head = kvh.to(tl.int64) * skh  # 64-bit: a head's offset in a large pool passes 2**31
    split = tl.program_id(2)
    seq = tl.load(rows + row)
    token = tl.load(q_start + seq).to(tl.int64)
    live = tl.load(q_len + seq) > 0  # a graph's padding row (no query) writes nothing
    gs = tl.load(g_start + seq)
    gl = tl.load(g_len + seq)
    os_ = tl.load(o_start + seq)
    kv_len = gl + tl.load(o_len + seq)
    new_pos = kv_len - 1
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
    q_mask = mask_g[:, None] & mask_d[None, :]
    half: tl.constexpr = DIM // 2
    swap = tl.where(offs_d < half, offs_d + half, offs_d - half)
    is_key = offs_g == GROUP
    columns = tl.where(is_key, Q_HEADS + kvh, heads) * DIM  # the query heads, then the key head
    tile_mask = (offs_g <= GROUP)[:, None] & mask_d[None, :]
    base = QKV + token * sqt + columns[:, None]
    x = tl.load(base + offs_d[None, :], mask=tile_mask, other=0.0)
    dt = x.dtype
    x = x.to(tl.float32)
    xs = tl.load(base + swap[None, :], mask=tile_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w_at = Norm + is_key.to(tl.int32)[:, None] * DIM
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / DIM + eps)
        w = tl.load(w_at + offs_d[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        ws = tl.load(w_at + swap[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        x = ((x * rstd[:, None]).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xs = ((xs * rstd[:, None]).to(dt).to(tl.float32) * ws).to(dt).to(tl.float32)
    freq = tl.load(InvFreq + offs_d % half, mask=mask_d, other=0.0)
    angle = new_pos.to(tl.float32) * freq
    cos = (tl.cos(angle) * rope_scale).to(dt).to(tl.float32)
    sin = (tl.sin(angle) * rope_scale).to(dt).to(tl.float32)
    x = (x * cos[None, :] + xs * tl.where(offs_d < half, -sin, sin)[None, :]).to(dt)
    q = tl.where(mask_g[:, None], x, 0.0)
    k_new = tl.sum(tl.where(is_key[:, None], x, 0.0).to(tl.float32), 0).to(K.dtype.element_ty)
    v_new = tl.load(QKV + token * sqt + (Q_HEADS + kv_heads + kvh) * DIM + offs_d, mask=mask_d, other=0.0)
    # (a scalar condition goes into a mask through the limit: the interpreter refuses `mask & scalar`)
    writes = offs_d < tl.where(live & (split == 0), DIM, 0)
    new_at = kv_head + (os_ + new_pos - gl).to(tl.int64) * skn + offs_d
    tl.store(K + new_at, k_new, mask=writes)
    tl.store(V + new_at, v_new, mask=writes)
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
    qk_scale = scale * 1.4426950408889634
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        is_new = pos == new_pos
        where = tl.where(pos < gl, gs + pos, os_ + pos - gl).to(tl.int64)
        kt = tl.load(K + kv_head + where[None, :] * skn + offs_d[:, None],
                     mask=(valid & ~is_new)[None, :] & mask_d[:, None], other=0.0)
        kt = tl.where(is_new[None, :], k_new[:, None], kt)
        if F32_DOT:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        v = tl.load(V + kv_head + where[:, None] * skn + offs_d[None, :],
                    mask=(valid & ~is_new)[:, None] & mask_d[None, :], other=0.0)
        v = tl.where(is_new[:, None], v_new[None, :], v)
        pv = p.to(v.dtype)
        if F32_DOT:
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    first = (row * Q_HEADS + heads) * SPLITS  # Part/Lse [rows, q_heads, SPLITS]
    tl.store(Part + (first + split)[:, None] * DIM + offs_d[None, :], out, mask=q_mask)
    tl.store(Lse + first + split, lse, mask=mask_g)
    tl.debug_barrier()  # every thread's partial stored before the count releases them
    done = tl.atomic_add(Count + row * kv_heads + kvh, 1, sem="acq_rel")
    if done == SPLITS - 1:
        m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        for s in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(Lse + first + s, mask=mask_g, other=float("-inf"), cache_modifier=".cg"))
        m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all: a padding row
        total = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
        for s in tl.static_range(SPLITS):
            w = tl.math.exp2(tl.load(Lse + first + s, mask=mask_g, other=float("-inf"), cache_modifier=".cg") - m)
            part = tl.load(Part + (first + s)[:, None] * DIM + offs_d[None, :], mask=q_mask, other=0.0,
                           cache_modifier=".cg")
            acc += part * w[:, None]
            total += w
        result = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(O + token * sot + heads[:, None] * soh + offs_d[None, :], result.to(O.dtype.element_ty),
                 mask=mask_g[:, None] & (offs_d < tl.where(live, DIM, 0))[None, :])
        tl.atomic_xchg(Count + row * kv_heads + kvh, 0)


@triton.jit
def prefill(Q, K, V, O, tile_seq, tile_first, q_start, q_len,
            g_start, g_len, o_start, o_len, scale, window, sqt, sqh,
            skh, skn, sot, soh, GROUP: tl.constexpr, DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr, F32_DOT: tl.constexpr):
    """Prompt chunks (queries already turned, keys in the pool): grid (tiles, q_heads)."""
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
    tokens = (qs + offs_m).to(tl.int64)
    q = tl.load(Q + tokens[:, None] * sqt + head * sqh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
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
        where = tl.where(pos < gl, gs + pos, os_ + pos - gl).to(tl.int64)
        inside = pos < hi
        kt = tl.load(K + kv_head + where[None, :] * skn + offs_d[:, None],
                     mask=inside[None, :] & mask_d[:, None], other=0.0)
        if F32_DOT:
            kt = kt.to(tl.float32)
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
        pv = p.to(v.dtype)
        if F32_DOT:
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + tokens[:, None] * sot + head * soh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])
