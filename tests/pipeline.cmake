# cli/pipeline: the top-level job's reports in every --dump mode, --stop-at-first, --threads (a tiny fixture, end to end).
add_test(NAME test_pipeline
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_pipeline.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_pipeline PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 600
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")
