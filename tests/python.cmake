# The Python package (python/): writer and fingerprint against the C++ side, and the validator.
add_test(NAME test_python_package
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider python/tests/test_writer.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(test_python_package PROPERTIES LABELS "cpu;python" FIXTURES_REQUIRED "tiny_models;smollm2"
  TIMEOUT 300 ENVIRONMENT "${DIFFRUN_TEST_ENV};PYTHONPATH=${PROJECT_SOURCE_DIR}/python")
