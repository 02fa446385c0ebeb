// SeqMask's hoisted tile tests (full_keys / full_rows, used by the sm90 kernels once per tile)
// against tile_full, tile_full against visible() element by element, and keys_from (the
// per-row interval of the kernels' element-wise masks) against visible(), over random masks
// (lengths, offsets, causal in both alignments, windows), and tile_mask (the backward's 32-bit
// element-wise mask) against visible(). Built and run by tests/test_mask_cpp.py.
#include <cstdio>
#include <random>

#include "common/mask.h"

using jax_flash::SeqMask;

int main() {
  std::mt19937 rng(1234);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  long checked = 0, failures = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    SeqMask m;
    m.q_len = pick(0, 40);
    m.kv_len = pick(0, 40);
    m.offset = pick(-30, 30);
    m.left = pick(0, 3) == 0 ? -1 : pick(0, 25);
    m.right = pick(0, 3) == 0 ? -1 : pick(0, 25);
    int const rows = 48, keys = 48;  // beyond both lengths: padded tiles too
    for (int i = 0; i < rows; ++i) {
      for (int k0 = -3; k0 < keys; k0 += pick(1, 9)) {
        int lo, hi;
        m.keys_from(i, k0, &lo, &hi);
        for (int d = 0; k0 + d < keys + 2; ++d) {
          bool const by_interval = lo <= d && d < hi;
          bool const brute = k0 + d >= 0 && m.visible(i, k0 + d);
          ++checked;
          if (by_interval != brute && ++failures <= 10)
            std::printf("keys_from mismatch: q_len %d kv_len %d offset %lld left %d right %d row %d k0 %d d %d: "
                        "interval [%d,%d) brute %d\n",
                        m.q_len, m.kv_len, (long long)m.offset, m.left, m.right, i, k0, d, lo, hi, brute);
        }
      }
    }
    // tile_mask: every (row, key) of tiles at random origins, padded past both lengths.
    for (int t = 0; t < 4; ++t) {
      int const row0 = pick(0, rows), key0 = pick(0, keys);
      jax_flash::TileMask const tm = m.tile_mask(row0, key0);
      int const c0 = pick(0, 8), d0 = pick(0, 8);  // a thread's first element
      jax_flash::TileMask const shifted = tm.from(c0, d0);
      for (int c = 0; c < 24; ++c) {
        for (int d = 0; d < 24; ++d) {
          bool const brute = m.visible(row0 + c, key0 + d);
          ++checked;
          if (c >= c0 && d >= d0 && shifted.visible(c - c0, d - d0) != brute && ++failures <= 10)
            std::printf("TileMask::from mismatch at c %d d %d (c0 %d d0 %d)\n", c, d, c0, d0);
          if (tm.visible(c, d) != brute && ++failures <= 10)
            std::printf("tile_mask mismatch: q_len %d kv_len %d offset %lld left %d right %d origin (%d,%d) c %d d %d: "
                        "tile %d brute %d\n",
                        m.q_len, m.kv_len, (long long)m.offset, m.left, m.right, row0, key0, c, d, tm.visible(c, d),
                        brute);
        }
      }
    }
    for (int r0 = 0; r0 < rows; r0 += pick(1, 5)) {
      for (int r1 = r0 + 1; r1 <= rows; r1 += pick(1, 7)) {
        int klo, khi;
        m.full_keys(r0, r1, &klo, &khi);
        for (int k0 = 0; k0 < keys; k0 += pick(1, 5)) {
          for (int k1 = k0 + 1; k1 <= keys; k1 += pick(1, 7)) {
            bool brute = true;
            for (int i = r0; i < r1 && brute; ++i)
              for (int j = k0; j < k1 && brute; ++j) brute = m.visible(i, j);
            bool const full = m.tile_full(r0, r1, k0, k1);
            int rlo, rhi;
            m.full_rows(k0, k1, &rlo, &rhi);
            bool const by_keys = klo <= k0 && k1 <= khi;
            bool const by_rows = rlo <= r0 && r1 <= rhi;
            ++checked;
            if (full != brute || by_keys != full || by_rows != full) {
              if (++failures <= 10)
                std::printf("mismatch: q_len %d kv_len %d offset %lld left %d right %d rows [%d,%d) keys [%d,%d): "
                            "brute %d tile_full %d full_keys %d full_rows %d\n",
                            m.q_len, m.kv_len, (long long)m.offset, m.left, m.right, r0, r1, k0, k1, brute, full,
                            by_keys, by_rows);
            }
          }
        }
      }
    }
  }
  std::printf("%ld tiles checked, %ld mismatches\n", checked, failures);
  return failures == 0 && checked > 100000 ? 0 : 1;
}
