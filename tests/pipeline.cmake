# cli/pipeline: the top-level job's reports in every --dump mode, --stop-at-first, --threads (a tiny fixture, end to end).
add_test(NAME test_pipeline
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_pipeline.py -k "not cuda"
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_pipeline PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 600
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")
# The CUDA engine's job: its isolation replay beside the pipeline (skips without the engine or a device).
add_test(NAME test_pipeline_cuda
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -rs -p no:cacheprovider tests/test_pipeline.py -k cuda
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_pipeline_cuda PROPERTIES LABELS "gpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 600
  ENVIRONMENT "${DIFFRUN_TEST_ENV}" SKIP_REGULAR_EXPRESSION "[0-9]+ skipped")
