# diff/: metrics, tolerance rules, comparator and reports; `diffrun compare` and `diffrun --prompt` end to end.
diffrun_test(test_metrics SOURCES test_metrics.cpp LIBS diffrun_diff)
diffrun_test(test_tolerances SOURCES test_tolerances.cpp LIBS diffrun_diff)
diffrun_test(test_compare SOURCES test_compare.cpp LIBS diffrun_diff)
diffrun_test(test_pattern SOURCES test_pattern.cpp LIBS diffrun_diff)
diffrun_test(test_stream SOURCES test_stream.cpp LIBS diffrun_diff)
diffrun_test(test_routing SOURCES test_routing.cpp LIBS diffrun_diff)
# Runs the built diffrun ($DIFFRUN_BIN) on synthetic dumps and on a tiny fixture model.
diffrun_test(test_cli SOURCES test_cli.cpp LIBS diffrun_dump FIXTURES tiny_models TIMEOUT 600)
add_dependencies(test_cli diffrun)

# Python: metrics.py against the C++ JSON report, and the plots (both run the built diffrun on a fixture).
add_test(NAME test_diff_python
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider python/tests/test_metrics_py.py
                 python/tests/test_plot.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_diff_python PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python;MPLBACKEND=Agg")

# Foreign dumps written by h5py: per-head layouts, f16/bf16/f64, optional attributes, coverage, name maps.
add_test(NAME test_foreign_dumps
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_foreign_dumps.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_foreign_dumps PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")

# The reports of a default run on SmolLM2 with an injected fault: one JUnit failure (junitparser), ≤ 1 MB.
add_test(NAME test_reports
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_reports.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_reports PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED smollm2 TIMEOUT 600
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")

# Every command of README.md's "Using it" block runs as shown (a tiny fixture as the default model).
add_test(NAME test_readme_commands
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_readme_commands.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_readme_commands PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 600
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")

# The shipped presets keep the invariants scripts/calibrate_tolerances.py writes them with.
add_test(NAME test_presets
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_presets.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_presets PROPERTIES LABELS "cpu;python" TIMEOUT 120 ENVIRONMENT "${DIFFRUN_TEST_ENV}")

# Sharded dumps: a reference dump split into 2 and 4 rank dumps merges back clean; a seeded shard bug names its rank.
add_test(NAME test_shards
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_shards.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_shards PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python")
