# The CUDA backend: portable sm80 kernels, optional sm_90a Hopper kernels, the CUDA FFI
# handlers. Included from CMakeLists.txt when JF_WITH_CUDA is ON.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

set(JF_HOPPER_ARCHS 90a-real)
if(JAX_FLASH_PTX_ONLY)
  set(JAX_FLASH_CUDA_ARCHS 80-virtual)
  set(JF_HOPPER_ARCHS 90a-virtual)
endif()
if(JAX_FLASH_CUDA_ARCHS STREQUAL "")
  set(JF_PORTABLE_ARCHS 80-real 90-real 90-virtual)
else()
  set(JF_PORTABLE_ARCHS ${JAX_FLASH_CUDA_ARCHS})
endif()

# CuTe/CUTLASS headers from the nvidia-cutlass wheel (or CUTLASS_INCLUDE_DIR).
if(NOT CUTLASS_INCLUDE_DIR)
  execute_process(COMMAND "${Python_EXECUTABLE}" -c
                  "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
                  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE CUTLASS_INCLUDE_DIR RESULT_VARIABLE jf_cutlass_rc)
  if(NOT jf_cutlass_rc EQUAL 0)
    set(CUTLASS_INCLUDE_DIR "")
  endif()
endif()
message(STATUS "CuTe/CUTLASS headers: ${CUTLASS_INCLUDE_DIR}")

include(${CMAKE_SOURCE_DIR}/cuda/sm80/sources.cmake)
set(JF_SM90_SOURCES "")
if(JAX_FLASH_HOPPER AND EXISTS ${CMAKE_SOURCE_DIR}/cuda/sm90/sources.cmake)
  include(${CMAKE_SOURCE_DIR}/cuda/sm90/sources.cmake)
  include(${CMAKE_SOURCE_DIR}/cuda/sm90/sources_bwd.cmake)
  list(APPEND JF_SM90_SOURCES ${JF_SM90_BWD_SOURCES})
endif()

set(jf_cuda_flags --expt-relaxed-constexpr --expt-extended-lambda -O3 -DNDEBUG -lineinfo)

# The kernels are static libraries so that they can be compiled once on a machine with
# nvcc and linked into an extension built elsewhere (JAX_FLASH_PREBUILT_KERNELS_DIR).
if(JAX_FLASH_PREBUILT_KERNELS_DIR)
  message(STATUS "Linking prebuilt kernels from ${JAX_FLASH_PREBUILT_KERNELS_DIR}")
  target_link_libraries(_jax_flash PRIVATE ${JAX_FLASH_PREBUILT_KERNELS_DIR}/libjf_sm80.a)
  if(EXISTS ${JAX_FLASH_PREBUILT_KERNELS_DIR}/libjf_sm90.a)
    target_link_libraries(_jax_flash PRIVATE ${JAX_FLASH_PREBUILT_KERNELS_DIR}/libjf_sm90.a)
    target_compile_definitions(_jax_flash PRIVATE JAX_FLASH_WITH_SM90)
  endif()
  set(JF_SM80_SOURCES "")
  set(JF_SM90_SOURCES "")
endif()

if(JF_SM80_SOURCES)
add_library(jf_sm80 STATIC ${JF_SM80_SOURCES})
set_target_properties(jf_sm80 PROPERTIES CUDA_ARCHITECTURES "${JF_PORTABLE_ARCHS}" POSITION_INDEPENDENT_CODE ON)
target_compile_options(jf_sm80 PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${jf_cuda_flags}>)
target_include_directories(jf_sm80 PRIVATE ${CMAKE_SOURCE_DIR}/cuda ${CUTLASS_INCLUDE_DIR})
target_compile_features(jf_sm80 PRIVATE cuda_std_17)
target_link_libraries(_jax_flash PRIVATE jf_sm80)
endif()
target_sources(_jax_flash PRIVATE cuda/ffi/cuda_handlers.cc)

if(JF_SM90_SOURCES)
  add_library(jf_sm90 STATIC ${JF_SM90_SOURCES})
  # wgmma and setmaxnreg need the arch-specific sm_90a target.
  set_target_properties(jf_sm90 PROPERTIES CUDA_ARCHITECTURES "${JF_HOPPER_ARCHS}" POSITION_INDEPENDENT_CODE ON)
  target_compile_options(jf_sm90 PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${jf_cuda_flags}>)
  # CuTe's wgmma shapes with N not a power-of-two multiple of 8 (m64n80k16: the 80-row backward).
  target_compile_definitions(jf_sm90 PRIVATE CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
  target_include_directories(jf_sm90 PRIVATE ${CMAKE_SOURCE_DIR}/cuda ${CUTLASS_INCLUDE_DIR})
  target_compile_features(jf_sm90 PRIVATE cuda_std_17)
  target_link_libraries(_jax_flash PRIVATE jf_sm90)
  target_compile_definitions(_jax_flash PRIVATE JAX_FLASH_WITH_SM90)
endif()

target_compile_definitions(_jax_flash PRIVATE JAX_FLASH_WITH_CUDA)
target_include_directories(_jax_flash PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
# Static cudart: the extension loads on machines without a CUDA toolkit; the driver
# (libcuda) is only needed once a kernel runs.
target_link_libraries(_jax_flash PRIVATE CUDA::cudart_static)
