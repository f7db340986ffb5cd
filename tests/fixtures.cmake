# tests/fixtures.cmake: ctest fixtures tiny_models (generated GGUFs) and smollm2 (fetched model), and the fixture pytest.
add_test(NAME fixtures_generate
         COMMAND ${Python3_EXECUTABLE} scripts/gen_fixtures.py --out ${DIFFRUN_FIXTURE_DIR}
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(fixtures_generate PROPERTIES FIXTURES_SETUP tiny_models LABELS cpu
                     ENVIRONMENT "${DIFFRUN_TEST_ENV}")

add_test(NAME model_smollm2_present
         COMMAND scripts/fetch_models --check
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(model_smollm2_present PROPERTIES FIXTURES_SETUP smollm2 LABELS cpu
                     ENVIRONMENT "${DIFFRUN_TEST_ENV}")

add_test(NAME fixtures_pytest
         COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider scripts/tests/test_fixtures.py
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(fixtures_pytest PROPERTIES FIXTURES_REQUIRED "tiny_models;smollm2" LABELS cpu
                     ENVIRONMENT "${DIFFRUN_TEST_ENV}" TIMEOUT 300)
