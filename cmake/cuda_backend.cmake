# The CUDA backend: portable sm80 kernels, optional sm_90a Hopper kernels, the CUDA FFI
# handlers. Included from CMakeLists.txt when JF_WITH_CUDA is ON.
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

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
endif()

# Keep only the requested head-dim instantiations (files named *hdim<D>_*); dispatchers
# learn what exists through JF_HDIM_<D> definitions.
set(jf_hdims 32 64 96 128 192 256)
if(NOT JAX_FLASH_HEAD_DIMS STREQUAL "")
  set(jf_hdims ${JAX_FLASH_HEAD_DIMS})
endif()
function(jf_filter_hdims out_var)
  set(kept "")
  foreach(src ${ARGN})
    if(src MATCHES "hdim([0-9]+)_")
      list(FIND jf_hdims "${CMAKE_MATCH_1}" idx)
      if(idx GREATER -1)
        list(APPEND kept ${src})
      endif()
    else()
      list(APPEND kept ${src})
    endif()
  endforeach()
  set(${out_var} ${kept} PARENT_SCOPE)
endfunction()
jf_filter_hdims(JF_SM80_SOURCES ${JF_SM80_SOURCES})
jf_filter_hdims(JF_SM90_SOURCES ${JF_SM90_SOURCES})

set(jf_hdim_defs "")
foreach(d ${jf_hdims})
  list(APPEND jf_hdim_defs JF_HDIM_${d}=1)
endforeach()

set(jf_cuda_flags --expt-relaxed-constexpr --expt-extended-lambda -O3 -DNDEBUG --use_fast_math -lineinfo)

add_library(jf_sm80 OBJECT ${JF_SM80_SOURCES})
set_target_properties(jf_sm80 PROPERTIES CUDA_ARCHITECTURES "${JF_PORTABLE_ARCHS}" POSITION_INDEPENDENT_CODE ON)
target_compile_options(jf_sm80 PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${jf_cuda_flags}>)
target_compile_definitions(jf_sm80 PRIVATE ${jf_hdim_defs})
target_include_directories(jf_sm80 PRIVATE ${CMAKE_SOURCE_DIR}/cuda ${CUTLASS_INCLUDE_DIR})
target_compile_features(jf_sm80 PRIVATE cuda_std_17)
target_sources(_jax_flash PRIVATE $<TARGET_OBJECTS:jf_sm80> cuda/ffi/cuda_handlers.cc)

if(JF_SM90_SOURCES)
  add_library(jf_sm90 OBJECT ${JF_SM90_SOURCES})
  # wgmma and setmaxnreg need the arch-specific sm_90a target.
  set_target_properties(jf_sm90 PROPERTIES CUDA_ARCHITECTURES "90a-real" POSITION_INDEPENDENT_CODE ON)
  target_compile_options(jf_sm90 PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:${jf_cuda_flags}>)
  target_compile_definitions(jf_sm90 PRIVATE ${jf_hdim_defs})
  target_include_directories(jf_sm90 PRIVATE ${CMAKE_SOURCE_DIR}/cuda ${CUTLASS_INCLUDE_DIR})
  target_compile_features(jf_sm90 PRIVATE cuda_std_17)
  target_sources(_jax_flash PRIVATE $<TARGET_OBJECTS:jf_sm90>)
  target_compile_definitions(_jax_flash PRIVATE JAX_FLASH_WITH_SM90)
endif()

target_compile_definitions(_jax_flash PRIVATE JAX_FLASH_WITH_CUDA)
target_include_directories(_jax_flash PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
# Static cudart: the extension loads on machines without a CUDA toolkit; the driver
# (libcuda) is only needed once a kernel runs.
target_link_libraries(_jax_flash PRIVATE CUDA::cudart_static)
