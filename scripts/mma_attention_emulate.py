"""Float64 emulation of the fragment algebra of ``bodies._mma_softmax_chunk`` (split-KV attention on the tensor
cores, ``generate(plan, mma_attention=True)``; heads of 256 dims: ``mma_wide=True``), on a CPU, against plain
softmax attention.

    python3 scripts/mma_attention_emulate.py            # a table of cases: heads, head_dim, keys, max |error|

Each lane's registers are built exactly as the kernel builds them (which K/V rows and 16-byte vectors lane
(g, t) loads, which values go to which A / B fragment slot, the online softmax, the rescale shuffles, the
partial written to ``s_part`` and the warps' merge), and ``mma.sync.m16n8k16`` is applied with the PTX ISA's
fragment layouts. A change to the kernel's mapping should be made here first: an error above ~1e-12 means the
mapping is wrong, before any device time is spent. It checks the algebra, not CuTe DSL's semantics (the GPU test
``test_mma_attention_matches_the_lane_group_loop_to_bf16_rounding`` does), and it does not round to bf16.
"""

from __future__ import annotations

import argparse

import numpy as np

ATT_NEG = -1.0e30
KEYS = 16  # MMA_ATT_KEYS: keys per warp and step


def mma(a_lanes, b_lanes, c_lanes):
    """D = A B + C of one m16n8k16 over the 32 lanes' fragments (PTX ISA layouts for .bf16, row.col)."""
    a_matrix, b_matrix, c_matrix = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a = a_lanes[lane]
        a_matrix[g, 2 * t:2 * t + 2], a_matrix[g + 8, 2 * t:2 * t + 2] = a[0:2], a[2:4]
        a_matrix[g, 2 * t + 8:2 * t + 10], a_matrix[g + 8, 2 * t + 8:2 * t + 10] = a[4:6], a[6:8]
        b_matrix[[2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9], g] = b_lanes[lane]
        c_matrix[g, 2 * t:2 * t + 2], c_matrix[g + 8, 2 * t:2 * t + 2] = c_lanes[lane][0:2], c_lanes[lane][2:4]
    d = a_matrix @ b_matrix + c_matrix
    return [[d[lane // 4, 2 * (lane % 4)], d[lane // 4, 2 * (lane % 4) + 1],
             d[lane // 4 + 8, 2 * (lane % 4)], d[lane // 4 + 8, 2 * (lane % 4) + 1]] for lane in range(32)]


def warp_partial(q, keys, values, first, end, warp, warps):
    """One warp's (accumulator [head_dim, heads], max [heads], sum [heads]) as the kernel leaves it in s_part."""
    heads, head_dim = q.shape
    kblocks, vblocks = head_dim // 32, head_dim // 64
    top, total = [ATT_NEG] * 32, [0.0] * 32
    out = [[[0.0] * 4 for _ in range(4 * vblocks)] for _ in range(32)]
    for kb in range(first + warp * KEYS, end, warps * KEYS):
        scores, new_top = [[0.0] * 4 for _ in range(32)], list(top)
        for tile in range(2):
            acc = [[0.0] * 4 for _ in range(32)]
            for c in range(kblocks):
                for m in range(2):
                    a_lanes, b_lanes = [], []
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        qv = q[min(g, heads - 1), 32 * c + 8 * t:32 * c + 8 * t + 8] * (1.0 if g < heads else 0.0)
                        kv = keys[min(kb + tile * 8 + g, end - 1), 32 * c + 8 * t:32 * c + 8 * t + 8]
                        a_lanes.append([qv[4 * m], qv[4 * m + 1], 0, 0, qv[4 * m + 2], qv[4 * m + 3], 0, 0])
                        b_lanes.append(list(kv[4 * m:4 * m + 4]))
                    acc = mma(a_lanes, b_lanes, acc)
            for lane in range(32):
                t = lane % 4
                for e in range(2):
                    value = acc[lane][e] if kb + tile * 8 + 2 * t + e < end else ATT_NEG
                    scores[lane][tile * 2 + e] = value
                    new_top[lane] = max(new_top[lane], value)
        for offset in (1, 2):
            new_top = [max(new_top[lane], new_top[lane ^ offset]) for lane in range(32)]
        correction = [np.exp(top[lane] - new_top[lane]) for lane in range(32)]
        probs = []
        for lane in range(32):
            t = lane % 4
            row = []
            for i in range(4):
                valid = kb + (i // 2) * 8 + 2 * t + i % 2 < end
                row.append(np.exp(scores[lane][i] - new_top[lane]) if valid else 0.0)
            total[lane] = total[lane] * correction[lane] + sum(row)
            probs.append(row)
        top = new_top
        for c in range(vblocks):
            for j in range(4):
                a_lanes, c_lanes = [], []
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    a = [0.0] * 8
                    for r in range(4):  # keys 2t, 2t + 1, 8 + 2t, 9 + 2t
                        vv = values[min(kb + (r // 2) * 8 + 2 * t + r % 2, end - 1), 64 * c + 8 * g:64 * c + 8 * g + 8]
                        a[(r % 2) + 4 * (r // 2)], a[(r % 2) + 4 * (r // 2) + 2] = vv[2 * j], vv[2 * j + 1]
                    low, high = correction[8 * t], correction[8 * t + 4]
                    o = out[lane][c * 4 + j]
                    a_lanes.append(a)
                    c_lanes.append([o[0] * low, o[1] * high, o[2] * low, o[3] * high])
                result = mma(a_lanes, probs, c_lanes)
                for lane in range(32):
                    out[lane][c * 4 + j] = result[lane]
    for offset in (1, 2):
        total = [total[lane] + total[lane ^ offset] for lane in range(32)]
    acc, maxima, sums = np.zeros((head_dim, heads)), np.full(heads, ATT_NEG), np.zeros(heads)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        if t == 0 and g < heads:
            maxima[g], sums[g] = top[lane], total[lane]
        for c in range(vblocks):
            for j in range(4):
                o, d = out[lane][c * 4 + j], 64 * c + 8 * g + 2 * j
                for e in range(2):
                    if 2 * t + e < heads:
                        acc[d, 2 * t + e], acc[d + 1, 2 * t + e] = o[e], o[e + 2]
    return acc, maxima, sums


def emulate(q, keys, values, first, end, warps=8):
    """The item's normalised output [heads, head_dim]: every warp's partial, merged as ``_split_kv_items`` does."""
    parts = [warp_partial(q, keys, values, first, end, w, warps) for w in range(warps)]
    top = np.max([m for _, m, _ in parts], axis=0)
    weights = [np.exp(m - top) for _, m, _ in parts]
    total = sum(s * w for (_, _, s), w in zip(parts, weights))
    return (sum(a * w for (a, _, _), w in zip(parts, weights)) / total).T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print("| heads | head_dim | keys [first, end) | max abs error vs softmax attention |\n|---|---|---|---|")
    worst = 0.0
    for heads, head_dim, first, end in [(7, 64, 0, 1), (7, 64, 0, 17), (3, 64, 5, 300), (2, 128, 0, 129),
                                        (4, 64, 100, 613), (8, 128, 3, 40),
                                        (8, 256, 0, 257), (2, 256, 7, 90)]:  # 256: an mma_wide build (Gemma)
        keys, values = rng.standard_normal((end + 8, head_dim)), rng.standard_normal((end + 8, head_dim))
        q = rng.standard_normal((heads, head_dim)) * 0.3
        scores = q @ keys[first:end].T
        p = np.exp(scores - scores.max(1, keepdims=True))
        expected = (p / p.sum(1, keepdims=True)) @ values[first:end]
        error = float(np.abs(emulate(q, keys, values, first, end) - expected).max())
        worst = max(worst, error)
        print(f"| {heads} | {head_dim} | [{first}, {end}) | {error:.1e} |")
    raise SystemExit(0 if worst < 1e-12 else 1)


if __name__ == "__main__":
    main()
