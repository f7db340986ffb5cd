# tests/llamacpp.cmake: the llama.cpp adapter end to end (label llamacpp; skips unless scripts/build_llamacpp.sh ran and -DDIFFRUN_LLAMACPP_DIR is set).
if(TARGET diffrun_llamacpp)
  set(_diffrun_llamacpp_bin $<TARGET_FILE:diffrun_llamacpp>)
else()
  set(_diffrun_llamacpp_bin "")
endif()
add_test(NAME llamacpp_smollm2_f32 COMMAND adapters/llamacpp/e2e_test.sh WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(llamacpp_smollm2_f32 PROPERTIES LABELS llamacpp SKIP_RETURN_CODE 77 TIMEOUT 600
                     ENVIRONMENT "${DIFFRUN_TEST_ENV};DIFFRUN_LLAMACPP_BIN=${_diffrun_llamacpp_bin}")
