"""The Triton kernels of chunk attention (FlashAttention-2 style forward, dK/dV and dQ
backward kernels); launched by `triton_launch.py`."""
from sppo_fx.chunk_attention.kernels.common import HAS_TRITON, tl, triton

# what `from ... import *` hands the launchers (and the kernel tests, via chunk_attention)
__all__ = ["_chunk_attn_fwd_kernel", "_chunk_attn_bwd_preprocess_kernel", "_chunk_attn_bwd_dkdv_kernel",
           "_chunk_attn_bwd_dq_kernel"] if HAS_TRITON else []

# ----------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _load_tile(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
        """Load a [len(rows), len(cols)] tile, zero-filling out-of-range rows/cols."""
        if CHECK_ROWS:
            if CHECK_COLS:
                t = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
            else:
                t = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            if CHECK_COLS:
                t = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
            else:
                t = tl.load(ptrs)
        return t

    @triton.jit
    def _store_tile(ptrs, val, rows, n_rows, cols, n_cols, CHECK_COLS: tl.constexpr):
        if CHECK_COLS:
            tl.store(ptrs, val, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
        else:
            tl.store(ptrs, val, mask=rows[:, None] < n_rows)

    @triton.jit
    def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """acc + a @ b.  UPCAST computes in fp32 (exact for 16-bit operands); it exists only
        because the Triton interpreter mishandles bf16 ``tl.dot`` (it multiplies the raw
        uint16 storage) and is never set on a GPU."""
        if UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _scores2(qk, rows, cols, PREFIX, qk_scale, cap_in, cap_out, slope2,
                 SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
        """Scores in the log2 domain from raw q.k: scale * q.k, or with soft-capping
        cap * tanh(scale * q.k / cap) (cap_in = scale / cap, cap_out = cap * log2 e), plus
        ALiBi's slope * (j - i) (slope2 = slope * log2 e); also tanh (for the backward)."""
        if SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without inf - inf
            t = 1.0 - 2.0 / (tl.exp(2.0 * (qk * cap_in)) + 1.0)
            s = t * cap_out
        else:
            t = qk
            s = qk * qk_scale
        if HAS_ALIBI:
            s = s + slope2 * (cols - PREFIX - rows).to(tl.float32)
        return s, t

    @triton.jit
    def _fwd_inner(
        acc, l_i, m_i, q,
        k_base, v_base, stride_kn, stride_vn,
        offs_m, offs_n, offs_d,
        lo, hi, N, PREFIX, qk_scale, cap_in, cap_out, slope2,
        HEAD_DIM: tl.constexpr, CHECK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ):
        """Online-softmax accumulation over key blocks [lo, hi)."""
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            cols = start_n + offs_n
            k = _load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :],
                           cols, N, offs_d, HEAD_DIM, MASKED, CHECK_D)
            # Scores in the log2 domain: s2 = scale * log2(e) * q.k
            s, _t = _scores2(_dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST), offs_m[:, None], cols[None, :],
                             PREFIX, qk_scale, cap_in, cap_out, slope2, SOFTCAP, HAS_ALIBI)
            if MASKED:
                visible = cols[None, :] < N
                if CAUSAL:
                    visible = visible & (cols[None, :] <= PREFIX + offs_m[:, None])
                s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :],
                           cols, N, offs_d, HEAD_DIM, MASKED, CHECK_D)
            acc = acc * alpha[:, None]
            acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _chunk_attn_fwd_kernel(
        Q, K, V, O, LSE,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        H, GROUP, C, N, PREFIX, qk_scale, SINKS, SLOPES, cap_in, cap_out,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ):
        """Grid: (cdiv(C, BLOCK_M), B * H).  One program = one query block of one head."""
        # Inductor passes Python-float kernel args as fp64 (eager Triton as fp32); fp64
        # scores would turn the loop-carried softmax state and tl.dot's accumulator fp64
        qk_scale = tl.cast(qk_scale, tl.float32)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        off_b = (pid_bh // H).to(tl.int64)
        off_h = (pid_bh % H).to(tl.int64)
        off_hk = off_h // GROUP

        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(SLOPES + off_h).to(tl.float32) * 1.4426950408889634

        q_base = Q + off_b * stride_qb + off_h * stride_qh
        k_base = K + off_b * stride_kb + off_hk * stride_kh
        v_base = V + off_b * stride_vb + off_hk * stride_vh
        q = _load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
                       offs_m, C, offs_d, HEAD_DIM, True, CHECK_D)

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINK:  # the sink starts the online softmax: a logit of weight exp(sink), value 0
            m_i = m_i * 0.0 + tl.load(SINKS + off_h).to(tl.float32) * 1.4426950408889634
            l_i = l_i + 1.0
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        if CAUSAL:
            # Keys <= PREFIX + start_m are visible to every row of the block; the block's
            # last valid row sees keys up to PREFIX + min(start_m + BLOCK_M, C) - 1.
            full_hi = (tl.minimum(PREFIX + start_m + 1, N) // BLOCK_N) * BLOCK_N
            hi = PREFIX + tl.minimum(start_m + BLOCK_M, C)
        else:
            full_hi = (N // BLOCK_N) * BLOCK_N
            hi = N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                   offs_m, offs_n, offs_d, 0, full_hi, N, PREFIX, qk_scale, cap_in, cap_out, slope2,
                                   HEAD_DIM, CHECK_D, BLOCK_N, CAUSAL, False, DOT_PRECISION, UPCAST,
                                   SOFTCAP, HAS_ALIBI)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                   offs_m, offs_n, offs_d, full_hi, hi, N, PREFIX, qk_scale, cap_in, cap_out, slope2,
                                   HEAD_DIM, CHECK_D, BLOCK_N, CAUSAL, True, DOT_PRECISION, UPCAST,
                                   SOFTCAP, HAS_ALIBI)

        # Every valid row sees at least one key, so l_i > 0 there; guard padding rows.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
        o_base = O + off_b * stride_ob + off_h * stride_oh
        _store_tile(o_base + offs_m[:, None] * stride_om + offs_d[None, :], out.to(O.dtype.element_ty),
                    offs_m, C, offs_d, HEAD_DIM, CHECK_D)
        tl.store(LSE + pid_bh.to(tl.int64) * C + offs_m, lse, mask=offs_m < C)

    @triton.jit
    def _chunk_attn_bwd_preprocess_kernel(
        O, DO, DLSE, DELTA,
        stride_ob, stride_oh, stride_om,
        stride_dob, stride_doh, stride_dom,
        H, C,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        HAS_DLSE: tl.constexpr,
    ):
        """delta = rowsum(dO * O) - dlse.  Grid: (cdiv(C, BLOCK_M), B * H)."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        off_b = (pid_bh // H).to(tl.int64)
        off_h = (pid_bh % H).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        o = _load_tile(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                       offs_m, C, offs_d, HEAD_DIM, True, CHECK_D).to(tl.float32)
        do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                        offs_m, C, offs_d, HEAD_DIM, True, CHECK_D).to(tl.float32)
        delta = tl.sum(o * do, 1)
        row = pid_bh.to(tl.int64) * C
        if HAS_DLSE:
            delta = delta - tl.load(DLSE + row + offs_m, mask=offs_m < C, other=0.0).to(tl.float32)
        tl.store(DELTA + row + offs_m, delta, mask=offs_m < C)

    @triton.jit
    def _bwd_dkdv_inner(
        dk, dv, k, v,
        q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
        cols, offs_d, lo, hi, C, N, PREFIX, qk_scale, cap_in, cap_out, slope2,
        HEAD_DIM: tl.constexpr, CHECK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ):
        """Accumulate dK, dV of one key block over query blocks [lo, hi) (transposed form)."""
        for start_m in range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            rows = start_m + tl.arange(0, BLOCK_M)
            q = _load_tile(q_base + rows[:, None] * stride_qm + offs_d[None, :],
                           rows, C, offs_d, HEAD_DIM, MASKED, CHECK_D)
            do = _load_tile(do_base + rows[:, None] * stride_dom + offs_d[None, :],
                            rows, C, offs_d, HEAD_DIM, MASKED, CHECK_D)
            if MASKED:
                lse = tl.load(lse_base + rows, mask=rows < C, other=0.0)
                delta = tl.load(delta_base + rows, mask=rows < C, other=0.0)
            else:
                lse = tl.load(lse_base + rows)
                delta = tl.load(delta_base + rows)
            qkT = _dot(k, tl.trans(q), None, DOT_PRECISION, UPCAST)  # [BLOCK_N, BLOCK_M]
            sT, tT = _scores2(qkT, rows[None, :], cols[:, None], PREFIX, qk_scale, cap_in, cap_out, slope2,
                              SOFTCAP, HAS_ALIBI)
            pT = tl.math.exp2(sT - (lse * 1.4426950408889634)[None, :])
            if MASKED:
                visible = (rows[None, :] < C) & (cols[:, None] < N)
                if CAUSAL:
                    visible = visible & (cols[:, None] <= PREFIX + rows[None, :])
                pT = tl.where(visible, pT, 0.0)
            dv = _dot(pT.to(do.dtype), do, dv, DOT_PRECISION, UPCAST)
            dpT = _dot(v, tl.trans(do), None, DOT_PRECISION, UPCAST)
            dsT = pT * (dpT - delta[None, :])
            if SOFTCAP:  # d(cap * tanh(x / cap)) = (1 - tanh^2) dx
                dsT = dsT * (1.0 - tT * tT)
            dk = _dot(dsT.to(q.dtype), q, dk, DOT_PRECISION, UPCAST)
        return dk, dv

    @triton.jit
    def _chunk_attn_bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom,
        stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn,
        H, H_KV, GROUP, C, N, PREFIX, scale, qk_scale, SLOPES, cap_in, cap_out,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ):
        """Grid: (cdiv(N, BLOCK_N), B * H_KV).  One program = one key block of one kv head,
        looping over the GROUP query heads that share it (no atomics needed)."""
        # Inductor passes Python-float kernel args as fp64 (eager Triton as fp32); fp64
        # scores would turn the loop-carried softmax state and tl.dot's accumulator fp64
        qk_scale = tl.cast(qk_scale, tl.float32)
        scale = tl.cast(scale, tl.float32)
        pid_n = tl.program_id(0)
        pid_bhk = tl.program_id(1)
        off_b = (pid_bhk // H_KV).to(tl.int64)
        off_hk = (pid_bhk % H_KV).to(tl.int64)

        start_n = pid_n * BLOCK_N
        cols = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        k = _load_tile(K + off_b * stride_kb + off_hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :],
                       cols, N, offs_d, HEAD_DIM, True, CHECK_D)
        v = _load_tile(V + off_b * stride_vb + off_hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :],
                       cols, N, offs_d, HEAD_DIM, True, CHECK_D)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

        # Query blocks [lo, mid) see this key block partially (diagonal), [mid, full_end)
        # see all of it, [full_end, C) is the ragged last query block.
        full_end = (C // BLOCK_M) * BLOCK_M
        if CAUSAL:
            lo = (tl.maximum(start_n - PREFIX, 0) // BLOCK_M) * BLOCK_M
            mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - PREFIX, 0), BLOCK_M) * BLOCK_M
        else:
            lo = start_n * 0
            mid = lo
        # A ragged (partly out-of-range) key block is masked everywhere.
        mid = tl.where(start_n + BLOCK_N > N, full_end, mid)
        mid = tl.maximum(lo, tl.minimum(mid, full_end))
        tail = tl.maximum(full_end, lo)

        for g in range(0, GROUP):
            off_h = off_hk * GROUP + g
            q_base = Q + off_b * stride_qb + off_h * stride_qh
            do_base = DO + off_b * stride_dob + off_h * stride_doh
            row0 = (off_b * H + off_h) * C
            slope2 = 0.0
            if HAS_ALIBI:
                slope2 = tl.load(SLOPES + off_h).to(tl.float32) * 1.4426950408889634
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row0, DELTA + row0,
                                     stride_qm, stride_dom, cols, offs_d, lo, mid, C, N, PREFIX,
                                     qk_scale, cap_in, cap_out, slope2, HEAD_DIM, CHECK_D, BLOCK_M, CAUSAL, True,
                                     DOT_PRECISION, UPCAST, SOFTCAP, HAS_ALIBI)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row0, DELTA + row0,
                                     stride_qm, stride_dom, cols, offs_d, mid, full_end, C, N, PREFIX,
                                     qk_scale, cap_in, cap_out, slope2, HEAD_DIM, CHECK_D, BLOCK_M, CAUSAL, False,
                                     DOT_PRECISION, UPCAST, SOFTCAP, HAS_ALIBI)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, LSE + row0, DELTA + row0,
                                     stride_qm, stride_dom, cols, offs_d, tail, C, C, N, PREFIX,
                                     qk_scale, cap_in, cap_out, slope2, HEAD_DIM, CHECK_D, BLOCK_M, CAUSAL, True,
                                     DOT_PRECISION, UPCAST, SOFTCAP, HAS_ALIBI)

        dk = dk * scale
        _store_tile(DK + off_b * stride_dkb + off_hk * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :],
                    dk.to(DK.dtype.element_ty), cols, N, offs_d, HEAD_DIM, CHECK_D)
        _store_tile(DV + off_b * stride_dvb + off_hk * stride_dvh + cols[:, None] * stride_dvn + offs_d[None, :],
                    dv.to(DV.dtype.element_ty), cols, N, offs_d, HEAD_DIM, CHECK_D)

    @triton.jit
    def _bwd_dq_inner(
        dq, q, do, lse2, delta,
        k_base, v_base, stride_kn, stride_vn,
        offs_m, offs_n, offs_d, lo, hi, N, PREFIX, qk_scale, cap_in, cap_out, slope2,
        HEAD_DIM: tl.constexpr, CHECK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ):
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            cols = start_n + offs_n
            k = _load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :],
                           cols, N, offs_d, HEAD_DIM, MASKED, CHECK_D)
            v = _load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :],
                           cols, N, offs_d, HEAD_DIM, MASKED, CHECK_D)
            s, t = _scores2(_dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST), offs_m[:, None], cols[None, :],
                            PREFIX, qk_scale, cap_in, cap_out, slope2, SOFTCAP, HAS_ALIBI)
            p = tl.math.exp2(s - lse2[:, None])
            if MASKED:
                visible = cols[None, :] < N
                if CAUSAL:
                    visible = visible & (cols[None, :] <= PREFIX + offs_m[:, None])
                p = tl.where(visible, p, 0.0)
            dp = _dot(do, tl.trans(v), None, DOT_PRECISION, UPCAST)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * (1.0 - t * t)
            dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION, UPCAST)
        return dq

    @triton.jit
    def _chunk_attn_bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom,
        stride_dqb, stride_dqh, stride_dqm,
        H, GROUP, C, N, PREFIX, scale, qk_scale, SLOPES, cap_in, cap_out,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ):
        """Grid: (cdiv(C, BLOCK_M), B * H).  One program = one query block of one head."""
        # Inductor passes Python-float kernel args as fp64 (eager Triton as fp32); fp64
        # scores would turn the loop-carried softmax state and tl.dot's accumulator fp64
        qk_scale = tl.cast(qk_scale, tl.float32)
        scale = tl.cast(scale, tl.float32)
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        off_b = (pid_bh // H).to(tl.int64)
        off_h = (pid_bh % H).to(tl.int64)
        off_hk = off_h // GROUP

        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_tile(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                       offs_m, C, offs_d, HEAD_DIM, True, CHECK_D)
        do = _load_tile(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                        offs_m, C, offs_d, HEAD_DIM, True, CHECK_D)
        row0 = pid_bh.to(tl.int64) * C
        lse2 = tl.load(LSE + row0 + offs_m, mask=offs_m < C, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + row0 + offs_m, mask=offs_m < C, other=0.0)
        k_base = K + off_b * stride_kb + off_hk * stride_kh
        v_base = V + off_b * stride_vb + off_hk * stride_vh
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(SLOPES + off_h).to(tl.float32) * 1.4426950408889634

        if CAUSAL:
            full_hi = (tl.minimum(PREFIX + start_m + 1, N) // BLOCK_N) * BLOCK_N
            hi = PREFIX + tl.minimum(start_m + BLOCK_M, C)
        else:
            full_hi = (N // BLOCK_N) * BLOCK_N
            hi = N
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                           offs_m, offs_n, offs_d, 0, full_hi, N, PREFIX, qk_scale, cap_in, cap_out, slope2,
                           HEAD_DIM, CHECK_D, BLOCK_N, CAUSAL, False, DOT_PRECISION, UPCAST, SOFTCAP, HAS_ALIBI)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn,
                           offs_m, offs_n, offs_d, full_hi, hi, N, PREFIX, qk_scale, cap_in, cap_out, slope2,
                           HEAD_DIM, CHECK_D, BLOCK_N, CAUSAL, True, DOT_PRECISION, UPCAST, SOFTCAP, HAS_ALIBI)
        dq = dq * scale
        _store_tile(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
                    dq.to(DQ.dtype.element_ty), offs_m, C, offs_d, HEAD_DIM, CHECK_D)
