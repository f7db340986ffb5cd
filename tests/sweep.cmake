# diffrun sweep on the tiny fixtures, CPU pair: the statistics, a fault's grouped problem, drill-down and minimal
# case (re-run through the main job), the reports, a killed sweep's partial report, bad corpora (exit 2).
add_test(NAME test_sweep
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_sweep.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_sweep PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 600
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")
