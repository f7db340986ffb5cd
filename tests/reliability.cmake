# Reliability through the built diffrun: signals (temporaries removed, exit 130/143), pairs from different runs, stale temporaries, bad input (exit 2, one clear line), the reports of a failed run.
diffrun_test(test_interrupt SOURCES test_interrupt.cpp LIBS diffrun_dump FIXTURES tiny_models TIMEOUT 300)
add_dependencies(test_interrupt diffrun)
# Bad paths and values, the reports of a failed run, odd bytes in prompts and GGUF strings, integer checkpoints.
diffrun_test(test_reliability SOURCES test_reliability.cpp LIBS diffrun_dump FIXTURES tiny_models TIMEOUT 300)
add_dependencies(test_reliability diffrun)
# Hostile inputs through the built diffrun and the Python package: dumps reaching outside themselves (links,
# external storage, virtual datasets), a planted temporary, non-regular outputs, an absurd block_count,
# a missing step, a closed output pipe.
add_test(NAME test_hostile_inputs
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_hostile_inputs.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_hostile_inputs PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python")
# Hostile and damaged dumps and name maps: compression bombs, the read limit, the attribute table's types,
# data only a read finds damaged (validate reads what compare reads), hostile maps, control characters,
# swapped compare arguments.
add_test(NAME test_hostile_dumps
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_hostile_dumps.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_hostile_dumps PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 600
  ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python")
