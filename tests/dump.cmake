# dump/: dump writer, reader, size guard and file-layer unit tests, the sample-dump writer, the Python package's
# reader pytest and the dump tests through the built diffrun (validate, size guard, rows).
diffrun_test(test_dump SOURCES test_dump.cpp LIBS diffrun_dump)
diffrun_test(test_dump_size SOURCES test_dump_size.cpp LIBS diffrun_dump)
# Messages the C API passes on: names with _ for -, dims against the layout given, copies from a FIFO, put("").
diffrun_test(test_dump_messages SOURCES test_dump_messages.cpp LIBS diffrun_dump)

# Writes a small dump with the C++ writer (and prints the vocabulary as JSON) for the Python tests.
add_executable(dump_sample dump_sample.cpp)
target_include_directories(dump_sample PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(dump_sample PRIVATE diffrun_dump diffrun_warnings)

add_test(NAME test_dump_reader
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider python/tests/test_dump_reader.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_dump_reader PROPERTIES LABELS "cpu;python"
  ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python;DIFFRUN_DUMP_SAMPLE=$<TARGET_FILE:dump_sample>")

# `diffrun validate` on dumps of the CPU backend, mutated copies and a dump written by hand with h5py;
# test_validate_cuda on the CUDA engine's dump (skips without the engine or a device).
add_test(NAME test_validate
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_validate.py -k "not cuda"
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_validate PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")
add_test(NAME test_validate_cuda
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -rs -p no:cacheprovider tests/test_validate.py -k cuda
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_validate_cuda PROPERTIES LABELS "gpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV}" SKIP_REGULAR_EXPRESSION "[0-9]+ skipped")

# docs/dump-format.md's Python fingerprint against `diffrun inspect` (fixtures and SmolLM2).
add_test(NAME test_dump_format_doc
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_dump_format_doc.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_dump_format_doc PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED "tiny_models;smollm2"
  TIMEOUT 300 ENVIRONMENT "${DIFFRUN_TEST_ENV}")

# The dump size guard through the CLI: estimate against the written file, --max-dump-size, --softmax-rows.
add_test(NAME test_dump_size_cli
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_dump_size.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_dump_size_cli PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")

# Dump volume: cache rows per step, --logits-rows, --token-rows, --compress, read by h5py, the readers, compare, validate.
add_test(NAME test_dump_rows_cli
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider tests/test_dump_rows.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_dump_rows_cli PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED tiny_models TIMEOUT 300
  ENVIRONMENT "${DIFFRUN_TEST_ENV}")
