// Which optional inputs the Hopper kernels take (flash_params.h): the rules the CUDA handlers
// route by, kernel='auto'. Built and run by tests/test_mask_cpp.py.
#include <cstdio>
#include <initializer_list>

#include "common/flash_params.h"

using namespace jax_flash;

static int failures = 0;
static void expect(bool got, bool want, const char* what) {
  if (got != want) {
    std::printf("FAIL %s: got %d, want %d\n", what, got, want);
    ++failures;
  }
}

int main() {
  static int32_t ids[4], counter[16];
  alignas(16) static uint8_t mask[32];
  alignas(16) static float bias[4];
  static uint32_t keys[2];
  auto fwd = [](int head_dim) {
    FlashFwdParams p;
    p.head_dim = head_dim;
    p.scale = 0.125f;
    p.tile_counter = counter;
    return p;
  };
  for (int h : {32, 64, 128, 256}) {
    FlashFwdParams p = fwd(h);
    expect(hopper_fwd_preferred(p), true, "plain call");
    p = fwd(h), p.q_segment_ids = ids, p.kv_segment_ids = ids;
    expect(hopper_fwd_preferred(p), true, "segment ids");
    p.tile_counter = nullptr;
    expect(hopper_fwd_takes_extras(p), false, "segment ids without their workspace");
    p = fwd(h), p.mask = mask;
    expect(hopper_fwd_preferred(p), true, "mask");
    p = fwd(h), p.bias = bias;
    expect(hopper_fwd_takes_extras(p), true, "bias: the Hopper forward can run it");
    // ... but the portable forward is faster for it at head dims <= 64 when the Hopper forward
    // would load it element-wise (session 16; this bias is broadcast over rows and keys).
    expect(hopper_fwd_preferred(p), h > 64, "bias: where it runs");
    p.mask = mask;
    expect(hopper_fwd_preferred(p), h > 64, "bias and mask");
    // Bias / mask tiles TMA can copy (keys contiguous, rows of 16-byte multiples, 16-byte base):
    // the Hopper forward stages them in smem at head dims <= 128, and takes a bias at <= 64 too.
    p = fwd(h), p.bias = bias, p.bias_row_stride = 64, p.bias_col_stride = 1, p.bias_head_stride = 64 * 300;
    expect(dense_tiles_by_tma(p), h <= 128, "bias f32, rows of 256 B");
    expect(hopper_fwd_preferred(p), true, "bias by TMA: where it runs");
    p.bias_row_stride = 66;
    expect(dense_tiles_by_tma(p), false, "bias f32, rows of 264 B");
    p.bias_dtype = DType::kBFloat16, p.bias_row_stride = 72;
    expect(dense_tiles_by_tma(p), h <= 128, "bias bf16, rows of 144 B");
    p.bias_head_stride = 0, p.bias_batch_stride = 0;
    expect(dense_tiles_by_tma(p), h <= 128, "bias broadcast over heads and batch");
    p.bias_row_stride = 0;
    expect(dense_tiles_by_tma(p), false, "bias broadcast over rows");
    p.bias_row_stride = 72, p.bias_col_stride = 0;
    expect(dense_tiles_by_tma(p), false, "bias broadcast over keys");
    p = fwd(h), p.mask = mask, p.mask_row_stride = 528, p.mask_col_stride = 1;
    expect(dense_tiles_by_tma(p), h <= 128, "mask, rows of 528 B");
    p.mask = mask + 1;
    expect(dense_tiles_by_tma(p), false, "mask, base not 16-byte aligned");
    p.mask = mask, p.mask_row_stride = 510;
    expect(dense_tiles_by_tma(p), false, "mask, rows of 510 B");
    p.mask_row_stride = 528, p.bias = bias;  // both must be copyable (this bias: strides 0)
    expect(dense_tiles_by_tma(p), false, "mask by TMA, bias not");
    // The backward's tiles (its 128 kernel, 72..128): a WG's 16 KB stage holds a float32 bias, or
    // a 16-bit bias and a mask.
    FlashBwdParams g;
    g.head_dim = h;
    g.mask = mask, g.mask_row_stride = 528, g.mask_col_stride = 1;
    expect(dense_bwd_tiles_by_tma(g), h == 128, "bwd tiles: mask");
    g.bias = bias, g.bias_row_stride = 64, g.bias_col_stride = 1;
    expect(dense_bwd_tiles_by_tma(g), false, "bwd tiles: float32 bias + mask");
    g.bias_dtype = DType::kBFloat16;
    expect(dense_bwd_tiles_by_tma(g), h == 128, "bwd tiles: bf16 bias + mask");
    g.mask = nullptr, g.bias_dtype = DType::kFloat32;
    expect(dense_bwd_tiles_by_tma(g), h == 128, "bwd tiles: float32 bias");
    g.head_dim = 72;
    expect(dense_bwd_tiles_by_tma(g), true, "bwd tiles: head dim 72 (the 128 kernel)");
    // The Hopper forward adds bias / scale to the unscaled logits: no bias with scale 0 there.
    p = fwd(h), p.bias = bias, p.scale = 0.f;
    expect(hopper_fwd_takes_extras(p), false, "bias with scale 0");
    p.softcap = 5.f;  // with softcap the bias is added in units of 1 / softcap
    expect(hopper_fwd_takes_extras(p), true, "bias with scale 0 and softcap");
    p = fwd(h), p.dropout_keys = keys;
    expect(hopper_fwd_preferred(p), true, "dropout");
    p.softcap = 30.f;
    expect(hopper_fwd_preferred(p), true, "dropout + softcap");
    p.softcap = 0.f, p.mask = mask;
    expect(hopper_fwd_takes_extras(p), false, "dropout + mask");
    p.mask = nullptr, p.bias = bias;
    expect(hopper_fwd_takes_extras(p), false, "dropout + bias");
    p.bias = nullptr, p.q_segment_ids = p.kv_segment_ids = ids;
    expect(hopper_fwd_takes_extras(p), false, "dropout + segment ids");
  }
  // The Hopper backward: segment ids, bias / mask or dropout, one kind at a time, not with softcap
  // or deterministic.
  auto refuses_softcap_and_deterministic = [](FlashBwdParams b, const char* what) {
    char name[96];
    b.softcap = 30.f;
    std::snprintf(name, sizeof name, "%s + softcap", what);
    expect(hopper_bwd_takes_extras(b), false, name);
    b.softcap = 0.f, b.deterministic = true;
    std::snprintf(name, sizeof name, "%s + deterministic", what);
    expect(hopper_bwd_takes_extras(b), false, name);
  };
  FlashBwdParams b;
  b.head_dim = 128;
  b.tile_counter = counter;
  expect(hopper_bwd_takes_extras(b), true, "bwd plain");
  b.q_segment_ids = b.kv_segment_ids = ids;
  expect(hopper_bwd_takes_extras(b), true, "bwd segment ids");
  refuses_softcap_and_deterministic(b, "bwd segment ids");
  b.bias = bias;
  expect(hopper_bwd_takes_extras(b), false, "bwd bias + segment ids");
  b.q_segment_ids = b.kv_segment_ids = nullptr;
  expect(hopper_bwd_takes_extras(b), true, "bwd bias");
  b.mask = mask;
  expect(hopper_bwd_takes_extras(b), true, "bwd bias + mask");
  b.bias = nullptr, b.tile_counter = nullptr;  // (the Dense kernels need no workspace)
  expect(hopper_bwd_takes_extras(b), true, "bwd mask");
  refuses_softcap_and_deterministic(b, "bwd mask");
  b.dropout_keys = keys;
  expect(hopper_bwd_takes_extras(b), false, "bwd mask + dropout");
  b.mask = nullptr;
  expect(hopper_bwd_takes_extras(b), true, "bwd dropout");
  refuses_softcap_and_deterministic(b, "bwd dropout");
  b.q_segment_ids = b.kv_segment_ids = ids, b.tile_counter = counter;
  expect(hopper_bwd_takes_extras(b), false, "bwd dropout + segment ids");
  std::printf("%d routing failures\n", failures);
  return failures ? 1 : 0;
}
