# tests/engine.cmake: the CUDA engine's GPU tests (label gpu; each skips with a message without a device).
if(DIFFRUN_HAVE_CUDA)
  diffrun_test(test_engine_dequant GPU SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_dequant.cpp
               LIBS diffrun_engine diffrun_model)
  diffrun_test(test_engine_qgemv GPU SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_qgemv.cpp
               LIBS diffrun_engine diffrun_model)
  # The same tests with the K-quants' f16 GEMV on the SIMT kernel (DIFFRUN_QGEMV_MMA=0) instead of tensor cores.
  add_test(NAME test_engine_qgemv_simt COMMAND ${PROJECT_SOURCE_DIR}/tests/run_gtest.sh $<TARGET_FILE:test_engine_qgemv>
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(test_engine_qgemv_simt PROPERTIES ENVIRONMENT "${DIFFRUN_TEST_ENV};DIFFRUN_QGEMV_MMA=0"
                       SKIP_RETURN_CODE 77 LABELS gpu)
  # tests/engine_ops/: the unfused kernels (rope_norm, rope_neox, kv_store) that the engine's fused ones
  # (rope_qk) are checked against; only this test calls them, so they are compiled into it, not
  # into diffrun_engine.
  file(GLOB test_engine_ops_kernels CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/engine_ops/*.cu)
  diffrun_test(test_engine_ops GPU SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_ops.cpp ${test_engine_ops_kernels}
               LIBS diffrun_engine diffrun_reference)
  target_compile_options(test_engine_ops PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo -Xcompiler=-Wall>)
  diffrun_test(test_engine_model GPU SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_model.cpp
               LIBS diffrun_engine diffrun_reference FIXTURES tiny_models TIMEOUT 900)
  # DIFFRUN_SMOLLM2_SLICE and DIFFRUN_QWEN05B (optional model paths) pass through ctest's environment.
endif()
# The tensor-parallel engine (label gpu; skips with a message on a host of fewer than 2 GPUs), and its weight cut
# (host code, no device: label cpu).
if(DIFFRUN_HAVE_CUDA)
  diffrun_test(test_weight_cut SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_weight_cut.cpp LIBS diffrun_engine diffrun_model
               FIXTURES tiny_models)
  diffrun_test(test_engine_tp GPU SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_tp.cpp
               LIBS diffrun_engine FIXTURES tiny_models TIMEOUT 900)
endif()
