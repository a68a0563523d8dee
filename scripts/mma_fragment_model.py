"""Lane-exact numpy model of backward_channel_first_mma_kernel (cuda/backward_vector.cuh).

Simulates the 32 lanes' m16n8k16 fragments, shuffles, movmatrix transposes, the column of ones
(bias and db) and the blocks of 128 times of one channel-first item as the kernel takes them
(words past the loaded times read as 0, dw/db only of the item's own blocks), and compares
pre-activations, dx, dw and db with a direct float64 computation over rows cut into chunks.
The kernel's order of loads (its register ring, pairs of blocks, the last blocks) does not change
these values and is not modelled. Index bugs show as errors far above bfloat16 rounding (dx: the
float32 value before its rounding, and the rounded one).
Run: python scripts/mma_fragment_model.py
"""
import numpy as np

LANES = 32
BLOCK = 128


def bf16(v):
    """float32 -> bfloat16 values (round to nearest even), returned as float32."""
    bits = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def mma(a, b, c):
    """m16n8k16: a[lane] = 4 words of 2 values, b[lane] = 2 words, c[lane] = 4 floats."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(LANES):
        g, q = lane >> 2, lane & 3
        for r, (row, col) in enumerate([(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]):
            A[row, col], A[row, col + 1] = a[lane][r]
        for r, row in enumerate([2 * q, 2 * q + 8]):
            B[row, g], B[row + 1, g] = b[lane][r]
    D = A @ B
    out = []
    for lane in range(LANES):
        g, q = lane >> 2, lane & 3
        out.append([c[lane][0] + D[g, 2 * q], c[lane][1] + D[g, 2 * q + 1],
                    c[lane][2] + D[g + 8, 2 * q], c[lane][3] + D[g + 8, 2 * q + 1]])
    return out


def movmatrix_trans(words):
    """movmatrix.m8n8.trans.b16: lane holds row g, cols 2q, 2q+1 before and after."""
    M = np.zeros((8, 8))
    for lane in range(LANES):
        g, q = lane >> 2, lane & 3
        M[g, 2 * q], M[g, 2 * q + 1] = words[lane]
    T = M.T
    return [(T[lane >> 2, 2 * (lane & 3)], T[lane >> 2, 2 * (lane & 3) + 1]) for lane in range(LANES)]


def shfl(values, src):
    return [values[src(lane) & 31] for lane in range(LANES)]


def tap_fragment(w, lag_of, row_0=None):
    """B fragment (2 words) per lane of B[k][n] = w[P - lag_of(k, n)] (0 outside the taps), row 0
    row_0 where given."""
    P = len(w) - 1

    def tap(k, n):
        if k == 0 and row_0 is not None:
            return row_0
        lag = lag_of(k, n)
        return w[P - lag] if 0 <= lag <= P else 0.0

    return [[(tap(2 * (l & 3) + 8 * r, l >> 2), tap(2 * (l & 3) + 8 * r + 1, l >> 2)) for r in range(2)]
            for l in range(LANES)]


def split(frag):
    hi = [[tuple(bf16(np.array(p, np.float32))) for p in f] for f in frag]
    lo = [[tuple(bf16(np.array(p, np.float32) - np.array(h, np.float32))) for p, h in zip(f, fh)]
          for f, fh in zip(frag, hi)]
    return hi, lo


def item(x, dy, w, bias, c0, c1, silu):
    """One item: dx (float32, before its rounding to bfloat16) on [c0, c1), the partial sums dw[0..K-1], db over [c0, c1); x, dy one row."""
    L = len(x)
    K = len(w)
    words = lambda row, w0: (row[2 * w0], row[2 * w0 + 1]) if 2 * w0 < L else (0.0, 0.0)
    load_end = min(L, c1 + BLOCK)
    lw = lambda row, w0: words(row, w0) if 2 * w0 < load_end else (0.0, 0.0)
    pre_hi, pre_lo = split(tap_fragment(w, lambda k, n: n + 8 - k, bias))
    dx_hi, dx_lo = split(tap_fragment(w, lambda k, n: k - n))
    carry = [lw(x, c0 // 2 - 4 + l) if c0 > 0 and l < 4 else (0.0, 0.0) for l in range(LANES)]
    dw_acc = [[0.0] * 4 for _ in range(LANES)]
    pres = {}

    def delta(base, carry):
        xw = [(lw(x, base // 2 + l), lw(x, base // 2 + l + 32)) for l in range(LANES)]
        dyw = [(lw(dy, base // 2 + l), lw(dy, base // 2 + l + 32)) for l in range(LANES)]
        u0 = shfl([v[0] for v in xw], lambda l: l - 4)
        u1 = shfl([v[1] for v in xw], lambda l: l - 4)
        a = [[u0[l] if l >= 4 else carry[l], u0[l] if l < 4 else u1[l], xw[l][0], xw[l][1]]
             for l in range(LANES)]
        # column 0 of A (lanes q = 0, the low halves of a0 and a1) holds ones: bias and db
        a = [[(1.0, f[1]) if l % 4 == 0 and r < 2 else f for r, f in enumerate(fa)]
             for l, fa in enumerate(a)]
        acc = mma(a, pre_hi, [[0.0] * 4] * LANES)
        acc = mma(a, pre_lo, acc)
        d = []
        for l in range(LANES):
            z = np.array(acc[l], np.float32)
            g = np.array(dyw[l][0] + dyw[l][1], np.float32)
            s = 1.0 / (1.0 + np.exp(-z.astype(np.float64)))
            d.append(list(g * (s * (1 + z * (1 - s))) if silu else g))
            for i, t in enumerate([base + 2 * l, base + 2 * l + 1, base + 64 + 2 * l, base + 65 + 2 * l]):
                pres[t] = acc[l][i]
        return a, d, u1

    def pack(d):
        hi = [((bf16(v[0]), bf16(v[1])), (bf16(v[2]), bf16(v[3]))) for v in d]
        lo = [((bf16(np.float32(v[0]) - h[0][0]), bf16(np.float32(v[1]) - h[0][1])),
               (bf16(np.float32(v[2]) - h[1][0]), bf16(np.float32(v[3]) - h[1][1])))
              for v, h in zip(d, hi)]
        return hi, lo

    def dw_block(a, packed):
        at = [movmatrix_trans([f[r] for f in a]) for r in (0, 2, 1, 3)]
        at = [[at[r][l] for r in range(4)] for l in range(LANES)]
        for half in packed:
            bt = [movmatrix_trans([v[r] for v in half]) for r in range(2)]
            bt = [[bt[r][l] for r in range(2)] for l in range(LANES)]
            acc = mma(at, bt, dw_acc)
            dw_acc[:] = acc

    def dx_block(base, cur, nxt):
        acc = [[0.0] * 4] * LANES
        frags = []
        for c, n in zip(cur, nxt):
            s0 = shfl([v[0] for v in c], lambda l: l + 4)
            s1 = shfl([v[1] for v in c], lambda l: l + 4)
            n0 = shfl([v[0] for v in n], lambda l: l + 4)
            frags.append([[c[l][0], c[l][1], s0[l] if l < 28 else s1[l], s1[l] if l < 28 else n0[l]]
                          for l in range(LANES)])
        acc = mma(frags[0], dx_hi, acc)
        acc = mma(frags[0], dx_lo, acc)
        acc = mma(frags[1], dx_hi, acc)
        out = {}
        for l in range(LANES):
            for i, t in enumerate([base + 2 * l, base + 2 * l + 1, base + 64 + 2 * l, base + 65 + 2 * l]):
                if t < L:
                    out[t] = acc[l][i]
        return out

    blocks = (c1 - c0 + BLOCK - 1) // BLOCK
    a, d, carry = delta(c0, carry)
    cur = pack(d)
    dw_block(a, cur)
    dx = {}
    zero = [((0.0, 0.0), (0.0, 0.0))] * LANES
    for n in range(blocks):
        base = c0 + n * BLOCK
        if base + BLOCK < load_end:
            a, d, carry = delta(base + BLOCK, carry)
            nxt = pack(d)
            if n + 1 < blocks:
                dw_block(a, nxt)
        else:
            nxt = (zero, zero)
        dx.update(dx_block(base, cur, nxt))
        cur = nxt
    # the partial sums: lane l's accumulator entries of lag n + 8 - k, tap P - lag
    P = K - 1
    dw = np.zeros(K)
    db = 0.0
    for l in range(LANES):
        g, q = l >> 2, l & 3
        for i, (k, n) in enumerate([(g, 2 * q), (g, 2 * q + 1), (g + 8, 2 * q), (g + 8, 2 * q + 1)]):
            lag = n + 8 - k
            if 0 <= lag <= P:
                dw[P - lag] += dw_acc[l][i]
            if k == 0:  # the row of ones: dpre summed
                db += dw_acc[l][i]
    return dx, dw, db, pres


def reference(x, dy, w, bias, silu):
    L, K = len(x), len(w)
    P = K - 1
    xp = np.concatenate([np.zeros(P), x])
    pre = np.array([bias + sum(w[k] * xp[t + k] for k in range(K)) for t in range(L)])
    s = 1 / (1 + np.exp(-pre))
    dpre = dy * (s * (1 + pre * (1 - s))) if silu else dy.copy()
    dpad = np.concatenate([dpre, np.zeros(P)])
    dx = np.array([sum(w[k] * dpad[t + P - k] for k in range(K)) for t in range(L)])
    dw = np.array([sum(dpre[t] * xp[t + k] for t in range(L)) for k in range(K)])
    return pre, dx, dw, dpre.sum()


def rel(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def main():
    rng = np.random.default_rng(0)
    worst = 0.0
    for K in (2, 5, 7, 8):
        for L, chunk, silu in [(264, 128, True), (1000, 256, True), (1000, 1024, False), (520, 384, True)]:
            x = bf16(rng.standard_normal(L).astype(np.float32)).astype(np.float64)
            dy = bf16(rng.standard_normal(L).astype(np.float32)).astype(np.float64)
            w = rng.standard_normal(K).astype(np.float32).astype(np.float64) * 0.5
            bias = float(np.float32(rng.standard_normal()))
            pre_ref, dx_ref, dw_ref, db_ref = reference(x, dy, w, bias, silu)
            dx = np.zeros(L)
            dw = np.zeros(K)
            db = 0.0
            pre = np.zeros(L)
            for c0 in range(0, L, chunk):
                got_dx, got_dw, got_db, got_pre = item(x, dy, w, bias, c0, min(L, c0 + chunk), silu)
                for t, v in got_dx.items():
                    if c0 <= t < c0 + chunk:
                        dx[t] = v
                for t, v in got_pre.items():
                    if c0 <= t < min(L, c0 + chunk):
                        pre[t] = v
                dw += got_dw
                db += got_db
            errs = dict(pre=rel(pre, pre_ref), dx_f32=rel(dx, dx_ref),
                        dx=rel(bf16(dx.astype(np.float32)), dx_ref), dw=rel(dw, dw_ref),
                        db=abs(db - db_ref) / abs(db_ref))
            worst = max(worst, *errs.values())
            print(f"K={K} L={L} chunk={chunk} silu={silu}: " +
                  " ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    print(f"worst relative error {worst:.2e} (bf16 tolerance 1e-2)")
    assert worst < 1e-2


if __name__ == "__main__":
    main()
