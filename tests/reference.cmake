# Tests of the CPU reference (reference_cpu/): ops against naive loops, the model end to end, goldens.
diffrun_test(test_reference_ops SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_reference_ops.cpp
             LIBS diffrun_reference)
diffrun_test(test_reference_model SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_reference_model.cpp
             ${PROJECT_SOURCE_DIR}/cli/run.cpp ${PROJECT_SOURCE_DIR}/cli/options.cpp
             LIBS diffrun_reference diffrun_dump CLI11::CLI11 FIXTURES "tiny_models;smollm2" TIMEOUT 600)
diffrun_test(test_reference_goldens SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_reference_goldens.cpp
             LIBS diffrun_reference nlohmann_json::nlohmann_json FIXTURES "tiny_models;smollm2" TIMEOUT 300)
add_dependencies(test_reference_model diffrun)
diffrun_test(test_reference_weights SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_reference_weights.cpp
             LIBS diffrun_reference FIXTURES "tiny_models;smollm2" TIMEOUT 600)
# It holds the reference's Eigen types (weights.hpp), so it is built as reference_cpu/ is (-march=native).
target_compile_definitions(test_reference_weights PRIVATE EIGEN_DONT_PARALLELIZE)
if(DIFFRUN_REFERENCE_NATIVE AND DIFFRUN_HAVE_MARCH_NATIVE)
  target_compile_options(test_reference_weights PRIVATE -march=native)
endif()
# Llama 3 RoPE scaling: the reference's Qrope/Krope on tiny-llama3rope against numpy with the gguf package's factors.
add_test(NAME test_reference_rope_scaling
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_rope_scaling.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_reference_rope_scaling PROPERTIES LABELS cpu FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")
# Mistral's sliding window on llama: tiny-mistral's key read, not applied (as llama.cpp), kq_soft_max against numpy.
add_test(NAME test_reference_sliding_window
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_sliding_window.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_reference_sliding_window PROPERTIES LABELS cpu FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")
