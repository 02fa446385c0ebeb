// The extension module: hands XLA the FFI handlers as capsules; Python registers them
// with jax.ffi.register_ffi_target (jax_flash/_ffi.py).
#include <nanobind/nanobind.h>

#include "handlers.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule encapsulate(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_flash, m) {
  // {platform: {target name: capsule}}
  m.def("registrations", []() {
    nb::dict cpu;
    cpu["jax_flash_fwd"] = encapsulate(JaxFlashFwdCpu);
    cpu["jax_flash_bwd"] = encapsulate(JaxFlashBwdCpu);
    nb::dict out;
    out["cpu"] = cpu;
#ifdef JAX_FLASH_WITH_CUDA
    nb::dict cuda;
    cuda["jax_flash_fwd"] = encapsulate(JaxFlashFwdCuda);
    cuda["jax_flash_bwd"] = encapsulate(JaxFlashBwdCuda);
    out["CUDA"] = cuda;
#endif
    return out;
  });
  m.attr("with_cuda") =
#ifdef JAX_FLASH_WITH_CUDA
      true;
#else
      false;
#endif
}
