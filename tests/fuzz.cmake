# fuzz/: each fuzz target, built in the test build as a plain executable (fuzz/replay_main.cpp), replays a
# small corpus, so the targets build and run in CI (scripts/fuzz_all runs the libFuzzer build).
add_test(NAME fuzz_replay_gguf
         COMMAND $<TARGET_FILE:fuzz_gguf> ${DIFFRUN_FIXTURE_DIR}/tiny-llama-q4_k.gguf ${DIFFRUN_FIXTURE_DIR}/tiny-gemma3-kmix.gguf)
set_tests_properties(fuzz_replay_gguf PROPERTIES LABELS cpu FIXTURES_REQUIRED tiny_models TIMEOUT 120)
add_test(NAME fuzz_replay_tolerances COMMAND $<TARGET_FILE:fuzz_tolerances> ${PROJECT_SOURCE_DIR}/fixtures/tolerances)
set_tests_properties(fuzz_replay_tolerances PROPERTIES LABELS cpu TIMEOUT 120)
file(GLOB diffrun_fuzz_dump_inputs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/data/*.h5)
add_test(NAME fuzz_replay_dump COMMAND $<TARGET_FILE:fuzz_dump> ${diffrun_fuzz_dump_inputs})
set_tests_properties(fuzz_replay_dump PROPERTIES LABELS cpu TIMEOUT 120
  ENVIRONMENT "FUZZ_DUMP_DIR=${CMAKE_CURRENT_BINARY_DIR}")
