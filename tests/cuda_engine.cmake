# examples/cuda_engine (label gpu): the CUDA example engine, recording inside its CUDA graph through the C API's device
# puts, against the f64 CPU reference on tiny-llama-f16; clean it passes, --bug rope-pos is Qrope-0 at step 1. Skips
# (exit 77) without a CUDA device.
if(TARGET cuda_engine)
  add_test(NAME example_cuda_engine
           COMMAND bash examples/cuda_engine/test_cuda_engine.sh $<TARGET_FILE:cuda_engine> $<TARGET_FILE:diffrun>
                   ${DIFFRUN_FIXTURE_DIR}/tiny-llama-f16.gguf
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(example_cuda_engine PROPERTIES LABELS gpu FIXTURES_REQUIRED tiny_models SKIP_RETURN_CODE 77
                       TIMEOUT 300 ENVIRONMENT "${DIFFRUN_TEST_ENV}")
endif()
