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
  static uint8_t mask[4];
  static float bias[4];
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
    // ... but the portable forward is faster for it at head dims <= 64 (session 16).
    expect(hopper_fwd_preferred(p), h > 64, "bias: where it runs");
    p.mask = mask;
    expect(hopper_fwd_preferred(p), h > 64, "bias and mask");
    // The Hopper forward adds bias / scale to the unscaled logits: no bias with scale 0 there.
    p = fwd(h), p.bias = bias, p.scale = 0.f;
    expect(hopper_fwd_takes_extras(p), false, "bias with scale 0");
    p.softcap = 5.f;  // with softcap the bias is added in units of 1 / softcap
    expect(hopper_fwd_takes_extras(p), true, "bias with scale 0 and softcap");
    p = fwd(h), p.mask = mask, p.dropout_keys = keys;
    expect(hopper_fwd_takes_extras(p), false, "dropout");
  }
  // The Hopper backward: segment ids alone, not with softcap or deterministic.
  FlashBwdParams b;
  b.head_dim = 128;
  b.tile_counter = counter;
  expect(hopper_bwd_takes_extras(b), true, "bwd plain");
  b.q_segment_ids = b.kv_segment_ids = ids;
  expect(hopper_bwd_takes_extras(b), true, "bwd segment ids");
  b.softcap = 30.f;
  expect(hopper_bwd_takes_extras(b), false, "bwd segment ids + softcap");
  b.softcap = 0.f, b.deterministic = true;
  expect(hopper_bwd_takes_extras(b), false, "bwd segment ids + deterministic");
  b.deterministic = false, b.bias = bias;
  expect(hopper_bwd_takes_extras(b), false, "bwd bias");
  b.bias = nullptr, b.mask = mask;
  expect(hopper_bwd_takes_extras(b), false, "bwd mask");
  std::printf("%d routing failures\n", failures);
  return failures ? 1 : 0;
}
