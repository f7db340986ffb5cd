# Tests of the tokenizer and chat templates (model/tokenizer*, model/chat_template.cpp).
diffrun_test(test_tokenizer SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_tokenizer.cpp
             LIBS diffrun_model nlohmann_json::nlohmann_json FIXTURES "tiny_models;smollm2")
diffrun_test(test_tokenizer_roundtrip SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_tokenizer_roundtrip.cpp
             LIBS diffrun_model FIXTURES "tiny_models;smollm2" TIMEOUT 120)
diffrun_test(test_chat_template SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_chat_template.cpp
             LIBS diffrun_model FIXTURES "tiny_models;smollm2")
# `diffrun tokenize` on SmolLM2 (the default model): ids with quoted pieces, then the count.
add_test(NAME cli_tokenize COMMAND diffrun tokenize --prompt "Hello world, it's 12")
set_tests_properties(cli_tokenize PROPERTIES ENVIRONMENT "${DIFFRUN_TEST_ENV}" LABELS cpu FIXTURES_REQUIRED smollm2
  PASS_REGULAR_EXPRESSION "^  19556  'Hello'\n    905  ' world'\n     28  ','\n    357  ' it'\n    506  '\\\\'s'\n    216  ' '\n     33  '1'\n     34  '2'\n8 tokens\n$")
add_test(NAME cli_tokenize_chat COMMAND diffrun tokenize --prompt "Hi" --chat --system "Be brief.")
set_tests_properties(cli_tokenize_chat PROPERTIES ENVIRONMENT "${DIFFRUN_TEST_ENV}" LABELS cpu FIXTURES_REQUIRED smollm2
  PASS_REGULAR_EXPRESSION "^      1  '<\\|im_start\\|>'\n   9690  'system'\n    198  '\\\\n'\n.*      2  '<\\|im_end\\|>'\n    198  '\\\\n'\n      1  '<\\|im_start\\|>'\n    520  'ass'\n   9531  'istant'\n    198  '\\\\n'\n[0-9]+ tokens\n$")
# llama.cpp's tokenizer suite (models/ggml-vocab-*.gguf with .inp/.out) from the sdist scripts/build_llamacpp.sh --source unpacks.
diffrun_test(test_tokenizer_llamacpp SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_tokenizer_llamacpp.cpp
             LIBS diffrun_model TIMEOUT 300)
# --no-bos: the tiny llama fixture asks for BOS (SentencePiece's default); without the flag '<s>' comes first.
add_test(NAME cli_tokenize_no_bos COMMAND diffrun tokenize -m ${DIFFRUN_FIXTURE_DIR}/tiny-llama-f32.gguf --prompt ab --no-bos)
set_tests_properties(cli_tokenize_no_bos PROPERTIES ENVIRONMENT "${DIFFRUN_TEST_ENV}" LABELS cpu FIXTURES_REQUIRED tiny_models
  PASS_REGULAR_EXPRESSION "^    260  ' a'\n   1240  'b'\n2 tokens\n$")
add_test(NAME cli_tokenize_bos COMMAND diffrun tokenize -m ${DIFFRUN_FIXTURE_DIR}/tiny-llama-f32.gguf --prompt ab)
set_tests_properties(cli_tokenize_bos PROPERTIES ENVIRONMENT "${DIFFRUN_TEST_ENV}" LABELS cpu FIXTURES_REQUIRED tiny_models
  PASS_REGULAR_EXPRESSION "^      1  '<s>'\n    260  ' a'\n   1240  'b'\n3 tokens\n$")
# A prompt byte that is not UTF-8 and has no token of its own in SmolLM2 (0xff): exit 2 naming its offset.
add_test(NAME cli_tokenize_invalid_utf8
         COMMAND sh -c "\"$0\" tokenize --prompt \"$(printf 'ok \\377')\"; echo \"exit $?\"" $<TARGET_FILE:diffrun>)
set_tests_properties(cli_tokenize_invalid_utf8 PROPERTIES ENVIRONMENT "${DIFFRUN_TEST_ENV}" LABELS cpu FIXTURES_REQUIRED smollm2
  PASS_REGULAR_EXPRESSION "^diffrun: error: invalid UTF-8 at byte offset 3 \\(0xff\\), and the vocabulary has no token for that byte\nexit 2\n$")
